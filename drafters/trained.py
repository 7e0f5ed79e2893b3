"""The base of every trained drafter: the training protocol, checkpoint loading, feature handling.

A trained method is a ``TrainedDrafter`` subclass that declares its network and its loss (the two
class methods the one training loop, ``drafters/training/loop.py``, calls) and its decoding. Loading a
checkpoint, restoring the network beside the target's frozen head, counting parameters and moving
the target's features to the drafter are done here, once.
"""

from __future__ import annotations

import torch
from torch import nn

from specviz.core.packing import pack_linears
from specviz.core.protocol import Commit, Drafter

from .checkpoint import CheckpointError
from .published import load_any
from .vocab_head import FrozenTarget


class TrainedDrafter(Drafter):
    trained = True
    reads_features = True  # the target's final-norm output at each position (stored beside the training tokens)
    # a training variant's own network arguments (``drafters.variants``); its card carries them as ``network``,
    # so the base method decodes the variant's checkpoint
    network_kwargs: dict = {}
    variant_name: str | None = None

    def __init__(self, target, settings):
        self.settings = settings
        state, self.card = load_any(settings.checkpoint, self.name, target)  # specviz's own or a published one
        self.net, self.frozen = self.restore(target, state, self.card.get("network"))
        if getattr(target, "packed_linears", 0):  # decoding only: a network that trains must not be packed
            pack_linears(self.net, target.plain_rows)  # the target's measured rule (``core.kernels``)
            self.frozen.pack(target.plain_rows)
        self.device, self.dtype = target.device, target.dtype
        self.hidden_size = target.config.hidden_size
        self.check_settings(settings)

    # -- the training protocol ----------------------------------------------------------------
    @classmethod
    def new_network(cls, target, **shape) -> nn.Module:
        """A freshly initialised network for ``target``; ``shape`` is a published checkpoint's own (its card's
        ``network``: widths, heads, variants), where it differs from what specviz trains."""
        raise NotImplementedError

    @classmethod
    def training_loss(cls, net: nn.Module, frozen: FrozenTarget, tokens: torch.Tensor, feats: torch.Tensor,
                      valid: torch.Tensor, evaluate: bool = False,
                      done: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss, statistics) over a batch: tokens [B, T], the target's features [B, T, H], and ``valid``
        [B, T], the positions whose predictions count. ``evaluate`` adds the per-depth accuracies the
        card reports, measured alike for every method of a family; ``done`` is the fraction of the
        training made (an objective may change on the way: HASS's Top-K term)."""
        raise NotImplementedError

    @classmethod
    def drafter_network(cls, net: nn.Module) -> nn.Module:
        """The part of a trained ``net`` the checkpoint holds and decoding runs (all of it, but for joint
        training's, which trains the target's LoRA beside it: ``training.joint``)."""
        return net

    @classmethod
    def save_extras(cls, net: nn.Module, folder, target) -> dict | None:
        """Write what a checkpoint holds besides the drafter's weights; returns the card's note of it."""
        return None

    @classmethod
    def tapped_layers(cls, num_layers: int) -> tuple[int, ...]:
        """Decoder layers whose inputs the method reads besides the final-norm output (EAGLE-3); in training
        they are appended to the stored features, at decoding time the target returns them (``TargetModel.tap``)."""
        return ()

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def restore(cls, target, state: dict[str, torch.Tensor],
                network: dict | None = None) -> tuple[nn.Module, FrozenTarget]:
        """``new_network(target, **network)`` loaded from ``state``, plus the frozen head of its draft vocabulary
        (or the checkpoint's own head, ``lm_head``, over that vocabulary)."""
        state = dict(state)
        vocab_map, head = state.pop("vocab_map", None), state.pop("lm_head", None)
        if vocab_map is None:
            raise CheckpointError(f"{cls.name} checkpoint has no vocab_map tensor")
        if int(vocab_map.max()) >= target.vocab_size:
            raise CheckpointError(f"{cls.name} checkpoint's draft vocabulary reaches id {int(vocab_map.max())}, "
                                  f"beyond this target's vocab of {target.vocab_size}")
        if head is not None and head.shape != (vocab_map.numel(), target.config.hidden_size):
            raise CheckpointError(f"{cls.name} checkpoint's draft head has shape {tuple(head.shape)}, not "
                                  f"({vocab_map.numel()}, {target.config.hidden_size})")
        net = cls.new_network(target, **(network or {}))
        own = set(net.state_dict())
        missing, unexpected = sorted(own - set(state)), sorted(set(state) - own)
        if missing or unexpected:  # checked first: names the weights of another method plainly
            raise CheckpointError(f"{cls.name} checkpoint does not fit this target: "
                                  f"missing {missing[:4]} unexpected {unexpected[:4]}")
        try:
            net.load_state_dict(state)
        except RuntimeError as e:  # a tensor of another shape
            detail = " ".join(str(e).split())[:300]
            raise CheckpointError(f"{cls.name} checkpoint does not fit this target: {detail}") from None
        net = net.to(device=target.device, dtype=target.dtype).eval()
        return net, FrozenTarget(target, vocab_map, head)

    def check_settings(self, settings) -> None:
        """Reject settings this checkpoint cannot serve (a method overrides it where some cannot)."""

    def num_parameters(self) -> int:
        """Trained weights plus the copied LM-head rows of the draft vocabulary."""
        return sum(p.numel() for p in self.net.parameters()) + self.frozen.head.numel()

    def features(self, commit: Commit) -> torch.Tensor:
        """The committed positions' features (the final-norm output), on the drafter's device and in its dtype."""
        return commit.features[:, :self.hidden_size].to(device=self.device, dtype=self.dtype)
