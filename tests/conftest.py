"""Shared fixtures: tiny random Llama targets/assistants and a cache-free reference forward."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from filelock import FileLock  # noqa: E402
from scipy import stats  # noqa: E402

from specviz.core.capture import use_cache_folder  # noqa: E402
from specviz.core.engine import run  # noqa: E402
from specviz.core.load import cache_dir  # noqa: E402
from specviz.core.packing import pack  # noqa: E402
from specviz.core.target import TargetModel  # noqa: E402

# The models here are tiny: intra-op threading only adds overhead (and is very slow when the
# cores are shared with other processes).
torch.set_num_threads(1)


# Both dtypes a packed layer runs in; bf16 only where oneDNN packs it on this CPU (AVX-512 or AMX: an AVX2-only
# CPU does not, and its bf16 layers run on the plain kernels, which other tests check).
NO_BF16_PACKING = pytest.mark.skipif(pack(torch.ones(2, 2, dtype=torch.bfloat16)) is None,
                                     reason="this torch build or CPU cannot pack bf16 for oneDNN")
PACKED_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=NO_BF16_PACKING)]


# The files that take longest, longest first (``pytest --durations`` under xdist on a 2-core machine). Collected
# first, they are handed out first (``--dist loadfile --no-loadscope-reorder``), so the workers end together
# instead of one finishing a long file alone while the other waits.
SLOWEST_FIRST = ("test_reliability.py", "test_browser.py", "test_app.py", "test_embedded.py", "test_engine_sampling.py",
                 "test_engine.py", "test_cli.py", "test_sigkill.py", "test_device.py", "test_budget.py")


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def run_folder(tmp_path_factory, name: str) -> Path:
    """A folder for the whole test run: shared by pytest-xdist's workers (their base folders have one parent),
    so what one worker builds the others reuse. Build into it under ``run_lock``."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def run_lock(folder: Path) -> FileLock:
    """One worker at a time builds ``folder``'s contents; the others wait, then find them built."""
    return FileLock(str(folder) + ".lock")


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory):
    """The tests' budgets, features and runs go to a cache of their own, not the user's; only the embedded
    model's one-time conversion (linked when the user's cache has it) and inductor's compiled graphs are
    shared. The session's tiny checkpoints are trained into it too (``session_checkpoint``). One per test run,
    shared by its workers."""
    user, root = cache_dir(), run_folder(tmp_path_factory, "specviz-cache")
    with run_lock(root):
        if (user / "smollm2-135m-instruct" / "config.json").exists() and not (root / "smollm2-135m-instruct").exists():
            (root / "smollm2-135m-instruct").symlink_to(user / "smollm2-135m-instruct")
    _TRAINED["root"] = root / "tiny-checkpoints"
    use_cache_folder()  # inductor's compiled graphs, keyed by their content: the user's, so a rerun compiles nothing
    patch = pytest.MonkeyPatch()
    patch.setenv("SPECVIZ_CACHE", str(root))
    yield root
    patch.undo()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """The app tests' tiny target folder (``app_harness.tiny_target_folder``), one per test run: its path is
    part of the tuner's cache key, so every app started on it after the first reads its budgets from the cache."""
    from app_harness import tiny_target_folder

    folder = run_folder(tmp_path_factory, "tiny-app-target")
    with run_lock(folder):
        return tiny_target_folder(folder / "target")


def make_llama(vocab_size: int = 32, seed: int = 0, num_layers: int = 2, std: float = 0.2,
               max_positions: int = 256, eos: int | None = None) -> transformers.LlamaForCausalLM:
    """A tiny random fp32 Llama. ``std`` well above the default 0.02 gives peaked, tie-free logits."""
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        initializer_range=std,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    return model


