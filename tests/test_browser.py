"""End to end in a real headless browser: Debian chromium driven by playwright, on a tiny target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app_harness import ROOT, RunningApp

CHROMIUM = Path("/usr/bin/chromium")
CHECK = ROOT / "scripts" / "browser_check.py"  # drives the page and reports what it saw, as JSON
ARTIFACTS = Path(os.environ.get("SPECVIZ_ARTIFACTS", ROOT / "artifacts"))
needs_browser = pytest.mark.skipif(
    not CHROMIUM.exists() and not os.environ.get("CI"),  # in CI a missing browser fails the test instead
    reason="needs Debian chromium (bash setup.sh --tests installs it)")


@pytest.fixture(scope="module")
def app(tiny_target_dir, tiny_checkpoint, tmp_path_factory):
    """Every method: tiny drafters trained for the tiny target, the target itself as sps's assistant."""
    pytest.importorskip("playwright")
    import shutil

    from drafters import METHODS
    from specviz.core.load import load_target

    folder, drafters = tiny_target_dir, tmp_path_factory.mktemp("drafters")
    target = load_target(str(folder), "float32", "cpu")
    for m in [m for m, (cls, _) in METHODS.items() if cls.trained]:
        shutil.copytree(tiny_checkpoint(target, m, epochs=1, prompts=8), drafters / m)
    running = RunningApp(folder, SPECVIZ_DRAFTERS=str(drafters), SPECVIZ_ASSISTANT=str(folder))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield running
    running.close()


@needs_browser
def test_page_runs_two_methods_and_renders_tokens_and_plots(app):
    done = subprocess.run([sys.executable, str(CHECK), app.url, "--methods", "ar,pld",
                           "--max-new-tokens", "40", "--screenshot", str(ARTIFACTS / "app.png")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(seen["plots"].values()), seen["plots"]
    assert seen["spans"]["ar"]["bonus"] == 40 and seen["spans"]["ar"]["acc"] == 0  # AR: every token the target's own
    assert sum(seen["spans"]["pld"].values()) >= 40
    assert seen["hover"].startswith("step 0 · depth 1 · target")
    assert "40 tokens" in seen["heads"]["pld"] and "identical to AR" in seen["heads"]["pld"]
    assert any("α_k" in t for t in seen["plot_titles"])
    assert (ARTIFACTS / "app.png").stat().st_size > 10_000
    # the script waited for Run to be disabled during the race and enabled after it, and for the columns,
    # below the fold at a laptop's height before Run, to be scrolled into view
    assert seen["columns_were_below_the_fold"]


@needs_browser
def test_every_method_in_columns_that_never_overlap(app):
    """Every method, and eagle2 once more at its paper's setting: at 1280 and 1920 px no two columns overlap and
    no token leaves its column."""
    from drafters import METHODS

    methods = [*METHODS][:3] + ["eagle2 (paper)"] + [*METHODS][3:]
    done = subprocess.run([sys.executable, str(CHECK), app.url,
                           "--methods", ",".join(methods), "--max-new-tokens", "24", "--layout-widths", "1280,1920",
                           "--step-through", "eagle2,redrafter", "--controls", "eagle2",
                           "--screenshot", str(ARTIFACTS / "app-all.png")],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(sum(seen["spans"][m].values()) >= 24 for m in methods), seen["spans"]
    heads = seen["heads"]  # the same method twice, at two settings, each exact
    assert "identical to AR" in heads["eagle2"] and "identical to AR" in heads["eagle2 (paper)"], heads
    for width, layout in seen["layout"].items():
        assert layout["overlaps"] == [], (width, layout["overlaps"])
        assert not any(layout["escaped"].values()), (width, layout["escaped"])
        assert min(layout["widths"].values()) >= 280, (width, layout["widths"])  # a readable column
        assert max(layout["head_lines"].values()) <= 3, (width, layout["head_lines"])
    for m in ("eagle2", "redrafter"):  # the step-through view, walked with the arrow key
        first, second = seen["steps"][m]
        assert f"{m} · step" in first and "Time: draft" in first and second != first, (m, first, second)
    assert "beams of" in seen["steps"]["redrafter"][0] + seen["steps"]["redrafter"][1]
    controls = seen["controls"]  # a preset switch and back, the rule selector, Stop
    assert controls["total_tokens"][1] == "60" and controls["total_tokens"][0] != "60", controls
    assert "lossy" in controls["lossy_head"] and "Stopped:" in controls["stopped"], controls


@needs_browser
def test_the_replay_page_opens_offline_and_shows_the_races_tokens(tiny_target_dir, tmp_path):
    pytest.importorskip("playwright")
    from drafters import build_drafter
    from specviz.apps.race import race
    from specviz.apps.web import export, replay
    from specviz.core.load import load_target

    target = load_target(str(tiny_target_dir), "float32", "cpu")
    prompt = target.text.encode_chat("Count to twenty: one, two, three, four")
    drafters = {m: build_drafter(m, target) for m in ("ar", "pld")}
    lanes = {lane.label: lane for lane in race(target, drafters, prompt, 30)}
    runs = {m: {"records": lane.records, "clock": lane.clock, "error": lane.error} for m, lane in lanes.items()}
    saved = export.race_dict(runs, target.text.decode(prompt), {"temperature": 0.0}, target.text.decode)
    page = replay.replay_file(saved)
    done = subprocess.run([sys.executable, str(CHECK), str(page)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["errors"] == []
    for m, method in saved["methods"].items():  # every token of every step, in order, as the race emitted them
        assert seen["tokens"][m] == [text for step in method["steps"] for text in step["texts"]], m
        assert len(seen["tokens"][m]) == 30
    steps = max(len(method["steps"]) for method in saved["methods"].values())
    assert seen["step"] == f"step {steps} of {steps}" and any("τ" in head for head in seen["heads"])
