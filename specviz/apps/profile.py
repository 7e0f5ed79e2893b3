"""The target's verify-cost curve: ms of one forward against the number of tokens it verifies, beside this
machine's floor for each (``floor``)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

import torch
from tqdm.auto import tqdm

from specviz.core.batch import batch_mask
from specviz.core.batch_cache import BatchSlabCache
from specviz.core.errors import SettingsError
from specviz.core.kernels import KernelChoice
from specviz.core.target import TargetModel
from specviz.core.timing import now
from specviz.core.tree import DraftTree

from . import opsplit
from .floor import forward_cost, measure_rates
from .machine import machine_description


def profile(target: TargetModel, context: int = 256, sizes=(1, 2, 4, 8, 16, 32, 64), repeats: int = 7,
            tree: bool = False, floor: bool = False, batch: int = 1, ops: bool = False) -> dict:
    """Mean ms of one target forward verifying n tokens after ``context`` cached tokens: a chain (plain
    causal attention), or with ``tree`` a tree (every node a child of the root: the 4D-mask path trees take).
    With ``batch`` B > 1, one forward verifies n tokens in each of B sequences (``core.batch``: every row a
    4D mask, chain or tree), so the curve is what B sequences pay together.

    The sizes take turns within each round (in a rotated order), so a slow spell of the machine lands on
    every size rather than on all repeats of one; the mean, not the median, is what a decode pays. With ``floor``
    each row also gets the machine's floor for that forward (``floor.ForwardCost``) and the ratio to it; with
    ``ops``, where the time of each size goes, by kind of operator (``opsplit``)."""
    if context < 1 or context + max(sizes) > target.max_length:
        raise SettingsError(f"context must be in [1, {target.max_length - max(sizes)}], got {context}")
    if batch < 1:
        raise SettingsError(f"batch must be at least 1, got {batch}")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (context,), generator=gen).tolist()
    cache = target.new_cache()
    target.prefill(prompt, cache)
    if batch > 1:  # every row holds the same context
        rows = target.new_batch_cache(batch, context + max(sizes) + 1)
        for _ in range(batch):
            rows.adopt(rows.add(), cache)
        cache = rows
    drafts = {}
    for n in sizes:
        tokens = torch.randint(0, target.vocab_size, (n - 1,), generator=gen)
        if tree and n > 2:
            drafts[n] = DraftTree(tokens, torch.zeros(n - 1, dtype=torch.long))
        else:
            drafts[n] = DraftTree.chain(tokens)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for i in tqdm(range(repeats + 1), desc="profile", unit="round"):
        order = list(sizes)[i % len(sizes):] + list(sizes)[: i % len(sizes)]
        for n in order:
            elapsed = _timed(target, drafts[n], prompt[-1], cache, context)
            if i:  # the first round warms up
                times[n].append(elapsed)
    rows = [{"tokens": n, "ms": 1000 * statistics.fmean(times[n])} for n in sizes]
    base = rows[0]["ms"]
    for r in rows:
        r["relative_to_1"] = r["ms"] / base
    result = {"target": target.name, "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
              "context": context, "shape": "tree" if tree else "chain", "machine": machine_description(),
              "kernels": target.kernels,
              **({"batch": batch} if batch > 1 else {}),
              "date": time.strftime("%Y-%m-%d"), "curve": rows}
    if floor:
        rates = measure_rates(str(target.device), target.dtype)
        result["rates"] = asdict(rates)
        for r in rows:
            r["floor_ms"] = forward_cost(target, r["tokens"], context).floor_ms(rates)
            r["x_floor"] = r["ms"] / r["floor_ms"]
    if ops:
        result["ops"] = [opsplit.split(lambda n=r["tokens"]: _timed(target, drafts[n], prompt[-1], cache, context),
                                       r["tokens"], r["ms"], target.device).to_dict() for r in rows]
    return result


def _timed(target: TargetModel, tree: DraftTree, root: int, cache, context: int) -> float:
    """Seconds of one verify of ``tree`` after ``context`` (unpadded: the raw cost of its size), in every row of a
    batch cache; the cache is rewound to ``context`` after it."""
    if not isinstance(cache, BatchSlabCache):
        start = now(target.device)
        target.verify(root, tree, cache)
        elapsed = now(target.device) - start
        cache.crop(-(len(tree) + 1))
        return elapsed
    b = cache.active
    ids, positions = tree.input_ids(root).expand(b, -1), tree.positions(context).expand(b, -1)
    mask = batch_mask([context] * b, [tree.ancestors()] * b, target.dtype)
    start = now(target.device)
    target.forward_rows(ids, positions, mask, cache)
    elapsed = now(target.device) - start
    for row in range(b):
        cache.keep(row, context, [])  # back to the context: nothing of the verify stays
    return elapsed


def curve_text(result: dict) -> str:
    """``profile``'s result as the terminal shows it: ms per size, and as a multiple of one token."""
    batch = f" in each of {result['batch']} sequences at once" if result.get("batch", 1) > 1 else ""
    kernels = f", {result['kernels']}" if result.get("kernels") else ""
    lines = [f"verify cost of a {result['shape']}{batch} on {result['machine']} ({result['dtype']}{kernels}, "
             f"{result['context']} cached tokens):"]
    for row in result["curve"]:
        line = f"  {row['tokens']:3d} tokens: {row['ms']:7.1f} ms  ({row['relative_to_1']:.2f}x one token)"
        if "floor_ms" in row:
            line += f"   floor {row['floor_ms']:6.2f} ms, {row['x_floor']:5.2f}x the floor"
        lines.append(line)
    if "rates" in result:
        rates = result["rates"]
        lines.append(f"floor: weights and cache read at {rates['read_gb_s']:.1f} GB/s, matrix work at "
                     f"{rates['matmul_gflop_s']:.0f} GFLOP/s ({rates['dtype']}, {rates['threads']} threads, measured "
                     "here); the rest of a forward (norms, rotary, softmax, Python, launches) is the engine's")
    if "ops" in result:
        lines.append(opsplit.split_text([opsplit.OpSplit.from_dict(r) for r in result["ops"]]))
    return "\n".join(lines)


def kernels_text(choice: KernelChoice) -> str:
    """``core.kernels``' measurement as the terminal shows it: every packed layer once, each way, per row count."""
    lines = [f"one call of every packed linear layer, ms (median), {choice.plain} against packed oneDNN:"]
    for size, plain, packed in zip(choice.sizes, choice.plain_ms, choice.packed_ms):
        lines.append(f"  {size:3d} rows: plain {plain:7.2f}   packed {packed:7.2f}   ({plain / packed:.2f}x)")
    lines.append(f"chosen: {choice.describe()}")
    return "\n".join(lines)