@torch.inference_mode()
def reference_logits(model, ids) -> torch.Tensor:
    """Logits [T, V] of one plain causal forward over ``ids`` (no cache, no custom mask)."""
    ids = torch.as_tensor(ids, dtype=torch.long)[None]
    return model(input_ids=ids, use_cache=False).logits[0].float()


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding by full forwards (no cache): the ground truth for greedy runs."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(reference_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory: ``tiny_llama(vocab_size=32, seed=0, num_layers=2, std=0.2, max_positions=256, eos=None)``."""
    return make_llama


@pytest.fixture(scope="session")
def tiny_target():
    """Factory returning a fresh ``TargetModel`` around a new tiny Llama (same arguments as tiny_llama)."""

    def factory(vocab_size: int = 32, seed: int = 0, num_layers: int = 2, **kwargs) -> TargetModel:
        return TargetModel(make_llama(vocab_size, seed, num_layers, **kwargs))

    return factory


@pytest.fixture(scope="session")
def ref_logits():
    return reference_logits


@pytest.fixture(scope="session")
def ref_greedy():
    return reference_greedy


def greedy_as_ar(target: TargetModel, drafter, prompts, max_new_tokens: int,
                 reference: TargetModel | None = None) -> int:
    """Assert that ``drafter`` decodes every prompt on ``target`` (greedy) exactly as AR does on ``reference``
    (default: ``target`` itself); returns how many draft tokens were accepted, for a caller to check the
    comparison was not vacuous."""
    from drafters.ar import AutoregressiveDrafter
    from specviz.core.engine import run

    accepted = 0
    for prompt in prompts:
        want = run(reference or target, AutoregressiveDrafter(), prompt, max_new_tokens, stop_on_eos=False).output_ids
        result = run(target, drafter, prompt, max_new_tokens, stop_on_eos=False)
        assert result.output_ids == want, f"{prompt}: not AR's output"
        accepted += sum(r.accepted for r in result.records)
    return accepted


def chi2_pvalue(counts: dict, expected: dict) -> float:
    """Pearson chi-square of observed cell counts against exact cell probabilities.

    Cells with expected count < 5 are pooled; a sample the target can never produce gives 0.
    """
    n = sum(counts.values())
    if any(expected.get(cell, 0.0) <= 0 for cell in counts):
        return 0.0
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for cell, prob in expected.items():
        if prob * n < 5:
            pool_o, pool_e = pool_o + counts.get(cell, 0), pool_e + prob * n
        else:
            obs.append(counts.get(cell, 0))
            exp.append(prob * n)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = [e * n / sum(exp) for e in exp]  # absorb float rounding of the exact probabilities
    return float(stats.chisquare(obs, exp).pvalue)


