"""What this CPU is, from ``/proc/cpuinfo``: the facts a dtype, a kernel choice and a machine's name read."""

from __future__ import annotations

import os


def cpuinfo(field: str) -> str:
    """The first ``field`` line of /proc/cpuinfo ("flags", "model name"), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), "")
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    return set(cpuinfo("flags").split())


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a container or ``taskset`` narrows), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
