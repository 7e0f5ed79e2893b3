"""Commands run side by side: at most ``jobs`` at once, each with its log and its share of the cores, failures
named, a plain ``kill`` of the runner stopping every command it started, and only as many at once as memory holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from specviz.apps import side_by_side
from specviz.apps.memory_gate import MemoryGate
from specviz.apps.side_by_side import child_env, run_side_by_side

TIMED = "import json, sys, time; s = time.time(); time.sleep(0.4); print(json.dumps([s, time.time()])); sys.exit({})"


def test_each_process_gets_its_share_of_the_cores_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(side_by_side, "usable_cores", lambda: 8)
    assert child_env("cpu", 3)["OMP_NUM_THREADS"] == "2"
    assert child_env("cpu", 16)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in child_env("cuda", 2)  # a GPU's runs use the CPU only to feed it
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert child_env("cpu", 2)["OMP_NUM_THREADS"] == "5"


def test_at_most_jobs_run_at_once_each_logs_and_failures_are_named(tmp_path):
    codes = {"a": 0, "b": 3, "c": 0, "d": 0, "e": 1}
    commands = {name: [sys.executable, "-c", TIMED.format(code)] for name, code in codes.items()}
    logs = {name: tmp_path / f"{name}.log" for name in codes}
    logs["a"].write_text("earlier\n")  # appended to, not replaced: a resumed run keeps its history
    failed = run_side_by_side(commands, logs, jobs=2, device="cpu", poll_s=0.05)
    assert sorted(failed) == ["b", "e"]
    assert logs["a"].read_text().startswith("earlier\n")
    spans = [json.loads(logs[n].read_text().splitlines()[-1]) for n in codes]
    most = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert most == 2  # two at once, never three


def test_a_sigterm_to_the_runner_stops_the_commands_it_started(tmp_path):
    child = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    runner = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from specviz.apps.side_by_side import run_side_by_side
        out = Path({str(tmp_path)!r})
        cmds = {{n: [sys.executable, "-c", {child!r}, str(out / f"{{n}}.pid")] for n in "abc"}}
        run_side_by_side(cmds, {{n: out / f"{{n}}.log" for n in "abc"}}, 2, "cpu", 0.05)
    """)
    proc = subprocess.Popen([sys.executable, "-c", runner])
    pids = [tmp_path / "a.pid", tmp_path / "b.pid"]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pids):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    for pid in (int(p.read_text()) for p in pids):
        with pytest.raises(ProcessLookupError):  # stopped and reaped, not left training as orphans
            os.kill(pid, 0)
    assert not (tmp_path / "c.pid").exists()  # the queued one never started


def test_a_command_waits_until_it_is_ready_and_starts_anyway_when_nothing_else_can(tmp_path):
    marker = tmp_path / "prefix-written"
    write = f"import json, time; s = time.time(); time.sleep(0.3); open({str(marker)!r}, 'w').write('x'); " \
            "print(json.dumps([s, time.time()]))"
    commands = {"writer": [sys.executable, "-c", write], "waits": [sys.executable, "-c", TIMED.format(0)],
                "other": [sys.executable, "-c", TIMED.format(0)], "never": [sys.executable, "-c", TIMED.format(0)]}
    logs = {name: tmp_path / f"{name}.log" for name in commands}
    ready = {"waits": marker.exists, "never": lambda: False}
    assert run_side_by_side(commands, logs, jobs=2, device="cpu", poll_s=0.02, ready=ready) == []
    span = {n: json.loads(logs[n].read_text().splitlines()[-1]) for n in commands}
    assert span["waits"][0] >= span["writer"][1] - 0.05  # not before the marker was written
    assert span["other"][0] < span["writer"][1]  # the ready one took the free slot meanwhile
    assert span["never"][0] >= max(span[n][1] for n in ("writer", "waits", "other")) - 0.05  # last, alone


GIB = 2**30
HOLDS = "import json, sys, time; s = time.time(); time.sleep(0.5); print(json.dumps([s, time.time()]))"


