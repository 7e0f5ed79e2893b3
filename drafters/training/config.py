"""The training settings every method shares, and the key that names one method's run of them."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from specviz.core.errors import SettingsError
from specviz.core.files import content_key
from specviz.core.load import fast_dtype

from ..trained import TrainedDrafter


@dataclass
class TrainConfig:
    epochs: int = 2
    lr: float = 5e-4
    batch_tokens: int = 4096  # tokens per optimizer step (padded)
    max_length: int = 640  # longer sequences are cut
    warmup: float = 0.05  # fraction of steps with linear warm-up, then cosine decay
    clip: float = 0.5
    draft_vocab: int = 8192  # 0 = the target's full vocabulary
    seed: int = 0
    device: str = "cpu"
    precision: str = "no"  # "bf16" autocast, "no" (fp32), or "auto": bf16 where the hardware is fast at it
    save_every: int = 100  # steps between saved training states (for resume)
    validate_every: int = 0  # steps between validations during an epoch (0: at the end of each epoch only)

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.lr <= 0 or self.batch_tokens < 16 or self.max_length < 4 or self.save_every < 1 \
                or self.validate_every < 0:
            raise SettingsError(f"invalid training settings: {self}")
        if self.precision not in ("no", "bf16", "auto"):
            raise SettingsError(f"precision must be no, bf16 or auto, got {self.precision!r}")

    @property
    def mixed_precision(self) -> str:
        if self.precision == "auto":
            return "bf16" if fast_dtype(self.device) == torch.bfloat16 else "no"
        return self.precision


OUTSIDE_RUN_KEY = ("save_every", "validate_every")  # settings that leave the trained weights unchanged


def run_key(method: type[TrainedDrafter], features_key: str, cfg: TrainConfig) -> str:
    """Names one method's training run: its data (``DataRecipe.features_key``), the settings that change the
    trained weights, and the method's objective (a changed objective is another run). Runs saved under the
    earlier hand-written key keep their names: this hashes the same JSON."""
    config = {k: v for k, v in asdict(cfg).items() if k not in OUTSIDE_RUN_KEY}
    network = [method.network_kwargs] if method.network_kwargs else []  # a variant's network is another run
    joint = [asdict(method.joint)] if getattr(method, "joint", None) else []  # so is joint training
    return content_key([method.name, features_key, config, getattr(method, "loss", None), *network, *joint])
