"""Prompt lookup decoding: match the last n-gram earlier in prompt + output, propose what followed."""

from dataclasses import dataclass

import torch

from specviz.core.errors import SettingsError
from specviz.core.protocol import BudgetGrid, Drafter, DraftRequest, Settings
from specviz.core.tree import DraftTree


@dataclass
class PromptLookupSettings(Settings):
    num_tokens: int = 5  # longest continuation proposed (tuned on CPU: see README)
    max_ngram: int = 3
    min_ngram: int = 2  # 1-gram matches are mostly wrong on chat text and cost a wider verify
    ranges = {"num_tokens": (1, 64), "max_ngram": (1, 8), "min_ngram": (1, 8)}

    @classmethod
    def budget_grids(cls, target) -> list[BudgetGrid]:
        return [BudgetGrid("num_tokens", depths=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16))]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_ngram > self.max_ngram:
            raise SettingsError(f"min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})")


def lookup(tokens: torch.Tensor, settings: PromptLookupSettings, limit: int) -> tuple[torch.Tensor, int, int]:
    """Continuation of the most recent earlier match of the longest suffix n-gram (n from max to min),
    with where that match starts and its length (0 when nothing matched)."""
    length = tokens.numel()
    for n in range(min(settings.max_ngram, length - 1), settings.min_ngram - 1, -1):
        windows = tokens[: length - 1].unfold(0, n, 1)  # windows that have at least one token after them
        hits = torch.nonzero((windows == tokens[-n:]).all(dim=1)).flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start : start + min(settings.num_tokens, limit)], int(hits[-1]), n
    return tokens[:0], 0, 0


class PromptLookupDrafter(Drafter):
    name = "pld"
    title = "Prompt lookup (n-gram copy from prompt + output)"

    def __init__(self, target=None, settings: PromptLookupSettings | None = None):
        self.settings = settings or PromptLookupSettings()

    def propose(self, state, request: DraftRequest) -> DraftTree:
        found, at, n = lookup(torch.tensor(request.tokens), self.settings, request.max_depth)
        return DraftTree.chain(found, ngram=request.tokens[at: at + n], ngram_at=at) if n else DraftTree.chain(found)
