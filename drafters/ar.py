"""Plain autoregressive decoding: the empty draft tree, one target token per forward."""

from specviz.tree import DraftTree

from .base import Drafter, DraftRequest, Settings


class AutoregressiveDrafter(Drafter):
    name = "ar"
    title = "Autoregressive (no drafter)"

    def __init__(self, target=None, settings: Settings | None = None):
        self.settings = settings or Settings()

    def propose(self, request: DraftRequest) -> DraftTree:
        return DraftTree.empty()
