"""The one training pipeline for every trained drafter, on ``accelerate``.

ShareGPT prompts -> (self-distilled) answers -> frozen target features -> the method's own loss
-> a bf16 safetensors checkpoint with a JSON card. Methods plug in through the training protocol
of ``TrainedDrafter``: ``new_network(target)`` and ``training_loss(net, frozen, tokens, feats, valid, evaluate, done)``.
The same code runs on a CPU, one GPU, or several through ``accelerate launch``; its state is saved in a
work folder every ``save_every`` steps, so ``resume`` continues to the weights an unbroken run reaches.
"""

from __future__ import annotations

import json
import math
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from specviz.core.errors import SettingsError
from specviz.core.load import fast_dtype
from specviz.core.metrics import extra_memory_pct

from .checkpoint import load_checkpoint, save_checkpoint, target_signature
from .corpus import FeatureSet, length_batches
from .distill import cast_copy
from .trained import TrainedDrafter
from .vocab_head import FrozenTarget, draft_vocabulary


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


def batches(data: FeatureSet, cfg: TrainConfig, gen: torch.Generator) -> list[list[int]]:
    """Length-bucketed batches of about ``batch_tokens`` padded tokens, in shuffled order."""
    lengths = (data.offsets[1:] - data.offsets[:-1]).clamp(max=cfg.max_length).tolist()
    return length_batches(lengths, cfg.batch_tokens, gen)


def make_batch(data: FeatureSet, ids: list[int], cfg: TrainConfig, device="cpu"):
    """Right-padded tokens [B,T], features [B,T,H] (fp32) and valid [B,T]: predictions that count."""
    seqs = [data.sequence(i) for i in ids]
    width = min(cfg.max_length, max(s[0].numel() for s in seqs))
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    feats = torch.zeros(len(seqs), width, data.features.shape[1])
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, (tok, feat, start) in enumerate(seqs):
        n = min(width, tok.numel())
        tokens[row, :n], feats[row, :n] = tok[:n], feat[:n].float()
        valid[row, max(start - 1, 0): n - 1] = True  # position t predicts feature t+1 (inside the answer)
    return tokens.to(device), feats.to(device), valid.to(device)


class LayerTaps:
    """The inputs of the target's decoder ``layers`` over a batch, appended to its stored features.

    Computed on the fly (one forward of the target's body per batch, in the dtype the stored features
    came from), so a method reading more layers (EAGLE-3) keeps no second feature cache on disk.
    Right padding needs no mask: attention is causal, so padding never reaches a real position."""

    def __init__(self, target, layers: tuple[int, ...], dtype: torch.dtype | None = None):
        self.layers = layers
        decoder = target.model.get_decoder()
        copy = layers and dtype not in (None, target.dtype)  # most methods tap nothing: no copy of the body
        self.decoder = cast_copy(decoder, dtype) if copy else decoder

    @classmethod
    def of(cls, method: type[TrainedDrafter], target, data_meta: dict) -> "LayerTaps":
        """The taps ``method`` reads, in the dtype the data card says the stored features came from."""
        dtype = data_meta.get("feature_dtype")
        return cls(target, method.tapped_layers(target.num_layers), getattr(torch, dtype) if dtype else None)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """``feats`` with the taps appended; a set of tokens alone (``prepare(features=False)``, no columns)
        gets the final-norm output from the same forward, rounded to float16 as stored features are."""
        if not self.layers:
            return feats
        out = self.decoder(input_ids=tokens, use_cache=False, output_hidden_states=True)
        if feats.shape[-1] == 0:
            feats = out.last_hidden_state.half().to(feats.dtype)
        return torch.cat([feats] + [out.hidden_states[i].to(feats.dtype) for i in self.layers], dim=-1)


def evaluate(method: type[TrainedDrafter], net, frozen, data: FeatureSet, cfg: TrainConfig,
             taps: LayerTaps | None = None) -> dict:
    net.eval()
    totals, weight = {}, 0
    with torch.no_grad():
        for ids in batches(data, cfg, torch.Generator().manual_seed(0)):
            tokens, feats, valid = make_batch(data, ids, cfg, frozen.head.device)
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
    state, _ = load_checkpoint(folder, method.name, target)
    net, frozen = method.restore(target, state)
    return evaluate(method, net, frozen, val_set, cfg, LayerTaps.of(method, target, data_meta))


