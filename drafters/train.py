"""The one training pipeline for every trained drafter.

ShareGPT prompts -> (self-distilled) answers -> frozen target features -> the method's own loss
-> a bf16 safetensors checkpoint with a JSON card. Methods plug in through the training protocol
of ``TrainedDrafter``: ``new_network(target)`` and ``training_loss(net, frozen, tokens, feats, valid, evaluate)``.
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specviz.core.errors import SettingsError
from specviz.core.metrics import extra_memory_pct

from .checkpoint import save_checkpoint, target_signature
from .corpus import FeatureSet, length_batches
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

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.lr <= 0 or self.batch_tokens < 16 or self.max_length < 4:
            raise SettingsError(f"invalid training settings: {self}")


def batches(data: FeatureSet, cfg: TrainConfig, gen: torch.Generator) -> list[list[int]]:
    """Length-bucketed batches of about ``batch_tokens`` padded tokens, in shuffled order."""
    lengths = (data.offsets[1:] - data.offsets[:-1]).clamp(max=cfg.max_length).tolist()
    return length_batches(lengths, cfg.batch_tokens, gen)


def make_batch(data: FeatureSet, ids: list[int], cfg: TrainConfig, device):
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


def evaluate(method: type[TrainedDrafter], net, frozen, data: FeatureSet, cfg: TrainConfig) -> dict:
    net.eval()
    totals, weight = {}, 0
    with torch.no_grad():
        for ids in batches(data, cfg, torch.Generator().manual_seed(0)):
            tokens, feats, valid = make_batch(data, ids, cfg, frozen.head.device)
            _, stats = method.training_loss(net, frozen, tokens, feats, valid, evaluate=True)
            n = int(valid.sum())
            weight += n
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v * n
    net.train()
    return {k: round(v / max(weight, 1), 4) for k, v in totals.items()}


def train(method: type[TrainedDrafter], target, train_set: FeatureSet, val_set: FeatureSet, cfg: TrainConfig,
          data_meta: dict, out: Path | None = None) -> dict:
    """Train ``method`` (a drafter class) on ``train_set``; save to ``out`` and return its card."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    eos = sorted(target.eos_token_ids)
    vocab_map = draft_vocabulary(train_set.tokens, cfg.draft_vocab, target.vocab_size, always=eos)
    coverage = float(torch.isin(train_set.tokens, vocab_map).float().mean())
    frozen = FrozenTarget(target, vocab_map)
    net = method.new_network(target).to(device).float().train()
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    plan = [batches(train_set, cfg, gen) for _ in range(cfg.epochs)]
    total_steps = sum(len(p) for p in plan)
    warm = max(1, int(cfg.warmup * total_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: ((s + 1) / warm if s < warm
                        else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total_steps - warm)))))
    start, step, history = time.perf_counter(), 0, []
    bar = tqdm(total=total_steps, desc=f"train {method.name}", unit="step")
    for epoch, epoch_batches in enumerate(plan):
        running = {}
        for ids in epoch_batches:
            tokens, feats, valid = make_batch(train_set, ids, cfg, device)
            loss, stats = method.training_loss(net, frozen, tokens, feats, valid)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            opt.step()
            sched.step()
            step += 1
            for k, v in stats.items():
                running[k] = 0.9 * running.get(k, v) + 0.1 * v
            bar.update()
            bar.set_postfix({k: f"{v:.3f}" for k, v in running.items() if k.startswith(("acc1", "loss1"))})
        val = evaluate(method, net, frozen, val_set, cfg)
        history.append({"epoch": epoch + 1, "train": {k: round(v, 4) for k, v in running.items()}, "val": val})
        tqdm.write(f"{method.name} epoch {epoch + 1}: val {val}")
    bar.close()
    wall = time.perf_counter() - start
    trained = sum(p.numel() for p in net.parameters())
    extra = trained + frozen.head.numel()
    card = {
        "method": method.name,
        "title": method.title,
        "target": target_signature(target),
        "data": data_meta,
        "training": {**asdict(cfg), "steps": step, "wall_s": round(wall, 1),
                     "machine": f"{platform.machine()} {torch.get_num_threads()} threads" if device.type == "cpu"
                     else torch.cuda.get_device_name(device)},
        "draft_vocab": {"size": int(vocab_map.numel()), "train_token_coverage": round(coverage, 4)},
        "history": history,
        "parameters": {"trained": trained, "lm_head_rows_copied": frozen.head.numel(), "extra_total": extra,
                       "extra_memory_pct": round(extra_memory_pct(extra, target.num_parameters), 2)},
        "lm_head": "the target's frozen, tied LM head restricted to the draft vocabulary (not trained, not stored)",
        "mtbench": None,
    }
    if out is not None:
        state = {k: v.detach() for k, v in net.state_dict().items()}
        state["vocab_map"] = vocab_map.int()
        save_checkpoint(out, state, card)
    return card
