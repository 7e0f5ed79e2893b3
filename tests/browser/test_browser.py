"""End to end in headless Debian chromium driven by Python playwright (run in its own pytest process)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

playwright = pytest.importorskip("playwright.sync_api")

from app_harness import RunningApp, tiny_target_folder  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("SPECVIZ_ARTIFACTS", Path(__file__).resolve().parents[2] / "artifacts"))


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian chromium (apt install chromium)")
def test_page_runs_two_methods_and_renders_everything(tmp_path):
    app = RunningApp(tiny_target_folder(tmp_path / "target"))
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            page.goto(app.url)
            page.get_by_label("Prompt").fill("Write a haiku about speculative decoding.")
            page.get_by_role("button", name="Run").click()
            page.wait_for_selector("#col-pld .sv-bonus", timeout=60_000)
            page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 3", timeout=60_000)
            assert page.locator("#col-ar span[title*='step']").count() > 0
            assert page.locator(".js-plotly-plot .main-svg").count() >= 3
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "app.png"), full_page=True)
            browser.close()
    finally:
        app.close()