def tiny_training_data(target: TargetModel, n: int, seed: int, answer_tokens: int, batch: int, longest: int = 8):
    """``n`` random prompts of 3 to ``longest - 1`` tokens with ``target``'s greedy continuations (``batch`` at a
    time), as the features a drafter trains on."""
    from drafters.training.distill import self_distill
    from drafters.training.features import extract_features

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, target.vocab_size, (int(torch.randint(3, longest, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(n)]
    answers = self_distill(target, prompts, answer_tokens, batch)
    return extract_features(target, [(torch.tensor(p + a), len(p)) for p, a in zip(prompts, answers)])


def train_tiny_drafter(target: TargetModel, method: str, folder: Path, epochs: int = 3, seed: int = 0,
                       prompts: int = 60) -> Path:
    """Train ``method`` (or a variant, ``drafters.variants``) for ``target`` through the real pipeline on its own
    greedy continuations of ``prompts`` random prompts (a few seconds), save the checkpoint in ``folder`` and
    return it. A test that only needs a checkpoint that loads and decodes (not one that drafts well) asks for
    few prompts."""
    from accelerate.state import AcceleratorState

    from drafters.training.config import TrainConfig
    from drafters.training.loop import train
    from drafters.variants import trained_class

    vocab = target.vocab_size
    data = tiny_training_data(target, prompts, seed, 24, 16, longest=10)
    cfg = TrainConfig(epochs=epochs, batch_tokens=256, lr=3e-3, draft_vocab=max(2, vocab * 3 // 4), seed=seed,
                      device=str(target.device))  # a target on a GPU trains its drafter there
    # accelerate keeps one device per process; this one trains on the CPU and on a GPU (found on a lent H200)
    AcceleratorState._reset_state(reset_partial_state=True)
    train(trained_class(method), target, data, data, cfg, {"source": "random prompts, self-distilled"}, out=folder)
    return folder


_TRAINED: dict = {}  # "root": the session's folder; (target's fingerprint, method, epochs, seed, prompts) -> folder


def target_fingerprint(target: TargetModel) -> str:
    """What a tiny checkpoint trained for ``target`` depends on: its config, weights, kernels, dtype and EOS."""
    digest = hashlib.sha1(json.dumps([target.model.config.to_json_string(), getattr(target, "kernels", None),
                                      str(target.dtype), sorted(target.text.eos_token_ids)], default=str).encode())
    for name, tensor in target.model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().float().numpy().tobytes())
    return digest.hexdigest()


def session_checkpoint(target: TargetModel, method: str, epochs: int = 3, seed: int = 0, prompts: int = 60) -> Path:
    """``train_tiny_drafter``'s checkpoint for ``target``, trained once per test run and shared by every module
    that asks for the same (target weights, method, epochs, seed). Read-only: copy it before editing it."""
    key = (target_fingerprint(target), method, epochs, seed, prompts)
    if key not in _TRAINED:
        root = _TRAINED.get("root") or Path(tempfile.mkdtemp(prefix="specviz-checkpoints-"))
        folder = root / f"{method}-{epochs}-{seed}-{prompts}-{key[0][:12]}"
        done = folder.with_suffix(".done")
        root.mkdir(parents=True, exist_ok=True)
        with run_lock(folder):  # another worker may be training the same one (the training is deterministic)
            if not done.exists():
                train_tiny_drafter(target, method, folder, epochs, seed, prompts)
                done.touch()
        _TRAINED[key] = folder
    return _TRAINED[key]


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """Factory: ``tiny_checkpoint(target, method, epochs=3, seed=0, prompts=60)``, the session's shared
    checkpoint folder."""
    return session_checkpoint


@pytest.fixture(scope="module")
def app_state(tiny_target_dir):
    """The web app's state on the tiny app target, untuned, in fp32: one per test module."""
    from specviz.apps.web.state import load_state

    return load_state(str(tiny_target_dir), "float32", "cpu", tune="off")


@pytest.fixture(scope="module")
def app_handlers(app_state):
    """``app_state``'s handlers, as the page binds them."""
    from specviz.apps.web.handlers import Handlers
    from specviz.apps.web.plan import setting_specs

    return Handlers(app_state, setting_specs(app_state))


def drafts_on_after_its_graph_breaks(drafter, graph: str, target: TargetModel, ref_greedy, monkeypatch) -> None:
    """``drafter``'s compiled ``graph`` (an attribute of its ``capture``) raises as a graph that cannot be replayed:
    the decode on ``target`` still gives the target's own output, the graph was tried once, the drafter drafted on
    eagerly (drafts accepted) and said why. The shared capture is restored after the test (``monkeypatch``)."""
    capture, calls = drafter.capture, []
    for name in ("ready", "error", graph):
        monkeypatch.setattr(capture, name, getattr(capture, name))

    def broken(*args):
        calls.append(1)
        raise RuntimeError("the graph could not be replayed")

    monkeypatch.setattr(capture, graph, broken)
    prompt = [2, 9, 4, 4, 1, 30, 17, 8, 8, 21, 5] * 2
    with pytest.warns(UserWarning, match="failed while drafting: RuntimeError"):
        result = run(target, drafter, prompt, 30, stop_on_eos=False)
    assert result.output_ids == ref_greedy(target.model, prompt, 30)
    assert calls == [1] and not capture.ready and sum(r.accepted for r in result.records) > 0
