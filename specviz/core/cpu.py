"""What this CPU is, from ``/proc/cpuinfo``: the facts a dtype, a kernel choice and a machine's name read."""

from __future__ import annotations


def cpuinfo(field: str) -> str:
    """The first ``field`` line of /proc/cpuinfo ("flags", "model name"), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), "")
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    return set(cpuinfo("flags").split())
