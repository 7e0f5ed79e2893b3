"""A small causal LM drafting a chain token by token with its own KV cache (used by skip and sps)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specviz.core.protocol import Drafter, DraftRequest
from specviz.core.target import cache_kwarg
from specviz.core.tree import DraftTree
from specviz.core.verify import probabilities


@dataclass
class ChainState:
    """One decode's draft-model cache and the tokens whose keys and values it holds."""

    cache: DynamicCache
    cached: list[int] = field(default_factory=list)


class ChainLMDrafter(Drafter):
    """Drafts ``num_tokens`` tokens autoregressively; sampled drafts carry their distributions."""

    def __init__(self, model, num_tokens: int, target_vocab: int):
        self.model = model.eval()
        self.num_tokens = num_tokens
        self.target_vocab = target_vocab

    def start(self) -> ChainState:
        return ChainState(DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def _feed(self, state: ChainState, ids: list[int]) -> torch.Tensor:
        start = len(state.cached)
        device = next(self.model.parameters()).device
        out = self.model(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.arange(start, start + len(ids), device=device)[None],
            **cache_kwarg(self.model, state.cache),
            use_cache=True,
            logits_to_keep=1,
        )
        state.cached += ids
        return out.logits[0, -1, : self.target_vocab].float().cpu()

    def _sync(self, state: ChainState, tokens: list[int]) -> torch.Tensor:
        """Drop cached tokens that left the sequence, feed the new ones; logits after the last."""
        keep = 0
        for a, b in zip(state.cached, tokens[:-1]):  # the root is always re-fed for its logits
            if a != b:
                break
            keep += 1
        if keep < len(state.cached):
            state.cache.crop(keep - len(state.cached))
            state.cached = state.cached[:keep]
        return self._feed(state, tokens[keep:])

    def propose(self, state: ChainState, request: DraftRequest) -> DraftTree:
        depth = min(self.num_tokens, request.max_depth)
        logits = self._sync(state, request.tokens)
        drafted, logps, dists = [], [], []
        for i in range(depth):
            q = probabilities(logits, request.sampling)
            tok = (int(q.argmax()) if request.sampling.greedy
                   else int(torch.multinomial(q, 1, generator=request.generator)))
            drafted.append(tok)
            logps.append(torch.log_softmax(logits, -1)[tok])
            dists.append(q)
            if i + 1 < depth:
                logits = self._feed(state, [tok])
        if request.sampling.greedy or not drafted:
            return DraftTree.chain(drafted, torch.tensor(logps))
        dists.append(torch.zeros_like(dists[0]))  # the last node has no children
        return DraftTree.chain(drafted, torch.stack(logps), torch.stack(dists))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())
