"""One method on one prompt in a terminal: tokens coloured by origin as they arrive, then the run's figures."""

from __future__ import annotations

import sys

from drafters import build_drafter
from specviz.core.engine import check_request, generate
from specviz.core.errors import SpecvizError
from specviz.core.metrics import acceptance_by_depth, extra_memory_pct, summarize
from specviz.core.target import TargetModel
from specviz.core.text import ChatText
from specviz.core.verify import Sampling

from .methods import parse_method
from .tuning import machine_costs, resolve

GREEN, YELLOW, RESET = "\033[32m", "\033[33m", "\033[0m"


def stream_coloured(text: ChatText, steps, enabled: bool, out=None) -> list:
    """Print each step's tokens as they arrive (accepted drafts green, target tokens yellow), decoded by ``text``."""
    out = out or sys.stdout
    records, ids, shown = [], [], ""
    try:
        for record in steps:
            records.append(record)
            for i, tok in enumerate(record.tokens):
                ids.append(tok)
                whole = text.decode(ids)
                piece, shown = whole[len(shown):] if whole.startswith(shown) else text.decode([tok]), whole
                colour = GREEN if i < record.accepted else YELLOW
                out.write(f"{colour}{piece}{RESET}" if enabled else piece)
            out.flush()
    except KeyboardInterrupt:  # keep what was generated and still report it
        out.write("\n[stopped]")
    out.write("\n")
    return records


def generate_and_report(target: TargetModel, method: str, prompt: str, max_new_tokens: int, sampling: Sampling,
                        colour: bool) -> None:
    """Stream ``method``'s answer to ``prompt`` (at its tuned budget unless the spec sets one), then print τ,
    speed, latency per phase, the acceptance rule, extra memory and α per depth."""
    if not prompt.strip():
        raise SpecvizError("the prompt is empty")
    name, settings = parse_method(method)
    settings, tuned = resolve(target, name, settings)
    if tuned is not None:
        print(f"budget for this machine: {tuned.describe()}", flush=True)
    drafter = build_drafter(name, target, **settings)
    ids = target.text.encode_chat(prompt)
    check_request(target, ids, max_new_tokens)
    padding = machine_costs(target).padding if tuned is not None else None  # the costs the budget was priced at
    steps = generate(target, drafter, ids, max_new_tokens, sampling, padding=padding)
    records = stream_coloured(target.text, steps, colour)
    m = summarize(records)  # engine time only: printing is not charged to the method
    print()
    if colour:
        print(f"legend: {GREEN}accepted draft token{RESET}  {YELLOW}target token (bonus / correction){RESET}")
    print(f"method {method}: {m.new_tokens} tokens in {m.wall_s:.2f} s = {m.tokens_per_s:.1f} tok/s, "
          f"{m.steps} target forwards after prefill")
    print(f"tau (tokens per target forward, bonus included) = {m.tau:.2f}; mean draft tree size {m.mean_tree_size:.1f}"
          + ("" if m.mean_compression is None else f"; beam compression {m.mean_compression:.2f}"))
    print("latency per token (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in m.latency_ms.items()))
    print(f"acceptance rule: {sampling.resolved_rule}"
          + ("" if sampling.lossless else " (LOSSY: the output distribution is not the target's)"))
    print(f"extra memory: {extra_memory_pct(drafter.num_parameters(), target.num_parameters):.1f}% "
          "of target parameters")
    for depth, (c, u) in enumerate(zip(*acceptance_by_depth(records)), start=1):
        print(f"  alpha depth {depth}: conditional {c:.3f} (accepted / steps reaching depth), "
              f"unconditional {u:.3f} (accepted / all steps)")
