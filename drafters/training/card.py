"""The JSON card a trained checkpoint carries: target, data, budget, machine, objective, agreement, size."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, is_dataclass

import torch
from torch import nn

from specviz.core.metrics import extra_memory_pct

from ..checkpoint import target_signature
from ..trained import TrainedDrafter
from ..vocab_head import FrozenTarget
from .config import TrainConfig
from .state import Progress


@dataclass(frozen=True)
class RunFacts:
    """What the card records of the run itself, beside its settings and progress."""

    wall_s: float
    processes: int
    device: torch.device
    tapped_layers: tuple[int, ...]
    train_token_coverage: float  # share of the training tokens inside the draft vocabulary


def machine(device: torch.device) -> str:
    if device.type == "cpu":
        return f"{platform.machine()} {torch.get_num_threads()} threads"
    return torch.cuda.get_device_name(device)


def training_card(method: type[TrainedDrafter], target, cfg: TrainConfig, data_meta: dict, progress: Progress,
                  net: nn.Module, frozen: FrozenTarget, facts: RunFacts) -> dict:
    """The card of ``net``, trained for ``target`` as ``progress`` says; ``mtbench`` is filled in by a benchmark."""
    trained = sum(p.numel() for p in net.parameters())
    extra = trained + frozen.head.numel()
    objective = getattr(method, "loss", None)
    variant = {"variant": method.variant_name} if method.variant_name else {}
    network = {"network": dict(method.network_kwargs)} if method.network_kwargs else {}
    return {
        "method": method.name,
        **variant,
        "title": method.title,
        **network,
        "target": target_signature(target),
        "data": data_meta,
        "training": {**asdict(cfg), "steps": progress.step, "answer_tokens_seen": progress.tokens,
                     "wall_s": round(facts.wall_s, 1), "processes": facts.processes,
                     "mixed_precision": cfg.mixed_precision, "machine": machine(facts.device),
                     **({"started_from": progress.started_from} if progress.started_from else {})},
        "objective": asdict(objective) if is_dataclass(objective) else None,
        "features": {"final_norm_output": method.reads_features, "tapped_layer_inputs": list(facts.tapped_layers)},
        "draft_vocab": {"size": int(frozen.vocab_map.numel()),
                        "train_token_coverage": round(facts.train_token_coverage, 4)},
        "history": progress.history,
        "validation_checks": progress.checks or [],
        "parameters": {"trained": trained, "lm_head_rows_copied": frozen.head.numel(), "extra_total": extra,
                       "extra_memory_pct": round(extra_memory_pct(extra, target.num_parameters), 2)},
        "lm_head": "the target's frozen, tied LM head restricted to the draft vocabulary (not trained, not stored)",
        "mtbench": None,
    }
