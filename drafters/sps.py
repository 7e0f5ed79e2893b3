"""Two-model speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a small assistant LM drafts a
chain token by token, from tokens alone, with its own KV cache; the target verifies the chain in one pass.

The assistant is any causal LM with the target's tokenizer (``assistant=``), or the one trained here for the
target (``checkpoint``; the shipped one by default): a small Llama decoder (transformers' ``LlamaModel``) that
reads the target's token embeddings and scores the draft vocabulary through the target's head rows, as every
trained drafter does (``FrozenTarget``), so it ships only its own layers. It reads none of the target's
features, so its training needs none: it learns the target's own greedy answers (the self-distilled data),
a hard label per position, with cross-entropy.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaModel

from specviz.core.errors import SettingsError
from specviz.core.protocol import BudgetGrid, Settings
from specviz.core.target import cache_kwarg

from .chain_lm import ChainLMDrafter
from .checkpoint import CheckpointError
from .eagle2 import layer_config
from .trained import TrainedDrafter
from .vocab_head import FrozenTarget

LAYERS, NARROWER = 1, 2  # the assistant trained here: one decoder layer, its MLP half the target's width


@dataclass
class AssistantSettings(Settings):
    assistant: str = ""  # HF id or folder of an assistant model; empty: the assistant trained here (``checkpoint``)
    checkpoint: str = ""  # folder; empty = the shipped one in assets/drafters/sps
    num_tokens: int = 4
    dtype: str = "float32"  # an HF assistant's
    ranges = {"num_tokens": (1, 32)}

    @classmethod
    def budget_grids(cls, target) -> list[BudgetGrid]:
        return [BudgetGrid("num_tokens")]


def check_same_vocab(target, model, tokenizer) -> None:
    mine = target.text.tokenizer
    if mine is not None and tokenizer is not None:
        if mine.get_vocab() != tokenizer.get_vocab():
            raise SettingsError("the assistant's tokenizer differs from the target's; "
                                "speculative sampling needs the same one")
    rows = model.get_output_embeddings().weight.shape[0]
    if rows < target.vocab_size:
        raise SettingsError(f"the assistant has {rows} vocabulary rows; the target needs {target.vocab_size}")


class AssistantNet(nn.Module):
    """A small Llama decoder over token embeddings: no embedding or LM head of its own (the target's serve)."""

    def __init__(self, config):
        super().__init__()
        self.body = LlamaModel(config)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """The final-norm output at every position: the head's input."""
        out = self.body(inputs_embeds=embeds, position_ids=positions, use_cache=cache is not None,
                        **cache_kwarg(self.body, cache))
        return out.last_hidden_state


class AssistantLM(nn.Module):
    """The trained assistant as ``ChainLMDrafter`` calls a causal LM: token ids in, logits over the whole
    vocabulary out (the draft vocabulary's scattered in, every other token -inf, so it is never drafted)."""

    def __init__(self, net: AssistantNet, frozen: FrozenTarget, vocab_size: int):
        super().__init__()
        self.net, self.frozen, self.vocab_size = net, frozen, vocab_size
        self.config = net.body.config  # the draft cache is built from it

    def forward(self, input_ids, position_ids, past_key_values=None, use_cache=True, logits_to_keep=1):
        embeds = self.frozen.embed(input_ids).to(next(self.net.parameters()).dtype)
        head_in = self.net(embeds, position_ids, past_key_values)[:, -logits_to_keep:]
        draft = self.frozen.logits(head_in).float()
        logits = draft.new_full((*draft.shape[:-1], self.vocab_size), float("-inf"))
        logits[..., self.frozen.vocab_map] = draft
        return SimpleNamespace(logits=logits)


class AssistantDrafter(ChainLMDrafter, TrainedDrafter):
    name = "sps"
    title = "Two-model speculative sampling (assistant LM)"
    trained = True
    reads_features = False  # tokens in, tokens out

    def __init__(self, target, settings: AssistantSettings | None = None, model=None, tokenizer=None):
        self.settings = settings or AssistantSettings()
        self.net = self.card = None
        if model is None and self.settings.assistant:
            from specviz.core.load import load_causal_lm

            model, tokenizer = load_causal_lm(self.settings.assistant, self.settings.dtype, str(target.device))
        if model is not None:
            check_same_vocab(target, model, tokenizer)
        else:
            try:
                TrainedDrafter.__init__(self, target, self.settings)  # the assistant trained here
            except CheckpointError as e:
                raise CheckpointError(f"{e}; or give sps any assistant LM with the target's tokenizer: "
                                      "assistant=HF_ID_OR_FOLDER (the app: --assistant)") from None
            model = AssistantLM(self.net, self.frozen, target.vocab_size)
        ChainLMDrafter.__init__(self, model, self.settings.num_tokens, target.vocab_size)

    def num_parameters(self) -> int:
        return TrainedDrafter.num_parameters(self) if self.net is not None else ChainLMDrafter.num_parameters(self)

    # -- the training protocol (``drafters/training/loop.py``) ------------------------------------
    @classmethod
    def new_network(cls, target, **shape) -> nn.Module:
        own = {"num_hidden_layers": LAYERS, "intermediate_size": target.config.intermediate_size // NARROWER}
        return AssistantNet(layer_config(target.config, **{**own, **shape}))

    @classmethod
    def training_loss(cls, net, frozen, tokens, feats, valid, evaluate=False, done=1.0):
        """Cross-entropy on the next token, where it is the target's own (``valid``: inside the answer). A token
        outside the draft vocabulary cannot be drafted: it counts as a miss and adds no loss."""
        index = torch.full((int(frozen.vocab_map.max()) + 2,), -1, dtype=torch.long, device=tokens.device)
        index[frozen.vocab_map] = torch.arange(frozen.vocab_map.numel(), device=tokens.device)
        goal = index[tokens[:, 1:].clamp(max=index.numel() - 1)]  # -1: not in the draft vocabulary
        rows = valid[:, :-1]
        head_in = net(frozen.embed(tokens[:, :-1]))
        logits = frozen.logits(head_in[rows]).float()
        goal = goal[rows]
        inside = goal >= 0
        n = max(int(rows.sum()), 1)
        loss = F.cross_entropy(logits[inside], goal[inside], reduction="sum") / n
        stats = {"acc1": float((logits.argmax(-1) == goal).float().sum() / n), "loss1": float(loss.detach())}
        if evaluate:
            rank = (logits > logits.gather(-1, goal.clamp(min=0)[:, None])).sum(-1).masked_fill(~inside, 1 << 20)
            stats.update({f"rank1_{r}": float((rank == r).float().sum() / n) for r in range(8)})
        return loss, stats
