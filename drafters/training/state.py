"""Training states: what a killed run needs to go on to the weights an unbroken run reaches.

A state is a folder of safetensors and JSON, formats that hold data and run nothing when read: the
network's weights, the optimizer's moments and settings, the learning-rate schedule, each process's random
generators, and ``progress.json``, written last, so a folder holding it is complete. Each state is written
beside the last one and swapped in: a kill mid-save leaves the last state whole.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file
from torch import nn

NETWORK, OPTIMIZER, SCHEDULE, PROGRESS = "network.safetensors", "optimizer", "schedule.json", "progress.json"


@dataclass
class Progress:
    """Where the run stands, beside the weights and the optimizer."""

    step: int = 0
    wall_s: float = 0.0
    tokens: int = 0  # answer tokens whose predictions were trained on
    running: dict | None = None
    history: list | None = None  # per epoch: training and validation agreement
    checks: list | None = None  # validations during the epochs: {"step", "val"}
    total: int = 0  # the run's steps in all (0: saved before this was recorded)
    started_from: dict | None = None  # the shared prefix the run started from (``prefix``): its key and step

    def save(self, folder: Path) -> None:
        (folder / PROGRESS).write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, folder: Path) -> "Progress":
        return cls(**json.loads((folder / PROGRESS).read_text()))


@dataclass
class Trainee:
    """What a state holds besides its progress: the network (unwrapped from any distributed wrapper), its
    optimizer and its learning-rate schedule."""

    net: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler


def saved_state(work: Path | None) -> Path | None:
    """The last complete training state in ``work``; ``state.old`` if a save was killed mid-swap."""
    for name in ("state", "state.old"):
        if work is not None and (Path(work) / name / PROGRESS).exists():
            return Path(work) / name
    return None


def apart(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor copied into storage of its own, on the CPU: cuDNN keeps an LSTM's weights as views of one
    flat buffer, and safetensors refuses tensors that share memory."""
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}


def optimizer_parts(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A torch optimizer's ``state_dict`` as tensors ("<param>.<name>") and JSON (its groups and any number)."""
    tensors, numbers = {}, {}
    for index, values in state["state"].items():
        for name, value in values.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{name}"] = value
            else:
                numbers.setdefault(str(index), {})[name] = value
    return apart(tensors), {"param_groups": state["param_groups"], "numbers": numbers}


def optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """``optimizer_parts`` read back into a ``state_dict`` the optimizer loads."""
    state: dict[int, dict] = {int(i): dict(values) for i, values in meta["numbers"].items()}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def random_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def write(folder: Path, trainee: Trainee, accelerator: Accelerator) -> None:
    """Every file of a state but its progress: the shared parts from the main process, each process's random
    generators from itself (``folder`` exists)."""
    if accelerator.is_main_process:
        save_file(apart(trainee.net.state_dict()), str(folder / NETWORK))
        tensors, meta = optimizer_parts(trainee.optimizer.state_dict())
        save_file(tensors, str(folder / f"{OPTIMIZER}.safetensors"))
        (folder / f"{OPTIMIZER}.json").write_text(json.dumps(meta))
        (folder / SCHEDULE).write_text(json.dumps(trainee.schedule.state_dict()))
    save_file(apart(random_state(accelerator.device)), str(folder / f"random-{accelerator.process_index}.safetensors"))


def save_state(state: Path, trainee: Trainee, progress: Progress, accelerator: Accelerator) -> None:
    """Write a state beside ``state`` and swap it in: a kill mid-save leaves the last state whole."""
    partial, old = state.with_name(state.name + ".partial"), state.with_name(state.name + ".old")
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    write(partial, trainee, accelerator)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        progress.save(partial)  # last: a folder holding it is complete
        shutil.rmtree(old, ignore_errors=True)
        if state.exists():
            state.rename(old)
        partial.rename(state)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_state(folder: Path, trainee: Trainee, accelerator: Accelerator) -> Progress:
    """Restore ``trainee`` (prepared, on its device) and this process's random generators from ``folder``."""
    trainee.net.load_state_dict(load_file(str(folder / NETWORK)))
    meta = json.loads((folder / f"{OPTIMIZER}.json").read_text())
    trainee.optimizer.load_state_dict(optimizer_state(load_file(str(folder / f"{OPTIMIZER}.safetensors")), meta))
    trainee.schedule.load_state_dict(json.loads((folder / SCHEDULE).read_text()))
    generators = folder / f"random-{accelerator.process_index}.safetensors"
    if generators.exists():  # another process count: the weights carry on, the random streams start afresh
        saved = load_file(str(generators))
        torch.set_rng_state(saved["cpu"])
        if "cuda" in saved and accelerator.device.type == "cuda":
            torch.cuda.set_rng_state(saved["cuda"], accelerator.device)
    return Progress.load(folder)