def depths(val: dict) -> str:
    return " ".join(f"{val[f'acc{d}']:.3f}" for d in range(1, 9) if f"acc{d}" in val)


def cosine_with_warmup(total_steps: int, warmup: float) -> Callable[[int], float]:
    warm = max(1, int(warmup * total_steps))
    decay = max(1, total_steps - warm)
    return lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / decay))


@dataclass
class Progress:
    """What a saved training state adds to accelerate's own: where the run stands."""

    step: int = 0
    wall_s: float = 0.0
    tokens: int = 0  # answer tokens whose predictions were trained on
    running: dict | None = None
    history: list | None = None  # per epoch: training and validation agreement
    checks: list | None = None  # validations during the epochs: {"step", "val"}

    def save(self, folder: Path) -> None:
        (folder / "progress.json").write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, folder: Path) -> "Progress":
        return cls(**json.loads((folder / "progress.json").read_text()))


def saved_state(work: Path | None) -> Path | None:
    """The last complete training state in ``work``; ``state.old`` if a save was killed mid-swap."""
    for name in ("state", "state.old"):
        if work is not None and (Path(work) / name / "progress.json").exists():
            return Path(work) / name
    return None


def train(method: type[TrainedDrafter], target, train_set: FeatureSet, val_set: FeatureSet, cfg: TrainConfig,
          data_meta: dict, out: Path | None = None, work: Path | None = None, resume: bool = False,
          accelerator: Accelerator | None = None, after_step: Callable[[int], None] | None = None) -> dict:
    """Train ``method`` on ``train_set``; save to ``out`` and return its card.

    With ``work``, the training state is saved there every ``cfg.save_every`` steps and after every
    epoch; ``resume`` continues from it. The target must sit on the accelerator's device (one process
    per device under ``accelerate launch``). ``after_step(step)`` runs after every optimizer step."""
    accelerator = accelerator or make_accelerator(cfg)
    if not same_device(target.device, accelerator.device):
        raise SettingsError(f"the target is on {target.device}, this process trains on {accelerator.device}")
    try:
        return _train(method, target, train_set, val_set, cfg, data_meta, out, work, resume, accelerator, after_step)
    finally:  # an accelerator saves every object it prepared: the next drafter's state must hold only its own
        accelerator.free_memory()


