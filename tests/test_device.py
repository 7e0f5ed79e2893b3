"""Device handling, as far as a CPU can check it: every method decodes with the target on an emulated
CUDA device (``fake_device.FakeCuda``: CPU tensors, CUDA's rules about mixing devices) and gives the
same tokens as on the CPU, greedy and sampled with a seed."""

from __future__ import annotations

import pytest
import torch
from fake_device import DeviceMix, FakeCuda
from test_engine import GREEDY_BUILDERS, PROMPTS, VOCAB, RandomTreeDrafter, noisy_copy

import drafters
from conftest import make_llama, session_checkpoint
from drafters.sps import AssistantDrafter, AssistantSettings
from specviz.core.cache import for_model
from specviz.core.engine import DISPLAY, generate, output_ids, run
from specviz.core.load import prepare
from specviz.core.target import TargetModel
from specviz.core.verify import Sampling

# Two prompts, greedy and sampled, run every line of drafters/ and specviz/core/ that three cases (24, 30 and 20
# tokens) ran, and see every count of accepted drafts they saw, for every method (traced when the third was
# dropped: it added none). A shorter first case loses prompt lookup's only sampled drafts (rejection sampling),
# a shorter second ReDrafter's wholly accepted beam. The emulation runs each op through Python: tokens count.
CASES = list(zip(PROMPTS[:2], (24, 30)))


@pytest.fixture
def fake_cuda(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: synced.append(1))
    mode = FakeCuda()
    mode.synced = synced
    return mode


def build(method: str, target, fake: FakeCuda | None = None):
    if method == "sps":  # an assistant given as a model sits where the user put it: on the device here
        model = noisy_copy(target.model, 0.03, 1)
        return AssistantDrafter(target, AssistantSettings(num_tokens=3), model=fake.place(model) if fake else model)
    return GREEDY_BUILDERS[method](target)


def test_the_emulation_is_as_strict_as_cuda(fake_cuda):
    host_index = torch.tensor([0, 2])
    with fake_cuda:
        x = torch.arange(6.0, device="cuda")
        assert x.device.type == "cuda" and x.cpu().device.type == "cpu" and (x * 2).device.type == "cuda"
        assert x[host_index].device.type == "cuda"  # a CPU index into a device tensor is fine
        assert (x + torch.tensor(1.0)).device.type == "cuda"  # so is a 0-dim CPU scalar
        with pytest.raises(DeviceMix):
            x + torch.ones(6)
        with pytest.raises(DeviceMix):
            torch.ones(6)[x.long() % 6]
        with pytest.raises(DeviceMix):
            torch.cat([x, torch.ones(2)])
        with pytest.raises(DeviceMix):
            torch.multinomial(x.softmax(0), 1, generator=torch.Generator().manual_seed(0))
        moved = torch.nn.Linear(6, 2).to(x.device)
        assert moved.weight.device.type == "cuda" and moved(x).device.type == "cuda"
        with pytest.raises(DeviceMix):
            torch.nn.Linear(6, 2)(x)


@pytest.fixture(scope="module")
def target():
    return TargetModel(make_llama(VOCAB, seed=0, num_layers=4))


@pytest.fixture(scope="module")
def greedy_on_the_cpu(target) -> list[list[int]]:
    """AR's greedy tokens on the CPU for each case: in fp32 they are every method's greedy tokens on the CPU
    (``test_engine.test_every_method_is_lossless_greedy``, on this target with these builders), so one AR run
    per case is the CPU reference of every method's greedy decode on the device."""
    ar = build("ar", target)
    return [run(target, ar, p, n, stop_on_eos=False).output_ids for p, n in CASES]


