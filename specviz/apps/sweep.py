"""Speed and output quality against temperature, for each acceptance rule (the shape of ReDrafter's Table 2).

Each (temperature, rule) cell is one ``bench`` of the methods, AR included, on the same questions and
seed, so a speedup is against AR sampling at that temperature. Quality is the target's own mean
log-likelihood per generated token (at T = 1, one forward over prompt + output): a lossless rule
samples the target's distribution, so its quality matches AR's up to sampling noise; a lossy rule
(typical acceptance) can drift from it, usually towards more likely, blander text at high temperature.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from specviz.core.files import atomic_write
from specviz.core.target import TargetModel
from specviz.core.verify import Sampling

from .bench import PromptRun, bench
from .machine import machine_description
from .questions import Question


@torch.inference_mode()
def log_likelihood(target: TargetModel, prompt: list[int], output: list[int]) -> tuple[float, int]:
    """Sum of the target's log-probabilities (T = 1) of ``output`` after ``prompt``, and its length."""
    if not output:
        return 0.0, 0
    ids = torch.tensor([prompt + output], device=target.device)
    logits = target.model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1: -1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(output, device=target.device)[:, None])
    return float(logp.sum()), len(output)


def sweep(target: TargetModel, methods: list[str], questions: list[Question], temperatures=(0.0, 0.5, 1.0),
          rules=("rejection", "typical"), max_new_tokens: int = 64, seed: int = 0) -> Iterator[list[dict]]:
    """Yield the table so far (one row per method × rule × temperature) after every cell."""
    prompts = [target.text.encode_chat(q.prompt) for q in questions]
    rows: list[dict] = []
    for temperature in temperatures:
        for rule in rules:
            if temperature == 0 and rule == "rejection":
                rule = "greedy"  # the lossless rule at T = 0
            sampling = Sampling(temperature=temperature, rule=rule, seed=seed)
            runs: dict[str, list[PromptRun]] = {}
            result = bench(target, methods, questions, max_new_tokens, sampling, warmup=False, progress=False,
                           runs=runs)
            for label, m in result.methods.items():
                total, count = 0.0, 0
                for ids, run in zip(prompts, runs[label]):
                    s, n = log_likelihood(target, ids, run.output)
                    total, count = total + s, count + n
                rows.append({"method": label, "rule": rule, "lossless": sampling.lossless,
                             "temperature": temperature, "tau": round(1.0 if m.tau is None else m.tau, 3),
                             "speedup": round(m.speedup, 3), "tokens_per_s": round(m.tokens_per_s, 2),
                             "log_likelihood": round(total / max(count, 1), 4), "tokens": count})
            yield list(rows)


def sweep_to_file(target: TargetModel, methods: list[str], questions: list[Question], temperatures, rules,
                  max_new_tokens: int, seed: int, out: Path) -> list[dict]:
    """``sweep``, rewriting ``out`` after every cell (a killed sweep keeps its finished cells) and printing each
    cell's speedups and log-likelihoods."""
    rows: list[dict] = []
    for rows in sweep(target, methods, questions, temperatures, rules, max_new_tokens, seed):
        atomic_write(out, json.dumps({"machine": machine_description(), "dtype": str(target.dtype), "rows": rows},
                                     indent=1))
        last = rows[-1]
        print(f"T={last['temperature']} {last['rule']}: " + ", ".join(
            f"{r['method']} {r['speedup']:.2f}x ll {r['log_likelihood']:.3f}" for r in rows
            if r["temperature"] == last["temperature"] and r["rule"] == last["rule"]), flush=True)
    return rows