def _train(method, target, train_set, val_set, cfg, data_meta, out, work, resume, accelerator, after_step) -> dict:
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    eos = sorted(target.eos_token_ids)
    vocab_map = draft_vocabulary(train_set.tokens, cfg.draft_vocab, target.vocab_size, always=eos)
    coverage = float(torch.isin(train_set.tokens, vocab_map).float().mean())
    frozen = FrozenTarget(target, vocab_map)
    taps = LayerTaps.of(method, target, data_meta)
    net = method.new_network(target).float().train()
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    plan = [batches(train_set, cfg, gen) for _ in range(cfg.epochs)]
    total_steps = sum(len(p) for p in plan)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(total_steps, cfg.warmup))
    net, opt, sched = accelerator.prepare(net, opt, sched)
    state = None if work is None else Path(work) / "state"
    progress = Progress(running={}, history=[])
    if resume:
        saved = saved_state(work)
        if saved is None:
            raise SettingsError(f"nothing to resume in {work}: no saved training state")
        accelerator.load_state(str(saved))
        progress = Progress.load(saved)
    start = time.perf_counter() - progress.wall_s
    bar = tqdm(total=total_steps, initial=progress.step, desc=f"train {method.name}", unit="step",
               disable=not accelerator.is_main_process)

    def save() -> None:  # written aside, then swapped in: a kill mid-save leaves the last state whole
        if state is None:
            return
        partial, old = state.with_name("state.partial"), state.with_name("state.old")
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(partial), safe_serialization=False)  # cuDNN's LSTM weights share one buffer
        progress.wall_s = time.perf_counter() - start
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            progress.save(partial)  # last: a folder holding it is complete
            shutil.rmtree(old, ignore_errors=True)
            if state.exists():
                state.rename(old)
            partial.rename(state)
            shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()

    first = 0  # the first step of this epoch
    for epoch, epoch_batches in enumerate(plan):
        skip = max(0, progress.step - first)  # steps of this epoch made before a resume
        first += len(epoch_batches)
        if epoch < len(progress.history):  # trained, evaluated and saved before a resume
            continue
        if skip < len(epoch_batches):
            loader = accelerator.prepare_data_loader(DataLoader(
                range(len(train_set)), batch_sampler=epoch_batches,
                collate_fn=lambda ids: make_batch(train_set, ids, cfg)))
            for tokens, feats, valid in accelerator.skip_first_batches(loader, skip) if skip else loader:
                feats = taps(tokens, feats)
                with torch.autocast(accelerator.device.type, torch.bfloat16, enabled=cfg.mixed_precision == "bf16"):
                    loss, stats = method.training_loss(net, frozen, tokens, feats, valid,
                                                       done=progress.step / total_steps)
                opt.zero_grad(set_to_none=True)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(net.parameters(), cfg.clip)
                opt.step()
                sched.step()
                progress.step, progress.tokens = progress.step + 1, progress.tokens + int(valid.sum())
                for k, v in stats.items():
                    progress.running[k] = 0.9 * progress.running.get(k, v) + 0.1 * v
                bar.update()
                bar.set_postfix(tok_s=f"{progress.tokens / max(time.perf_counter() - start, 1e-9):.0f}",
                                **{k: f"{v:.3f}" for k, v in progress.running.items() if k in ("acc1", "loss1")})
                if cfg.validate_every and progress.step % cfg.validate_every == 0:
                    val = evaluate(method, accelerator.unwrap_model(net), frozen, val_set, cfg, taps)
                    progress.checks = [*(progress.checks or []), {"step": progress.step, "val": val}]
                    tqdm.write(f"{method.name} step {progress.step}: validation agreement by depth " + depths(val))
                if after_step is not None:
                    after_step(progress.step)
                if progress.step % cfg.save_every == 0:
                    save()
        val = evaluate(method, accelerator.unwrap_model(net), frozen, val_set, cfg, taps)
        progress.history.append({"epoch": epoch + 1, "train": {k: round(v, 4) for k, v in progress.running.items()},
                                 "val": val})
        progress.running = {}
        tqdm.write(f"{method.name} epoch {epoch + 1}: validation agreement by depth " + depths(val))
        save()
    bar.close()
    net = accelerator.unwrap_model(net)
    trained = sum(p.numel() for p in net.parameters())
    extra = trained + frozen.head.numel()
    device = accelerator.device
    card = {
        "method": method.name,
        "title": method.title,
        "target": target_signature(target),
        "data": data_meta,
        "training": {**asdict(cfg), "steps": progress.step, "answer_tokens_seen": progress.tokens,
                     "wall_s": round(time.perf_counter() - start, 1), "processes": accelerator.num_processes,
                     "mixed_precision": cfg.mixed_precision,
                     "machine": f"{platform.machine()} {torch.get_num_threads()} threads" if device.type == "cpu"
                     else torch.cuda.get_device_name(device)},
        "objective": asdict(method.loss) if is_dataclass(getattr(method, "loss", None)) else None,
        "features": {"final_norm_output": True, "tapped_layer_inputs": list(taps.layers)},
        "draft_vocab": {"size": int(vocab_map.numel()), "train_token_coverage": round(coverage, 4)},
        "history": progress.history,
        "validation_checks": progress.checks or [],
        "parameters": {"trained": trained, "lm_head_rows_copied": frozen.head.numel(), "extra_total": extra,
                       "extra_memory_pct": round(extra_memory_pct(extra, target.num_parameters), 2)},
        "lm_head": "the target's frozen, tied LM head restricted to the draft vocabulary (not trained, not stored)",
        "mtbench": None,
    }
    if out is not None and accelerator.is_main_process:
        weights = {k: v.detach() for k, v in net.state_dict().items()}
        weights["vocab_map"] = vocab_map.int()
        save_checkpoint(out, weights, card)
    return card


def same_device(a, b) -> bool:
    """``cuda`` and ``cuda:0`` are one device (accelerate says the first, a model's parameters the second)."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    """One process's accelerator: the CPU when the config says so, else the device ``accelerate launch`` gives.
    bf16 is torch's own autocast around the loss (``cfg.precision``), not accelerate's process-wide setting."""
    return Accelerator(cpu=torch.device(cfg.device).type == "cpu")
