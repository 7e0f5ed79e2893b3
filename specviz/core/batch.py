"""Decoding several sequences at once: every sequence's draft tree verified in one target forward.

The loop is ``engine.generate``'s (draft -> verify -> accept -> commit), over a batch of *lanes*, one per
sequence: each an ``engine.Decode`` (its own drafter state and sampling generator) with a row of a
``BatchSlabCache``, settled after the verify by ``engine.settle``, the step ``generate`` takes too:

- a joining lane prefills alone (a forward of its prompt into a one-sequence cache, whose rows then move
  into the lane's row of the batch cache): a prompt's logits are needed at its last position only;
- each step, every lane feeds its root and draft tree. The blocks are padded to the longest; a 4D mask gives
  each row what its own decode would see (its committed context, then its tree's mask) and hides the rest;
- each lane accepts and commits on its own, so lanes advance by different amounts;
- a lane that ends leaves the batch and the next prompt joins in its place (continuous batching).

At batch size 1 this is ``engine.generate``: the same drafter calls, the same accept rule, one lane. A lane's
records are its own, but a step's timings are the whole batch's step: a sequence's speed is its tokens over
the batch's wall clock, not over its records' time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

import torch

from .batch_cache import BatchSlabCache
from .cache import SlabCache, full_attention_only
from .engine import Decode, StepRecord, check_request, settle
from .protocol import Drafter
from .target import TargetError, TargetModel
from .timing import PhaseTimer
from .transfer import to_device
from .tree import DraftTree, on_host
from .verify import Sampling, follows_argmax, top_ids


def drafted_blocks(lanes: list[Decode], drafter: Drafter, sampling: Sampling, pasts: list[int]) -> list[tuple]:
    """Per lane, (tree, input ids, positions, tree mask [n, n]) of what it feeds this step, where the trees are (on a
    GPU, read after the verify with the target's answer); the drafter drafts for every lane at once
    (``Drafter.propose_batch``)."""
    trees = drafter.propose_batch([lane.state for lane in lanes], [lane.request(sampling) for lane in lanes])
    return [(tree, tree.input_ids(lane.sequence[-1]), tree.positions(past)[0], tree.ancestors())
            for tree, lane, past in zip(trees, lanes, pasts)]


def batch_mask(pasts: list[int], blocks: list[torch.Tensor], dtype: torch.dtype,
               device: torch.device | None = None) -> torch.Tensor:
    """[B, 1, n, max(past) + n] additive mask: row b's query j (j < its block's n_b) sees its committed
    positions ``[0, past_b)`` and, inside its block, what ``blocks[b]`` allows. A padding query sees only itself,
    so no row of the softmax is empty (an empty one is NaN, and NaN keys would poison later reads). Built on
    ``device`` (None: the first block's)."""
    n, device = max(block.shape[0] for block in blocks), device or blocks[0].device
    width = max(pasts) + n
    allowed = torch.zeros(len(blocks), n, width, dtype=torch.bool, device=device)
    for b, (past, block) in enumerate(zip(pasts, blocks)):
        m = block.shape[0]
        allowed[b, :m, :past] = True
        allowed[b, :m, past: past + m] = to_device(block, device)
        pad = torch.arange(m, n, device=device)
        allowed[b, pad, past + pad] = True
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def batch_capacity(prompts: Sequence[list[int]], limits: int | Sequence[int]) -> int:
    """The tokens a batch's cache holds a sequence: the longest prompt with its limit, and 64 for a tree's entries."""
    limits = [limits] * len(prompts) if isinstance(limits, int) else list(limits)
    return max((len(p) + limit for p, limit in zip(prompts, limits)), default=1) + 64


def generate_batch(
    target: TargetModel,
    drafter: Drafter,
    prompts: Sequence[list[int]],
    max_new_tokens: int | Sequence[int] = 128,
    sampling: Sampling | None = None,
    batch_size: int = 4,
    stop_on_eos: bool = True,
    seeds: Sequence[int | None] | None = None,
    capacity: int | None = None,
) -> Iterator[tuple[int, StepRecord]]:
    """Yield ``(prompt index, record)`` for every lane's prefill and steps, ``batch_size`` lanes at a time.

    Each prompt decodes as ``engine.generate`` would decode it alone: its own drafter state, its own token
    limit (``max_new_tokens``, one for all or one per prompt) and its own generator seeded with ``seeds[i]``
    (default: ``sampling.seed`` for every prompt). ``capacity``: the tokens the cache holds a sequence
    (default ``batch_capacity``; a warm-up passes its timed run's, so both take the same buffers)."""
    sampling = sampling or Sampling()
    if batch_size < 1:
        raise TargetError(f"batch_size must be at least 1, got {batch_size}")
    if not full_attention_only(target.config):
        raise TargetError("decoding a batch needs a target whose layers are all full attention")
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(prompts):
        raise TargetError(f"{len(limits)} token limits for {len(prompts)} prompts")
    for ids, limit in zip(prompts, limits):
        check_request(target, ids, limit)
    seeds = list(seeds) if seeds is not None else [sampling.seed] * len(prompts)
    eos = target.text.eos_token_ids if stop_on_eos else frozenset()
    capacity = capacity or batch_capacity(prompts, limits)
    cache = target.new_batch_cache(min(batch_size, max(len(prompts), 1)), capacity)
    waiting, lanes = deque(range(len(prompts))), []
    while waiting or lanes:
        while waiting and len(lanes) < batch_size:  # joiners take the free rows, each prefilled alone
            i = waiting.popleft()
            gen = torch.Generator().manual_seed(seeds[i]) if seeds[i] is not None else None
            lane = Decode(list(prompts[i]), limits[i], drafter.start(), gen, index=i)
            record = _prefill(target, drafter, cache, lane, sampling, eos, capacity)
            yield i, record
            if record.finished is None:
                lanes.append(lane)
            else:
                cache.drop(cache.active - 1)
        if not lanes:
            continue
        timer, pasts = PhaseTimer(target.device), cache.lengths
        with timer("draft"):
            fed = drafted_blocks(lanes, drafter, sampling, pasts)
        with timer("verify"):
            for (tree, _, _, _), past in zip(fed, pasts):
                if past + tree.max_depth + 1 > target.max_length:
                    raise TargetError(f"verifying {tree.max_depth + 1} positions after {past} exceeds the "
                                      f"context of {target.max_length}")
            n, device = max(ids.numel() for _, ids, _, _ in fed), target.device  # lanes' trees: either side
            ids = torch.zeros(len(lanes), n, dtype=torch.long, device=device)
            positions = torch.zeros(len(lanes), n, dtype=torch.long, device=device)
            for b, (_, row_ids, row_positions, _) in enumerate(fed):
                m = row_ids.numel()
                ids[b, :m], positions[b, :m] = to_device(row_ids, device), to_device(row_positions, device)
                positions[b, m:] = positions[b, m - 1]  # padding: any position; nothing real sees it
            mask = batch_mask(pasts, [block for *_, block in fed], target.dtype, device)
            logits, feats = target.forward_rows(ids, positions, mask, cache)
        ended = []
        with timer("accept"):  # every lane's tree, and the argmax where the rule reads only that: one copy
            argmax = follows_argmax(sampling)
            trees, read = on_host([tree for tree, *_ in fed], [top_ids(logits)] if argmax else [])
            tops = read[0].tolist() if argmax else [None] * len(lanes)
        for b, (lane, tree, (_, row_ids, _, _), past) in enumerate(zip(lanes, trees, fed, pasts)):
            m = row_ids.numel()
            top = tops[b][:m] if tops[b] is not None else None
            record = settle(drafter, lane, tree, logits[b, :m], feats[b, :m], None,
                            lambda keep, b=b, past=past: cache.keep(b, past, keep), sampling, eos, timer, top=top)
            if record.finished is not None:
                ended.append(b)
            yield lane.index, record
        for b in sorted(ended, reverse=True):  # the last live row moves into a freed one: mirror it
            moved = cache.drop(b)
            if moved is not None:
                lanes[b] = lanes[moved]
            lanes.pop()


def _prefill(target, drafter, cache: BatchSlabCache, lane: Decode, sampling: Sampling, eos,
             capacity: int) -> StepRecord:
    """A joining lane's step 0, alone: its prompt into a one-sequence cache, then into a new row of ``cache``."""
    timer = PhaseTimer(target.device)
    with timer("verify"):
        single = SlabCache(target.num_layers, capacity)
        logits, feats = target.prefill(lane.prompt, single)
        cache.adopt(cache.add(), single)
    return settle(drafter, lane, DraftTree.empty(), logits[None], feats, None, None, sampling, eos, timer)


def run_batch(target: TargetModel, drafter: Drafter, prompts: Sequence[list[int]],
              max_new_tokens: int | Sequence[int] = 128,
              sampling: Sampling | None = None, batch_size: int = 4, stop_on_eos: bool = True,
              seeds: Sequence[int | None] | None = None) -> list[list[StepRecord]]:
    """Every prompt's records, in the prompts' order (``generate_batch``'s arguments)."""
    records: list[list[StepRecord]] = [[] for _ in prompts]
    for i, record in generate_batch(target, drafter, prompts, max_new_tokens, sampling, batch_size, stop_on_eos,
                                    seeds):
        records[i].append(record)
    return records
