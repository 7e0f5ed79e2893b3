"""Plain autoregressive decoding: the empty draft tree, one target token per forward."""

from specviz.core.protocol import Drafter, DraftRequest, Settings
from specviz.core.tree import DraftTree


class AutoregressiveDrafter(Drafter):
    name = "ar"
    title = "Autoregressive (no drafter)"

    def __init__(self, target=None, settings: Settings | None = None):
        self.settings = settings or Settings()

    def propose(self, state, request: DraftRequest) -> DraftTree:
        return DraftTree.empty()