@pytest.mark.parametrize("method", sorted(drafters.METHODS))
def test_every_method_decodes_on_a_gpu_as_on_the_cpu(method, target, greedy_on_the_cpu, fake_cuda):
    sampled = Sampling(temperature=1.0, seed=7)
    on_cpu = build(method, target)  # sampled tokens depend on the drafts: each method's own CPU run
    want = [run(target, on_cpu, p, n, sampled, stop_on_eos=False).output_ids for p, n in CASES]
    with fake_cuda:
        fake_cuda.place(target.model)
        assert target.device.type == "cuda"
        drafter = build(method, target, fake_cuda)
        for (p, n), greedy, sample in zip(CASES, greedy_on_the_cpu, want):
            assert run(target, drafter, p, n, stop_on_eos=False).output_ids == greedy
            assert run(target, drafter, p, n, sampled, stop_on_eos=False).output_ids == sample
    assert fake_cuda.synced  # the phase timers waited for the device


MERGED_BEAMS = {"redrafter", "semi-lstm"}  # their builders draft several beams, merged by prefix on the host


@pytest.mark.parametrize("method", sorted(drafters.METHODS))
def test_a_greedy_step_reads_the_device_once(method, target, greedy_on_the_cpu, fake_cuda):
    """On a GPU each read of a device tensor waits for the device's queue. A greedy step's tree stays on the
    device through the verify and the host reads it once, with the target's argmax and what the display shows
    (the same figures as on the CPU): one read a step. Beams merged by prefix are read before the verify too (the
    merged tree's size depends on the tokens): two."""
    on_cpu = run(target, build(method, target), *CASES[0], stop_on_eos=False, observers=DISPLAY).records
    with fake_cuda:
        fake_cuda.place(target.model)
        steps = generate(target, build(method, target, fake_cuda), *CASES[0], stop_on_eos=False, observers=DISPLAY)
        reads, records = [], []
        for _ in range(len(on_cpu)):
            before = fake_cuda.reads
            records.append(next(steps))
            reads.append(fake_cuda.reads - before)
    assert [t for r in records for t in r.tokens] == greedy_on_the_cpu[0]
    beams = method in MERGED_BEAMS
    assert reads == [1 + (beams and r.step > 0 and len(r.tree) > 0) for r in records]
    assert any(len(r.tree) for r in records[1:]) or method == "ar"
    for mine, cpu in zip(records, on_cpu):
        assert mine.shown and not cpu.shown and mine.path == cpu.path
        assert mine.margins == pytest.approx(cpu.margins, rel=1e-5, abs=1e-6)
        assert mine.bonus_target_p == pytest.approx(cpu.bonus_target_p, rel=1e-5, abs=1e-7)
        torch.testing.assert_close(mine.node_target_p, cpu.node_target_p)


def test_training_data_is_made_on_a_gpu_as_on_the_cpu(target, fake_cuda):
    """Self-distillation (batched, grouped attention) and feature extraction, the first jobs a lent GPU gets."""
    from drafters.training.distill import self_distill
    from drafters.training.features import LayerTaps, extract_features

    prompts = [p[:6] for p in PROMPTS[:5]]
    answers = self_distill(target, prompts, 12, 3)
    seqs = [(torch.tensor(p + a), len(p)) for p, a in zip(prompts, answers)]
    features = extract_features(target, seqs, batch_tokens=32)
    tokens = torch.stack([s[:16] for s, _ in seqs if s.numel() >= 16] or [seqs[0][0][:4]])
    taps = LayerTaps(target, (1, 2))(tokens, torch.zeros(*tokens.shape, 0))
    with fake_cuda:
        fake_cuda.place(target.model)
        assert self_distill(target, prompts, 12, 3) == answers
        on_gpu = extract_features(target, seqs, batch_tokens=32)
        gpu_taps = LayerTaps(target, (1, 2))(tokens.to("cuda"), torch.zeros(*tokens.shape, 0, device="cuda"))
        assert gpu_taps.device.type == "cuda"
    assert torch.equal(on_gpu.features, features.features) and torch.equal(on_gpu.tokens, features.tokens)
    assert torch.equal(gpu_taps.cpu(), taps)


real_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on a lent one)")


