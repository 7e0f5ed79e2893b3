"""A bench killed with SIGKILL (no handler runs, a line may be cut mid-write) at three points, resumed each time,
ends with the unbroken run's results: every field but the clocks, equal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from app_harness import ROOT

CLOCKS = {"latency_ms", "speedup", "tokens_per_s", "wall_s"}  # the bench's timed fields, by exact name


def without_clocks(value):
    """``value`` with every timing field dropped (they differ between any two runs)."""
    if isinstance(value, dict):
        return {k: without_clocks(v) for k, v in value.items() if k not in CLOCKS}
    if isinstance(value, list):
        return [without_clocks(v) for v in value]
    return value


def lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def test_a_bench_killed_three_times_resumes_to_the_unbroken_result(tiny_target_dir, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"turns": [f"Count to {i}, slowly."]}) for i in range(4)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECVIZ_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}

    def command(out: Path, *extra: str) -> list[str]:
        return ["bench", "--target", str(tiny_target_dir), "--dtype", "float32", "--questions", str(questions),
                "--methods", "ar,pld:preset=fixed", "--max-new-tokens", "12", "--out", str(out), *extra]

    def bench(out: Path, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "specviz", *command(out, *extra)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    out = tmp_path / "killed.json"
    log = out.with_name(out.name + ".runs")
    # the log holds its settings line, then one line per finished prompt: kill with 0, 1 and 2 prompts logged
    for kill_at, extra in ((1, ()), (2, ("--resume",)), (3, ("--resume",))):
        proc = bench(out, *extra)
        deadline = time.time() + 300
        while lines(log) < kill_at and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # killed before it ended
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert lines(log) >= kill_at
    finished = bench(out, "--resume")
    assert finished.wait(300) == 0, finished.stderr.read().decode()[-2000:]
    from specviz.apps.cli import main  # the unbroken run in this process: the same command, no kill

    assert main(command(tmp_path / "unbroken.json")) == 0
    resumed, whole = (json.loads(p.read_text()) for p in (out, tmp_path / "unbroken.json"))
    assert not resumed["interrupted"] and len(resumed["per_prompt"]) == 4 and not log.exists()
    assert without_clocks(resumed["per_prompt"]) == without_clocks(whole["per_prompt"])
    assert without_clocks(resumed["methods"]) == without_clocks(whole["methods"])
