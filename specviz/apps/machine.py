"""The one place that says which machine a figure came from.

Three names, for three uses:
- ``machine_description()``: what a results file prints (the GPU, or the CPU with its kernels and threads).
- ``machine_fingerprint()``: what speed depends on, without the thread count, so a run log refuses to mix
  speed figures of two machines while a pinned ``--part`` and the full run on one machine still agree.
- ``machine_key(target)``: the tuner's cache key; a budget measured here, for this target, dtype, device
  and kernels, is never read for another.

``core.load`` reads the CPU's capabilities to pick a dtype; only this module turns them into an identity.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from drafters.captured import capture_drafters
from specviz.core.attention import NAME as GROUPED
from specviz.core.attention import REVISION as GROUPED_REVISION
from specviz.core.capture import REVISION as CAPTURE_REVISION
from specviz.core.cpu import cpu_flags, cpuinfo
from specviz.core.files import content_key
from specviz.core.head import refined
from specviz.core.rows import REVISION as ROWS_REVISION
from specviz.core.target import TargetModel

# the CPU features a tuned budget depends on: the bf16 and vector kernels torch picks from them
TUNING_FLAGS = frozenset({"amx_bf16", "avx512_bf16", "avx2"})


def _capability() -> str:
    """torch's vector kernels, and the bf16 units beside them (torch names AVX512 alike with and without them,
    and bf16 speed turns on them)."""
    flags, capability = cpu_flags(), torch.backends.cpu.get_cpu_capability()
    unit = "AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else None
    return f"{capability}, {unit}" if unit else capability


def machine_description() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return (f"{platform.machine()} CPU ({_capability()}), {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")


def _cpu_models() -> str:
    """Every distinct CPU model name (a machine may mix sockets), or what ``platform`` knows."""
    try:
        names = {line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")}
    except OSError:
        names = set()
    return ", ".join(sorted(names)) or platform.processor() or platform.machine()


def machine_fingerprint() -> str:
    """What speed depends on, without the thread count (a pinned part and the full run share one machine)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{_cpu_models()} ({_capability()}), {os.cpu_count()} cores"


def machine_key(target: TargetModel) -> str:
    """The tuner's cache key for ``target`` on this machine."""
    on_cpu = target.device.type == "cpu"
    cpu = [cpuinfo("model name"), sorted(cpu_flags() & TUNING_FLAGS)] if on_cpu else []
    facts = [machine_description(), *cpu, target.name, str(target.dtype), str(target.device), target.num_parameters,
             target.kernels]
    if target.plain_rows:  # the rows kernel's speed (``core.rows``)
        facts.append(f"rows r{ROWS_REVISION}")
    elif on_cpu and refined(target.model):  # a bf16 head's refinement runs on the same extension (``core.head``)
        facts.append(f"head r{ROWS_REVISION}")
    attention = getattr(target.config, "_attn_implementation", None)
    if attention not in (None, "sdpa"):  # a verify's cost turns on it (``core.attention``); SDPA's keys stay
        facts.append(attention if attention != GROUPED else f"{attention} r{GROUPED_REVISION}")
    if target.engine.path != "eager":  # compiled forwards cost otherwise: their own budgets
        facts.append(f"{target.engine.path} r{CAPTURE_REVISION}")
        if target.captured.layout != "live":  # the layout read by a CPU's budgets before it had a name
            facts.append(f"{target.captured.layout}{' graphs' if target.captured.graphs else ''}")
        if capture_drafters(target):  # the drafters' cost too
            facts.append("drafters compiled")
    return content_key(facts)