@real_gpu
@pytest.mark.parametrize("method", sorted(drafters.METHODS))
def test_every_method_decodes_on_a_real_gpu_as_on_the_cpu(method, target):
    """On real CUDA kernels: greedy fp32 output equals the CPU's, and sampling runs to length on the device
    (a CUDA generator draws other numbers than a CPU one, so sampled tokens are compared to nothing)."""
    want = [run(target, build(method, target), p, n, stop_on_eos=False).output_ids for p, n in CASES]
    gpu = TargetModel(prepare(make_llama(VOCAB, seed=0, num_layers=4).to("cuda")))  # as load_target prepares it
    drafter = build(method, gpu)
    for (p, n), greedy in zip(CASES, want):
        assert run(gpu, drafter, p, n, stop_on_eos=False).output_ids == greedy
        sampled = run(gpu, drafter, p, n, Sampling(temperature=1.0, seed=7), stop_on_eos=False).output_ids
        assert len(sampled) == len(greedy)


@real_gpu
@pytest.mark.parametrize("method", ["ar", "pld", "eagle2", "medusa", "skip"])
def test_a_greedy_step_syncs_once_on_a_real_gpu(method, target, greedy_on_the_cpu):
    """What ``test_a_greedy_step_reads_the_device_once`` counts on the emulation, on CUDA: torch's sync debug mode
    warns at every synchronizing operation it knows (a copy to the host, ``.item()``, ``nonzero``), and a greedy
    step, the display on, sets off one (the phase timers' events, read once a step, are counted apart)."""
    import warnings

    gpu = TargetModel(prepare(make_llama(VOCAB, seed=0, num_layers=4).to("cuda")))
    steps = generate(gpu, build(method, gpu), *CASES[0], stop_on_eos=False, observers=DISPLAY)
    syncs, records = [], []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while True:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                record = next(steps, None)
            if record is None:
                break
            records.append(record)
            syncs.append([f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
                          and not w.filename.endswith("timing.py")])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [t for r in records for t in r.tokens] == greedy_on_the_cpu[0]
    assert all(len(s) <= 1 for s in syncs[1:]), syncs


@real_gpu
def test_cuda_graphs_decode_as_the_eager_gpu_path(greedy_on_the_cpu):
    """The compiled target on a GPU replays CUDA graphs over the whole buffer: greedy fp32 output of AR, a chain and
    random trees equals the CPU's, also where a decode outgrows its buffer (new addresses: graphs recorded anew).
    Prepared as users get it: grouped-query attention over the whole buffer without per-head copies."""
    gpu = TargetModel(prepare(make_llama(VOCAB, seed=0, num_layers=4).to("cuda")))
    status = gpu.use_engine("compiled")
    assert gpu.captured.graphs and "CUDA graphs" in status.detail, status
    for (p, n), greedy in zip(CASES, greedy_on_the_cpu):
        for drafter in (build("ar", gpu), build("pld", gpu), RandomTreeDrafter(p, greedy, seed=3)):
            assert run(gpu, drafter, p, n, stop_on_eos=False).output_ids == greedy
        small = for_model(gpu.config, 8, static=True, shared=True)  # grows twice during the decode
        records = generate(gpu, RandomTreeDrafter(p, greedy, seed=4), p, n, stop_on_eos=False, cache=small)
        assert [t for r in records for t in r.tokens] == greedy
        assert small.capacity > 8


@real_gpu
@pytest.mark.parametrize("method", ["eagle2", "fspad"])
def test_captured_drafters_replay_as_cuda_graphs_and_stay_exact(method, target, greedy_on_the_cpu):
    """A feature drafter on a compiled GPU target compiles its network step and head as CUDA graphs over its own
    whole buffer (a static cache): its drafts went through them and greedy fp32 output equals the CPU's."""
    checkpoint = str(session_checkpoint(target, method))
    gpu = TargetModel(make_llama(VOCAB, seed=0, num_layers=4).to("cuda"))
    gpu.use_engine("compiled")
    drafter = drafters.build_drafter(method, gpu, checkpoint=checkpoint, depth=3, top_k=3, total_tokens=8)
    assert drafter.capture is not None and drafter.capture.graphs and drafter.capture.ready, drafter.capture
    for (p, n), greedy in zip(CASES, greedy_on_the_cpu):
        assert run(gpu, drafter, p, n, stop_on_eos=False).output_ids == greedy
    assert drafter.capture.calls > 0


