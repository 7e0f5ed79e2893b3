"""Commands run side by side: at most ``jobs`` at once, each with its log and its share of the cores, failures
named, and a plain ``kill`` of the runner stopping every command it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from specviz.apps import side_by_side
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
