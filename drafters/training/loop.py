"""The one training loop for every trained drafter, on ``accelerate``.

Frozen target features -> the method's own loss -> a bf16 safetensors checkpoint with a JSON card. Methods
plug in through the training protocol of ``TrainedDrafter``: ``new_network(target)`` and
``training_loss(net, frozen, tokens, feats, valid, evaluate, done)``. The same code runs on a CPU, one GPU,
or several through ``accelerate launch``; its state is saved in a work folder every ``save_every`` steps and
after every epoch, and when a signal asks it to stop (``stop``), so ``resume`` continues to the weights an
unbroken run reaches.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from specviz.core.errors import SettingsError
from specviz.core.timing import Phases, PhaseTimer

from ..checkpoint import load_checkpoint, save_checkpoint
from ..trained import TrainedDrafter
from ..vocab_head import FrozenTarget, draft_vocabulary
from .batches import make_batch, training_batches
from .card import RunFacts, training_card
from .config import TrainConfig
from .features import FeatureSet, LayerTaps
from .lock import RunBusy, run_lock
from .prefix import branch_step
from .state import Progress, Trainee, load_state, save_state, saved_state
from .stop import StopRequest, TrainingStopped, stop_between_steps

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # tokens [B, T], features [B, T, H], valid [B, T]


def cosine_with_warmup(total_steps: int, warmup: float) -> Callable[[int], float]:
    warm = max(1, int(warmup * total_steps))
    decay = max(1, total_steps - warm)
    return lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / decay))


def same_device(a, b) -> bool:
    """``cuda`` and ``cuda:0`` are one device (accelerate says the first, a model's parameters the second)."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    """One process's accelerator: the CPU when the config says so, else the device ``accelerate launch`` gives.
    bf16 is torch's own autocast around the loss (``cfg.precision``), not accelerate's process-wide setting."""
    return Accelerator(cpu=torch.device(cfg.device).type == "cpu")


@dataclass
class Run:
    """One method's training as set up: what every step reads and changes."""

    method: type[TrainedDrafter]
    cfg: TrainConfig
    accelerator: Accelerator
    net: nn.Module  # as the accelerator prepared it (wrapped when distributed)
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    frozen: FrozenTarget
    taps: LayerTaps
    plan: list[list[list[int]]]  # each epoch's batches, drawn up front so a resumed run sees the same ones
    coverage: float  # share of the training tokens inside the draft vocabulary

    @property
    def total_steps(self) -> int:
        return sum(len(p) for p in self.plan)

    def trainee(self) -> Trainee:
        return Trainee(self.accelerator.unwrap_model(self.net), self.optimizer, self.schedule)


def set_up(method: type[TrainedDrafter], target, train_set: FeatureSet, cfg: TrainConfig, data_meta: dict,
           accelerator: Accelerator) -> Run:
    """A fresh network, its optimizer and schedule, the draft vocabulary and every epoch's batches, all from
    ``cfg.seed``: a resumed run sets up exactly as the unbroken one did, then loads its state."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    vocab_map = draft_vocabulary(train_set.tokens, cfg.draft_vocab, target.vocab_size,
                                 always=sorted(target.text.eos_token_ids))
    coverage = float(torch.isin(train_set.tokens, vocab_map).float().mean())
    frozen = FrozenTarget(target, vocab_map)
    taps = LayerTaps.of(method, target, data_meta)
    net = method.new_network(target, **method.network_kwargs).float().train()
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    plan = [training_batches(train_set, cfg.batch_tokens, cfg.max_length, gen) for _ in range(cfg.epochs)]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(sum(len(p) for p in plan), cfg.warmup))
    net, opt, sched = accelerator.prepare(net, opt, sched)
    return Run(method, cfg, accelerator, net, opt, sched, frozen, taps, plan, coverage)


def evaluate(method: type[TrainedDrafter], net, frozen, data: FeatureSet, cfg: TrainConfig,
             taps: LayerTaps | None = None) -> dict:
    """Agreement per depth (and the rest of the objective's statistics) over ``data``, weighted by positions."""
    net.eval()
    totals, weight = {}, 0
    with torch.no_grad():
        for ids in training_batches(data, cfg.batch_tokens, cfg.max_length, torch.Generator().manual_seed(0)):
            tokens, feats, valid = make_batch(data, ids, cfg.max_length, frozen.head.device)
            feats = feats if taps is None else taps(tokens, feats)
            _, stats = method.training_loss(net, frozen, tokens, feats, valid, evaluate=True)
            n = int(valid.sum())
            weight += n
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v * n
    net.train()
    return {k: round(v / max(weight, 1), 4) for k, v in totals.items()}


def validate_checkpoint(method: type[TrainedDrafter], target, folder: Path | None, val_set: FeatureSet,
                        data_meta: dict, cfg: TrainConfig) -> dict:
    """A checkpoint's agreement per depth on ``val_set``, measured as training measures it (``evaluate``)."""
    state, card = load_checkpoint(folder, method.name, target)
    net, frozen = method.restore(target, state, card.get("network"))  # a variant's network, where it is one
    return evaluate(method, net, frozen, val_set, cfg, LayerTaps.of(method, target, data_meta))


def depths(val: dict) -> str:
    return " ".join(f"{val[f'acc{d}']:.3f}" for d in range(1, 9) if f"acc{d}" in val)


def validate(run: Run, val_set: FeatureSet) -> dict:
    return evaluate(run.method, run.accelerator.unwrap_model(run.net), run.frozen, val_set, run.cfg, run.taps)


def epoch_batches(run: Run, train_set: FeatureSet, batches: list[list[int]], skip: int) -> Iterable[Batch]:
    """The epoch's batches after the first ``skip`` (made before a resume), on the accelerator's device."""
    if skip >= len(batches):
        return []
    loader = run.accelerator.prepare_data_loader(DataLoader(
        range(len(train_set)), batch_sampler=batches,
        collate_fn=lambda ids: make_batch(train_set, ids, run.cfg.max_length)))
    return run.accelerator.skip_first_batches(loader, skip) if skip else loader


@dataclass
class StepTimings(Phases):
    """Seconds per phase of training steps: the layers a method taps besides the stored features (EAGLE-3), the
    objective's forward, its backward, and the clipped optimizer step with the schedule."""

    taps: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0


def train_step(run: Run, batch: Batch, progress: Progress, timer: PhaseTimer | None = None) -> None:
    """One optimizer step; ``progress`` counts it and keeps a running mean of the objective's statistics.
    ``timer`` (phases of ``StepTimings``) charges each phase's time; it changes nothing the step computes."""
    phase = timer or (lambda _: contextlib.nullcontext())
    tokens, feats, valid = batch
    with phase("taps"):
        feats = run.taps(tokens, feats)
    with phase("forward"), torch.autocast(run.accelerator.device.type, torch.bfloat16,
                                          enabled=run.cfg.mixed_precision == "bf16"):
        loss, stats = run.method.training_loss(run.net, run.frozen, tokens, feats, valid,
                                               done=progress.step / run.total_steps)
    with phase("backward"):
        run.optimizer.zero_grad(set_to_none=True)
        run.accelerator.backward(loss)
    with phase("optimizer"):
        run.accelerator.clip_grad_norm_(run.net.parameters(), run.cfg.clip)
        run.optimizer.step()
        run.schedule.step()
    progress.step, progress.tokens = progress.step + 1, progress.tokens + int(valid.sum())
    for k, v in stats.items():
        progress.running[k] = 0.9 * progress.running.get(k, v) + 0.1 * v


def shareable(progress: Progress) -> Progress:
    """``progress`` as the arms that share its prefix may take it: validation measures each arm's whole objective,
    late term included, so the losses validated before the branch are this arm's own and are left out; the
    agreement, the same for every arm, stays."""
    def early(val: dict) -> dict:
        return {k: v for k, v in val.items() if not k.startswith("loss")}

    return replace(progress, history=[{**h, "val": early(h["val"])} for h in progress.history or []],
                   checks=[{**c, "val": early(c["val"])} for c in progress.checks or []] or None)


def train(method: type[TrainedDrafter], target, train_set: FeatureSet, val_set: FeatureSet, cfg: TrainConfig,
          data_meta: dict, out: Path | None = None, work: Path | None = None, resume: bool = False,
          accelerator: Accelerator | None = None, after_step: Callable[[int], None] | None = None,
          prefix: Path | None = None) -> dict:
    """Train ``method`` on ``train_set``; save to ``out`` and return its card.

    With ``work``, the training state is saved there every ``cfg.save_every`` steps and after every
    epoch; ``resume`` continues from it. No other process may train in ``work`` meanwhile (``RunBusy``). The
    target must sit on the accelerator's device (one process per device under ``accelerate launch``).
    ``after_step(step)`` runs after every optimizer step. ``prefix``: the folder of the state this run shares with
    the arms whose objectives differ from its own only late (``prefix``); a fresh run starts from it where it
    exists and writes it where it does not (one process only)."""
    accelerator = accelerator or make_accelerator(cfg)
    if not same_device(target.device, accelerator.device):
        raise SettingsError(f"the target is on {target.device}, this process trains on {accelerator.device}")
    locked = run_lock(work) if work is not None and accelerator.is_main_process else contextlib.nullcontext()
    try:
        with locked:  # one trainer per run folder (``lock``)
            return _train(method, target, train_set, val_set, cfg, data_meta, out, work, resume, accelerator,
                          after_step, prefix if accelerator.num_processes == 1 else None)
    finally:  # the accelerator keeps every object it prepared: let go, so the next drafter's run holds its own only
        accelerator.free_memory()


def _train(method, target, train_set, val_set, cfg, data_meta, out, work, resume, accelerator, after_step,
           prefix) -> dict:
    run = set_up(method, target, train_set, cfg, data_meta, accelerator)
    progress = Progress(running={}, history=[])
    branch = branch_step(getattr(method, "loss", None), run.total_steps) if prefix is not None else None
    if resume:
        saved = saved_state(work)
        if saved is None:
            raise SettingsError(f"nothing to resume in {work}: no saved training state")
        progress = load_state(saved, run.trainee(), accelerator)
    elif branch is not None and (shared := saved_state(prefix)) is not None:
        progress = load_state(shared, run.trainee(), accelerator)
        if progress.step != branch:
            raise SettingsError(f"the shared prefix {prefix} stops at step {progress.step}, not {branch}")
        progress.started_from = {"prefix": Path(prefix).name, "step": branch}
        tqdm.write(f"{method.name}: starting at step {branch} from the shared prefix {prefix}")
    progress.total = run.total_steps
    start = time.perf_counter() - progress.wall_s
    bar = tqdm(total=run.total_steps, initial=progress.step, desc=f"train {method.name}", unit="step",
               disable=not accelerator.is_main_process)

    def save() -> None:
        if work is not None:
            progress.wall_s = time.perf_counter() - start
            save_state(Path(work) / "state", run.trainee(), progress, accelerator)

    def share() -> None:  # the state after the branch step, for the arms that differ from this one only after it
        try:
            with run_lock(prefix):
                if saved_state(prefix) is None:
                    progress.wall_s = time.perf_counter() - start
                    save_state(Path(prefix) / "state", run.trainee(), shareable(progress), accelerator)
        except RunBusy:
            pass  # another run is writing it now

    def stop_here(saved: bool) -> None:
        if not saved:
            save()
        bar.close()
        where = f"saved in {work}: the same command resumes it" if work is not None else "not saved (no run folder)"
        tqdm.write(f"{method.name}: stopped after step {progress.step} of {run.total_steps}; {where}")
        raise TrainingStopped(f"{method.name} stopped after step {progress.step}")

    # one process: a stop signal waits for the step's end (``stop``); several would have to agree on the step
    asked = stop_between_steps() if accelerator.num_processes == 1 else contextlib.nullcontext(StopRequest())
    with asked as stop:
        first = 0  # the first step of this epoch
        for epoch, batches in enumerate(run.plan):
            skip = max(0, progress.step - first)  # steps of this epoch made before a resume
            first += len(batches)
            if epoch < len(progress.history):  # trained, evaluated and saved before a resume
                continue
            for batch in epoch_batches(run, train_set, batches, skip):
                train_step(run, batch, progress)
                bar.update()
                bar.set_postfix(tok_s=f"{progress.tokens / max(time.perf_counter() - start, 1e-9):.0f}",
                                **{k: f"{v:.3f}" for k, v in progress.running.items() if k in ("acc1", "loss1")})
                if cfg.validate_every and progress.step % cfg.validate_every == 0:
                    val = validate(run, val_set)
                    progress.checks = [*(progress.checks or []), {"step": progress.step, "val": val}]
                    tqdm.write(f"{method.name} step {progress.step}: validation agreement by depth " + depths(val))
                if after_step is not None:
                    after_step(progress.step)
                if progress.step % cfg.save_every == 0:
                    save()
                if progress.step == branch:
                    share()
                if stop.asked:
                    stop_here(saved=progress.step % cfg.save_every == 0)
            val = validate(run, val_set)
            trained = {k: round(v, 4) for k, v in progress.running.items()}
            progress.history.append({"epoch": epoch + 1, "train": trained, "val": val})
            progress.running = {}
            tqdm.write(f"{method.name} epoch {epoch + 1}: validation agreement by depth " + depths(val))
            save()
            if stop.asked and epoch + 1 < len(run.plan):
                stop_here(saved=True)
    bar.close()
    return finish(run, target, cfg, data_meta, progress, time.perf_counter() - start, out)


def finish(run: Run, target, cfg: TrainConfig, data_meta: dict, progress: Progress, wall_s: float,
           out: Path | None) -> dict:
    """The trained network's card, and its checkpoint in ``out`` (written by the main process)."""
    net, accelerator = run.accelerator.unwrap_model(run.net), run.accelerator
    facts = RunFacts(wall_s, accelerator.num_processes, accelerator.device, run.taps.layers, run.coverage)
    drafter = run.method.drafter_network(net)
    card = training_card(run.method, target, cfg, data_meta, progress, drafter, run.frozen, facts)
    if out is not None and accelerator.is_main_process:
        weights = {k: v.detach() for k, v in drafter.state_dict().items()}
        weights["vocab_map"] = run.frozen.vocab_map.int()
        extras = run.method.save_extras(net, Path(out), target)
        if extras:
            card["joint"] = extras
        save_checkpoint(out, weights, card)
    return card