def test_host_tensors_go_to_the_device_through_pinned_copies(fake_cuda):
    """``to_device``: a host tensor bound for a GPU is copied (pinned, queued), so changing it at once changes
    nothing on the device; on the host it stays the very tensor."""
    from specviz.core.transfer import to_device

    x = torch.arange(4)
    assert to_device(x, "cpu") is x
    with fake_cuda:
        moved = to_device(x, "cuda")
        x += 10
        assert moved.device.type == "cuda" and moved.cpu().tolist() == [0, 1, 2, 3]
        assert to_device(moved, "cuda") is moved


def test_the_host_reads_many_device_tensors_in_one_copy_bit_for_bit(fake_cuda):
    """``to_host``: device tensors of any dtype and shape come back as they were, every bit (NaN and -0.0 too),
    in one read; host tensors among them are the very tensors; nothing on the device, nothing read."""
    from specviz.core.transfer import to_host

    host = [torch.tensor([[1, -2], [3, 2**40]]), torch.tensor([float("nan"), -0.0, 1e-30, -3.5]),
            torch.tensor([True, False]), torch.randn(3).bfloat16(), torch.randn(2, 2).half(), torch.zeros(0)]
    with fake_cuda:
        assert all(a is b for a, b in zip(to_host(host), host)) and fake_cuda.reads == 0
        back = to_host([t.to("cuda") for t in host] + [host[0]])
        assert fake_cuda.reads == 1 and back[-1] is host[0]
    for mine, want in zip(back, host):
        assert mine.device.type == "cpu" and mine.dtype == want.dtype and mine.shape == want.shape
        assert torch.equal(mine.view(torch.uint8) if mine.is_floating_point() else mine,
                           want.view(torch.uint8) if want.is_floating_point() else want)


@pytest.mark.parametrize("method, settings", [("ar", {}), ("pld", {}),
                                              ("eagle2", dict(depth=3, top_k=3, total_tokens=8)),
                                              ("redrafter", dict(width=3, length=3)),
                                              ("redrafter", dict(width=3, length=3, tree_attention=0))],
                         ids=["ar", "pld", "eagle2", "redrafter", "redrafter-apart"])
def test_batches_decode_on_a_gpu_as_on_the_cpu(method, settings, target, fake_cuda):
    """Batch size > 1 on the device (what a lent GPU's batch sweep runs): every sequence's greedy output equals its
    own decode on the CPU, with a lane finishing early and the next prompt joining, and no tensor on the wrong side.
    A batch step reads the device once (every lane's tree and argmax), as a joining lane's prefill does; merged
    beams once more, every lane's beams together."""
    from specviz.core.batch import run_batch

    checkpoint = {} if method in ("ar", "pld") else {"checkpoint": str(session_checkpoint(target, method))}
    texts, limits = [PROMPTS[0], PROMPTS[1], PROMPTS[0] + PROMPTS[1]], [12, 4, 10]
    on_cpu = drafters.build_drafter(method, target, **checkpoint, **settings)
    alone = [run(target, on_cpu, p, n, stop_on_eos=False).output_ids for p, n in zip(texts, limits)]
    gpu = TargetModel(make_llama(VOCAB, seed=0, num_layers=4))
    with fake_cuda:
        fake_cuda.place(gpu.model)
        drafter = drafters.build_drafter(method, gpu, **checkpoint, **settings)
        records = run_batch(gpu, drafter, texts, limits, batch_size=2, stop_on_eos=False)
    assert [output_ids(r) for r in records] == alone
    steps = {id(r.timings) for lane in records for r in lane if r.step}  # a batch step's lanes share its timings
    merges = len({id(r.timings) for lane in records for r in lane if r.step and len(r.tree)}) if \
        "width" in settings and settings.get("tree_attention", 1) else 0  # steps with a beam search
    assert len(steps) > 2 and fake_cuda.reads == len(texts) + len(steps) + merges


