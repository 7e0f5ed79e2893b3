"""DraftTree: the drafted tokens a target checks in one forward pass.

Node 0 of the verify input is the *root*: the last token the target emitted, not yet in its
cache. Draft nodes are numbered 1..N in that input; ``parents[i]`` is the input index of node
i+1's parent (0 = root) and always precedes it, so parents come before children.

A tree grown on a GPU may stay there (``on_device``) through the verify: its input ids, positions and mask are
built from it on the device, and the host reads it once, with the target's answer (``on_host``), so a step waits
for the device once. Its rules are checked when it is read; until then its depth is the bound the drafter gives
(``info["max_depth"]``, else its size) and it is verified as a tree (a chain's causal mask needs its shape read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .errors import SettingsError
from .transfer import to_host

_NO_TOKENS = torch.zeros(0, dtype=torch.long)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bool [q, k] (True = may attend) -> additive float mask [1, 1, q, k]: 0 or the dtype's minimum, on
    ``allowed``'s device."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


class TreeError(SettingsError):
    """A draft tree that breaks the parent-before-child rules."""


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long, the draft tokens
    parents: torch.Tensor  # [N] long, input index of each node's parent (0 = root)
    logprobs: torch.Tensor | None = None  # [N] draft log-prob of each token (display, ranking)
    # Distribution each node's children were drawn from, row 0 = root's children; None means the
    # children are deterministic (top-k, lookup). Used by lossless rejection sampling.
    child_dists: torch.Tensor | None = None  # [N+1, V]
    info: dict = field(default_factory=dict)  # drafter-specific extras (beams, dedup ratio, ...)

    def __post_init__(self) -> None:
        self.tokens = self.tokens.reshape(-1).long()
        self.parents = self.parents.reshape(-1).long()
        self._depths: torch.Tensor | None = None  # a device tree's, made on the device when asked
        self._ancestors: torch.Tensor | None = None  # made once: the mask and (on a device) the depths read it
        if self.on_device:  # checked when the host reads it (``on_host``): reading it here would wait for the device
            return
        n = self.tokens.numel()
        if self.parents.numel() != n:
            raise TreeError(f"{n} tokens but {self.parents.numel()} parents")
        if n and (bool((self.parents < 0).any()) or bool((self.parents > torch.arange(n)).any())):
            raise TreeError("every parent must be the root (0) or an earlier node")
        if self.logprobs is not None and self.logprobs.numel() != n:
            raise TreeError("logprobs must have one entry per node")
        if self.child_dists is not None and self.child_dists.shape[0] != n + 1:
            raise TreeError("child_dists needs one row for the root and one per node")
        depth = [0]
        for p in self.parents.tolist():
            depth.append(depth[p] + 1)
        self._depths = torch.tensor(depth[1:], dtype=torch.long)

    @classmethod
    def empty(cls) -> "DraftTree":
        """No draft: the target verifies the root alone (plain AR step)."""
        return cls(_NO_TOKENS, _NO_TOKENS)

    @classmethod
    def chain(cls, tokens, logprobs=None, child_dists=None, **info) -> "DraftTree":
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        return cls(tokens, torch.arange(tokens.numel()), logprobs, child_dists, info)

    @classmethod
    def from_beams(cls, beams: torch.Tensor, logprobs: torch.Tensor | None = None) -> "DraftTree":
        """Merge equal-length beams [W, L] into a tree, sharing common prefixes (tensor ops, no trie).

        Beam j owns the node for (beam i, depth d) when j is the first beam whose prefix up to d
        equals beam i's. Nodes are ordered by depth, then owner, so parents precede children.
        """
        width, length = beams.shape
        same = beams[:, None, :] == beams[None, :, :]  # [W, W, L]
        prefix_same = same.long().cumprod(-1).bool()  # beams i, j agree on tokens 0..d
        owner = prefix_same.long().argmax(dim=1)  # [W, L] first beam sharing beam i's prefix
        is_node = owner == torch.arange(width)[:, None]
        depth_of, beam_of = torch.nonzero(is_node.T, as_tuple=True)  # sorted by depth, then beam
        index = torch.full((width, length), -1, dtype=torch.long)
        index[beam_of, depth_of] = torch.arange(beam_of.numel()) + 1  # input index (root = 0)
        node_of = index.gather(0, owner)  # [W, L] input index of each (beam, depth)
        parent_of = torch.cat([torch.zeros(width, 1, dtype=torch.long), node_of[:, :-1]], dim=1)
        tree = cls(
            beams[beam_of, depth_of],
            parent_of[beam_of, depth_of],
            None if logprobs is None else logprobs[beam_of, depth_of],
        )
        tree.info.update(beams=beams.clone(), beam_nodes=node_of, compression=width * length / max(len(tree), 1))
        return tree

    @classmethod
    def from_beams_apart(cls, beams: torch.Tensor, logprobs: torch.Tensor | None = None) -> "DraftTree":
        """Beams [W, L] as W separate branches of the root, nothing shared: what a verify without tree attention
        checks (each beam on its own, as ReDrafter's ablation flattens them). Beam w's depth-d token is node
        w * L + d + 1."""
        width, length = beams.shape
        index = torch.arange(width * length, device=beams.device).reshape(width, length) + 1
        parents = torch.cat([index.new_zeros(width, 1), index[:, :-1]], dim=1)
        tree = cls(beams.reshape(-1), parents.reshape(-1), None if logprobs is None else logprobs.reshape(-1))
        tree.info.update(beams=beams.clone(), beam_nodes=index, compression=1.0)
        return tree

    def padded(self, extra: int) -> "DraftTree":
        """This tree plus ``extra`` filler nodes after every real one, so none of them is an ancestor of a
        real node: a chain continues as a chain, a tree gets children of the root."""
        filler = self.tokens.new_zeros(extra)
        n = len(self)
        parents = torch.arange(n, n + extra, device=filler.device) if self.is_chain else filler
        return DraftTree(torch.cat([self.tokens, filler]), torch.cat([self.parents, parents]),
                         info={"max_depth": self.max_depth} if self.on_device else {})

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def on_device(self) -> bool:
        """Whether the tree's tensors sit on a device (a GPU), unread by the host."""
        return self.tokens.device.type != "cpu"

    @property
    def depths(self) -> torch.Tensor:
        """[N] depth of each node (root children have depth 1), on the tree's device."""
        if self._depths is None:
            self._depths = self.ancestors()[1:].sum(-1) - 1
        return self._depths

    @property
    def is_chain(self) -> bool:
        """Whether each node's parent is the node before it (False for a tree on the device: unread)."""
        return not self.on_device and bool((self.parents == torch.arange(len(self))).all())

    @property
    def max_depth(self) -> int:
        """The deepest node's depth; on the device, the drafter's bound (its size where it gave none)."""
        if self.on_device:
            return min(int(self.info.get("max_depth", len(self))), len(self))
        return int(self._depths.max()) if len(self) else 0

    def input_ids(self, root: int) -> torch.Tensor:
        return torch.cat([torch.full((1,), root, dtype=torch.long, device=self.tokens.device), self.tokens])

    def ancestors(self) -> torch.Tensor:
        """[N+1, N+1] bool, on the tree's device: row i marks i itself and all its ancestors (root included).
        Built from parent links by squaring: after k squarings a row reaches 2^k steps up, so about log2(N)
        products and no read of the parents. Made once a tree; not to be written to."""
        if self._ancestors is not None:
            return self._ancestors
        n, device = len(self) + 1, self.parents.device
        anc = torch.eye(n, dtype=torch.bool, device=device)
        anc[torch.arange(1, n, device=device), self.parents] = True
        reach = 1
        while reach < n - 1:
            square = anc.float()
            anc = (square @ square) > 0
            reach *= 2
        self._ancestors = anc
        return anc

    def positions(self, past: int) -> torch.Tensor:
        """[1, N+1] position ids: the root sits at ``past``, a depth-d node at ``past + d``."""
        return (past + torch.cat([self.parents.new_zeros(1), self.depths]))[None]

    def attention_mask(self, past: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[1, 1, N+1, past+N+1] additive mask: every node sees the cache and its own ancestors."""
        seen = torch.ones(len(self) + 1, past, dtype=torch.bool, device=self.parents.device)
        return additive_mask(torch.cat([seen, self.ancestors()], dim=1), dtype)

    def children(self) -> list[list[int]]:
        """Input indices of each input node's children, in node order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents.tolist(), start=1):
            kids[p].append(i)
        return kids

    def paths(self) -> list[list[int]]:
        """Root-to-leaf paths as input indices (root excluded)."""
        kids, paths = self.children(), []
        for leaf in range(1, len(self) + 1):
            if not kids[leaf]:
                path, node = [], leaf
                while node:
                    path.append(node)
                    node = int(self.parents[node - 1])
                paths.append(path[::-1])
        return paths


def on_host(trees: Sequence[DraftTree], extra: Sequence[torch.Tensor] = ()) -> tuple[list[DraftTree], list]:
    """The trees, with their rules checked, and ``extra`` on the host: every device tensor among them (a device
    tree's tokens, parents, log-probabilities, child distributions and tensors in ``info``) read in one copy."""
    device = [t for t in trees if t.on_device]
    tensors = [x for t in device for x in (*_fields(t), *t.info.values()) if isinstance(x, torch.Tensor)]
    read = iter(to_host(tensors + list(extra)))

    def hosted(t: DraftTree) -> DraftTree:  # takes its tensors from ``read`` in the order they went in
        fields = [next(read) if x is not None else None for x in _fields(t)]
        return DraftTree(*fields, info={k: next(read) if isinstance(v, torch.Tensor) else v for k, v in t.info.items()})

    return [hosted(t) if t.on_device else t for t in trees], list(read)


def _fields(tree: DraftTree) -> tuple:
    return tree.tokens, tree.parents, tree.logprobs, tree.child_dists
