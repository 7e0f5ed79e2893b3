"""Training apart from decoding: the one pipeline every trained drafter goes through.

ShareGPT prompts (``sharegpt``) -> self-distilled answers (``distill``, in resumable ``shards``) -> token
sequences, shipped or cached (``sequences``) -> the frozen target's features (``features``; both sets from
``dataset``) -> length-bucketed batches (``batches``) -> the method's objective (``losses``) -> the loop on
``accelerate`` (``loop``, settings in ``config``), saving resumable training states (``state``) -> a
checkpoint and its card (``card``).

A method file holds its network and its decoding, and names its objective through the ``TrainedDrafter``
hooks (``new_network``, ``training_loss``, ``tapped_layers``), which call into ``losses``. This package's
``__init__`` imports nothing, so a method naming its objective loads ``losses`` alone, not the loop.
"""