@real_gpu
@pytest.mark.parametrize("method, settings", [("ar", {}), ("pld", {}), ("redrafter", dict(width=3, length=3))],
                         ids=["ar", "pld", "redrafter"])
def test_batches_replay_cuda_graphs_and_decode_as_on_the_cpu(method, settings, target):
    """A batch on a compiled GPU target takes the whole-buffer form (rows and entries padded to buckets) replayed as
    CUDA graphs: every sequence equals its own CPU decode, with a lane ending early and another joining, on
    graphs recorded by ``warm_batches`` and again on a second run (the pool's buffers, the same addresses)."""
    from test_capture_batch import counting_compiled_calls

    from specviz.core.batch import batch_capacity, run_batch

    checkpoint = {} if method in ("ar", "pld") else {"checkpoint": str(session_checkpoint(target, method))}
    texts, limits = [PROMPTS[0], PROMPTS[1], PROMPTS[0] + PROMPTS[1]], [12, 4, 10]
    on_cpu = drafters.build_drafter(method, target, **checkpoint, **settings)
    alone = [run(target, on_cpu, p, n, stop_on_eos=False).output_ids for p, n in zip(texts, limits)]
    gpu = TargetModel(prepare(make_llama(VOCAB, seed=0, num_layers=4).to("cuda")))
    gpu.use_engine("compiled")
    gpu.warm_batches(2, batch_capacity(texts, limits))
    assert gpu.captured.graphs and gpu.engine.path == "compiled", gpu.engine
    drafter = drafters.build_drafter(method, gpu, **checkpoint, **settings)
    calls = counting_compiled_calls(gpu)
    for _ in range(2):
        records = run_batch(gpu, drafter, texts, limits, batch_size=2, stop_on_eos=False)
        assert [output_ids(r) for r in records] == alone
    assert max(calls) == 2 and gpu.engine.path == "compiled", gpu.engine


@real_gpu
def test_phase_times_on_a_gpu_come_from_events_and_add_up(greedy_on_the_cpu):
    """On CUDA a step's phases are timed by events read once a step: every step's verify took time, drafting took
    time where there was a draft, and no step's phases add up to more than the run's wall time."""
    gpu = TargetModel(make_llama(VOCAB, seed=0, num_layers=4).to("cuda"))
    (p, n), greedy = CASES[1], greedy_on_the_cpu[1]
    result = run(gpu, build("pld", gpu), p, n, stop_on_eos=False)
    assert result.output_ids == greedy
    assert all(r.timings.verify > 0 for r in result.records)
    assert all(r.timings.draft > 0 for r in result.records if len(r.tree))
    assert 0 < sum(r.timings.total for r in result.records) <= result.wall_s


def test_event_timed_phases_are_read_once_a_step(monkeypatch):
    """The CUDA timer's bookkeeping, with events on a made-up clock: phases queue their events without waiting,
    the first read of the timings waits once (for the last event) and charges each phase its span, and phases
    timed after a read are charged at the next."""
    from specviz.core.timing import PhaseTimer

    clock, waits = [0.0], []

    class Event:
        def __init__(self, enable_timing: bool):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = clock[0]

        def synchronize(self):
            waits.append(self)

        def elapsed_time(self, end) -> float:  # milliseconds, as CUDA's
            return 1000 * (end.at - self.at)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = PhaseTimer("cuda:0")
    for phase, span in (("draft", 0.25), ("verify", 0.5), ("draft", 0.125)):
        with timer(phase):
            clock[0] += span
        clock[0] += 1.0  # between phases: charged to none
    assert waits == []
    timings = timer.timings
    assert len(waits) == 1 and (timings.draft, timings.verify, timings.accept) == (0.375, 0.5, 0.0)
    with timer("accept"):
        clock[0] += 0.0625
    assert timer.timings.accept == 0.0625 and timer.timings is timings and len(waits) == 2
