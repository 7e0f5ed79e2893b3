"""A small causal LM drafting a chain token by token with its own KV cache (used by skip and sps)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specviz.core.protocol import Commit, Drafter, DraftRequest
from specviz.core.target import cache_kwarg
from specviz.core.transfer import to_device
from specviz.core.tree import DraftTree
from specviz.core.verify import probabilities, top_ids


@dataclass
class ChainState:
    """One decode's draft-model cache and the tokens whose keys and values it holds."""

    cache: DynamicCache
    cached: list[int] = field(default_factory=list)
    # the last greedy draft's fed tokens, after ``cached`` in the cache: on the device until read, or the host's
    # list once ``observe`` found them in the tree the engine read
    fed: torch.Tensor | list[int] | None = None


class ChainLMDrafter(Drafter):
    """Drafts ``num_tokens`` tokens autoregressively; sampled drafts carry their distributions."""

    def __init__(self, model, num_tokens: int, target_vocab: int):
        self.model = model.eval()
        self.num_tokens = num_tokens
        self.target_vocab = target_vocab

    def start(self) -> ChainState:
        return ChainState(DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def _forward(self, start: int, ids: torch.Tensor, cache) -> torch.Tensor:
        """fp32 logits [V] after ``ids`` [1, n] (on the model's device) at positions ``start...``, on the device."""
        out = self.model(
            input_ids=ids,
            position_ids=torch.arange(start, start + ids.shape[1], device=ids.device)[None],
            **cache_kwarg(self.model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1, : self.target_vocab].float()

    def _feed(self, state: ChainState, ids: list[int]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        logits = self._forward(len(state.cached), to_device(torch.tensor([ids]), device), state.cache)
        state.cached += ids
        return logits

    def _sync(self, state: ChainState, tokens: list[int]) -> torch.Tensor:
        """Drop cached tokens that left the sequence, feed the new ones; logits after the last."""
        if state.fed is not None:  # read here only where no engine step read them (``observe``)
            state.cached += state.fed if isinstance(state.fed, list) else state.fed.tolist()
            state.fed = None
        keep = 0
        for a, b in zip(state.cached, tokens[:-1]):  # the root is always re-fed for its logits
            if a != b:
                break
            keep += 1
        if keep < len(state.cached):
            state.cache.crop(keep - len(state.cached))
            state.cached = state.cached[:keep]
        return self._feed(state, tokens[keep:])

    def observe(self, state: ChainState, commit: Commit) -> None:
        """The fed drafts, from the step's tree as the engine read it: no read of their own."""
        if isinstance(state.fed, torch.Tensor) and commit.drafted is not None:
            state.fed = commit.drafted.tokens[: state.fed.numel()].tolist()

    def propose(self, state: ChainState, request: DraftRequest) -> DraftTree:
        depth = min(self.num_tokens, request.max_depth)
        logits = self._sync(state, request.tokens)
        if request.sampling.greedy:
            return self._greedy_chain(state, logits, depth)
        drafted, logps, dists = [], [], []
        for i in range(depth):  # sampled with the request's CPU generator: on the host
            logits = logits.cpu()
            q = probabilities(logits, request.sampling)
            tok = int(torch.multinomial(q, 1, generator=request.generator))
            drafted.append(tok)
            logps.append(torch.log_softmax(logits, -1)[tok])
            dists.append(q)
            if i + 1 < depth:
                logits = self._feed(state, [tok])
        if not drafted:
            return DraftTree.chain(drafted, torch.tensor(logps))
        dists.append(torch.zeros_like(dists[0]))  # the last node has no children
        return DraftTree.chain(drafted, torch.stack(logps), torch.stack(dists))

    @torch.inference_mode()
    def _greedy_chain(self, state: ChainState, logits: torch.Tensor, depth: int) -> DraftTree:
        """Each token the argmax of the last, fed back on the device; the host reads the chain once, at the end
        (on a GPU no token waits for the host)."""
        tokens, logps = [], []
        for i in range(depth):
            tok = top_ids(logits.reshape(-1)).view(1, 1)
            tokens.append(tok)
            logps.append(torch.log_softmax(logits, -1)[tok[0, 0]])
            if i + 1 < depth:
                logits = self._forward(len(state.cached) + i, tok, state.cache)
        if not tokens:
            return DraftTree.chain([], torch.zeros(0))
        drafted = torch.cat(tokens).view(-1)  # stays where it was drafted: the host reads it with the verify's answer
        state.fed = drafted[:-1]  # the fed ones: all but the last
        return DraftTree(drafted, torch.arange(depth, device=drafted.device), torch.stack(logps).view(-1),
                         info={"max_depth": depth})

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())
