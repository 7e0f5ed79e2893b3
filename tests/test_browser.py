"""End to end in a real headless browser: Debian chromium driven by playwright, on a tiny target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app_harness import ROOT, RunningApp, tiny_target_folder

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("SPECVIZ_ARTIFACTS", ROOT / "artifacts"))
needs_browser = pytest.mark.skipif(
    not CHROMIUM.exists() and not os.environ.get("CI"),  # in CI a missing browser fails the test instead
    reason="needs Debian chromium (bash setup.sh --tests installs it)")


@needs_browser
def test_page_runs_two_methods_and_renders_tokens_and_plots(tmp_path):
    pytest.importorskip("playwright")
    app = RunningApp(tiny_target_folder(tmp_path / "target"))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([sys.executable, str(ROOT / "tests" / "browser_check.py"), app.url, "--methods", "ar,pld",
                               "--max-new-tokens", "40", "--screenshot", str(ARTIFACTS / "app.png")],
                              capture_output=True, text=True, timeout=600)
    finally:
        app.close()
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(seen["plots"].values()), seen["plots"]
    assert seen["spans"]["ar"]["bonus"] == 40 and seen["spans"]["ar"]["acc"] == 0  # AR: every token the target's own
    assert sum(seen["spans"]["pld"].values()) >= 40
    assert seen["hover"].startswith("step 0 · depth 1 · target")
    assert "40 tokens" in seen["heads"]["pld"] and "identical to AR" in seen["heads"]["pld"]
    assert any("α_k" in t for t in seen["plot_titles"])
    assert (ARTIFACTS / "app.png").stat().st_size > 10_000