def _held(holds: dict[str, int]):
    """A pretend machine: each command, named by its last argument, holds ``holds[name]`` bytes while it runs."""
    def resident(pid: int) -> int:
        try:
            proc = psutil.Process(pid)
            args = [] if proc.status() == psutil.STATUS_ZOMBIE else proc.cmdline()  # empty while it starts or ends
            return holds.get(args[-1], 0) if args else 0
        except psutil.Error:
            return 0

    def available(total: int = 24 * GIB) -> int:
        return total - sum(resident(p.pid) for p in psutil.Process().children())
    return resident, available


def _spans(logs: dict[str, Path]) -> dict[str, list[list[float]]]:
    return {n: [json.loads(line) for line in log.read_text().splitlines()] for n, log in logs.items()}


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_a_need_that_does_not_fit_beside_the_running_ones_waits(tmp_path):
    resident, available = _held({"big1": 12 * GIB, "big2": 12 * GIB, "small": 5 * GIB})
    gate = MemoryGate(limit=20 * GIB, reserve=GIB, expected={"big1": 12 * GIB, "big2": 12 * GIB, "small": 5 * GIB},
                      settle_s=0.1, available=available, resident=resident)
    commands = {n: [sys.executable, "-c", HOLDS, n] for n in ("big1", "big2", "small")}
    logs = {n: tmp_path / f"{n}.log" for n in commands}
    assert run_side_by_side(commands, logs, jobs=3, device="cpu", poll_s=0.02, gate=gate) == []
    (big1,), (big2,), (small,) = _spans(logs).values()
    assert not _overlap(big1, big2)  # 24 GiB together: never at once, although jobs allows three
    assert _overlap(big1, small)  # 17 GiB: the small one took the room beside the first
    assert gate.own("small") == 5 * GIB and gate.own("big2") == 12 * GIB


def test_a_command_with_no_figure_of_its_own_borrows_a_settled_ones_peak():
    resident, available = _held({})
    gate = MemoryGate(limit=20 * GIB, reserve=GIB, settle_s=10, available=available, resident=resident)
    assert gate.admits("a", [], now=0)  # nothing runs: the first always starts
    gate.started("a", now=0)
    gate.peaks["a"], gate._grew["a"] = 12 * GIB, 1.0
    assert not gate.admits("b", ["a"], now=5)  # a has not settled: its peak may still grow
    assert gate.need("b") == 12 * GIB and not gate.admits("b", ["a"], now=12)  # borrowed 12 + 12 > 20
    gate.peaks["a"] = 7 * GIB
    assert gate.admits("b", ["a"], now=12)
    gate.expected["c"] = 14 * GIB  # a figure of its own: no waiting for others to settle, only room
    assert not gate.admits("c", ["a"], now=2) and gate.admits("c", [], now=2)


def test_when_memory_runs_short_the_newest_stops_waits_and_is_not_a_failure(tmp_path, capsys):
    resident, available = _held({"first": 12 * GIB, "second": 12 * GIB})
    # each is expected (wrongly) to hold 5 GiB, so both start; together they leave 0 GiB, under the reserve
    gate = MemoryGate(limit=20 * GIB, reserve=2 * GIB, expected={"first": 5 * GIB, "second": 5 * GIB},
                      settle_s=0.1, available=available, resident=resident)
    commands = {n: [sys.executable, "-c", HOLDS, n] for n in ("first", "second")}
    logs = {n: tmp_path / f"{n}.log" for n in commands}
    assert run_side_by_side(commands, logs, jobs=2, device="cpu", poll_s=0.02, gate=gate) == []
    spans = _spans(logs)
    assert len(spans["first"]) == 1 and len(spans["second"]) == 1  # the stopped one ran again, to its end
    assert not _overlap(spans["first"][0], spans["second"][0])  # and not beside the first
    assert "second: stopped to free memory" in capsys.readouterr().out
    assert gate.expected["second"] == 12 * GIB  # its need is now a real peak
