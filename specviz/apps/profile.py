"""The target's verify-cost curve: ms of one forward against the number of tokens it verifies."""

from __future__ import annotations

import statistics
import time

import torch
from tqdm.auto import tqdm

from specviz.core.errors import SettingsError
from specviz.core.target import TargetModel
from specviz.core.timing import now
from specviz.core.tree import DraftTree

from .bench import machine_description


def profile(target: TargetModel, context: int = 256, sizes=(1, 2, 4, 8, 16, 32, 64), repeats: int = 7,
            tree: bool = False) -> dict:
    """Median ms of one target forward verifying n tokens after ``context`` cached tokens: a chain (plain
    causal attention), or with ``tree`` a tree (every node a child of the root: the 4D-mask path trees take)."""
    if context < 1 or context + max(sizes) > target.max_length:
        raise SettingsError(f"context must be in [1, {target.max_length - max(sizes)}], got {context}")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (context,), generator=gen).tolist()
    cache = target.new_cache()
    target.prefill(prompt, cache)
    rows = []
    for n in tqdm(sizes, desc="profile", unit="size"):
        tokens = torch.randint(0, target.vocab_size, (n - 1,), generator=gen)
        draft = DraftTree(tokens, torch.zeros(n - 1, dtype=torch.long)) if tree and n > 2 else DraftTree.chain(tokens)
        times = []
        for i in range(repeats + 1):
            start = now(target.device)
            target.verify(prompt[-1], draft, cache)
            elapsed = now(target.device) - start
            cache.crop(-n)
            if i:  # the first call warms up
                times.append(elapsed)
        rows.append({"tokens": n, "ms": 1000 * statistics.median(times)})
    base = rows[0]["ms"]
    for r in rows:
        r["relative_to_1"] = r["ms"] / base
    return {"target": target.name, "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
            "context": context, "shape": "tree" if tree else "chain", "machine": machine_description(),
            "date": time.strftime("%Y-%m-%d"), "curve": rows}
