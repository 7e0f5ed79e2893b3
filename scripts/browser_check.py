"""Drive a running app in headless Debian chromium with Python playwright.

    python scripts/browser_check.py URL [--methods ar,pld] [--prompt TEXT] [--max-new-tokens N] [--screenshot PATH]

It loads the page, picks the methods, sets the token limit, presses Run, waits for every column to
finish, opens the tree view, and prints one JSON line: what it saw and the seconds from Run to the
first token on screen and to the last. A script, not a test, so playwright's own event loop never
meets pytest's (tests/test_browser.py runs it in a subprocess).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter

from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


# In-page times (ms) of the Run click, the first token span in the DOM, and every column done.
CLOCK = """([first, done]) => {
    const clock = window.svClock = {};
    document.querySelector('#run').addEventListener(
        'click', () => { clock.click = performance.now(); }, {capture: true});
    new MutationObserver(() => {
        if (clock.click && !clock.first && document.querySelector(first)) clock.first = performance.now();
        if (clock.first && !clock.done && eval(done)) clock.done = performance.now();
    }).observe(document.body, {childList: true, subtree: true});
}"""


# Per column: its box, its header's lines, and how many of its token spans leave it; and every overlapping pair.
LAYOUT = """(methods) => {
    const boxes = {}, result = {overlaps: [], escaped: {}, head_lines: {}};
    for (const m of methods) {
        const col = document.querySelector('#col-' + m.toLowerCase().replace(/[^a-z0-9]+/g, '-').replace(/^-|-$/g, ''));
        const r = col.getBoundingClientRect();
        boxes[m] = r;
        const head = col.querySelector('.sv-head');
        const line = parseFloat(getComputedStyle(head).lineHeight) || 20;
        result.head_lines[m] = Math.round(head.getBoundingClientRect().height / line);
        result.escaped[m] = [...col.querySelectorAll('.sv-tokens span')].filter(s => [...s.getClientRects()].some(
            b => b.left < r.left - 1 || b.right > r.right + 1 || b.top < r.top - 1 || b.bottom > r.bottom + 1)).length;
    }
    for (let i = 0; i < methods.length; i++) for (let j = i + 1; j < methods.length; j++) {
        const a = boxes[methods[i]], b = boxes[methods[j]];
        if (a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1)
            result.overlaps.push([methods[i], methods[j]]);
    }
    result.widths = Object.fromEntries(methods.map(m => [m, Math.round(boxes[m].width)]));
    return result;
}"""


def chromium_cpu_s() -> float:
    """CPU seconds used so far by every chromium process (browser, renderer, GPU, utilities)."""
    import psutil

    total = 0.0
    for proc in psutil.process_iter(["name"]):
        try:
            if "chrom" in (proc.info["name"] or ""):
                total += sum(proc.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def col(label: str) -> str:
    """The selector of ``label``'s column: ``eagle2 (paper)`` is ``#col-eagle2-paper`` (the app's ``column_id``)."""
    return "#col-" + re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def pick_methods(page, methods: list[str]) -> None:
    box = page.get_by_label("Methods")
    for _ in range(20):  # remove the default picks
        remove = page.locator("#methods .token-remove, #methods [aria-label^='Remove']")
        if not remove.count():
            break
        remove.first.click()
    for m in methods:
        box.click()
        box.fill(m)
        page.get_by_role("option", name=m, exact=True).click()
    page.keyboard.press("Escape")


def set_slider(page, elem_id: str, value: int) -> None:
    number = page.locator(f"#{elem_id} input[type=number]")
    number.fill(str(value))
    number.press("Enter")


# the step number the step-through view shows (-1 while it shows none)
SHOWN_STEP = "(() => { const m = document.querySelector('#step-info').innerText.match(/· step (\\d+)/);" \
             " return m ? +m[1] : -1; })()"


def go_to_most_accepted_step(page, method: str, timeout: float) -> str:
    """Walk the step-through view with the arrow keys to the step whose accepted drafts (counted from the
    method's column, whose spans carry their step) are the most."""
    titles = page.locator(f"{col(method)} .sv-acc").evaluate_all("spans => spans.map(s => s.title)")
    counts = Counter(int(re.match(r"step (\d+)", t)[1]) for t in titles)
    goal = max(counts, key=lambda step: (counts[step], -step)) if counts else 1
    for _ in range(500):
        if (step := page.evaluate(SHOWN_STEP)) == goal:
            break
        page.keyboard.press("ArrowRight" if step < goal else "ArrowLeft")
        page.wait_for_function(f"{SHOWN_STEP} !== {step}", timeout=timeout)
    return page.locator("#step-info").inner_text().split("\n")[0]


def take_shots(page, folder: str, method: str, timeout: float, widths=(1280, 390)) -> dict:
    """race-W.png at each window width W: the prompt to the plots (to the columns on a phone, where they stack);
    step.png: the step-through view at its most accepted step."""
    from pathlib import Path

    Path(folder).mkdir(parents=True, exist_ok=True)

    def region(top: str, bottom: str, path: str) -> None:
        a, b = page.locator(top).first.bounding_box(), page.locator(bottom).first.bounding_box()
        y = a["y"] + page.evaluate("window.scrollY")
        height = b["y"] + b["height"] - a["y"]
        page.screenshot(path=path, full_page=True, clip={"x": 0, "y": y - 8, "width": page.viewport_size["width"],
                                                          "height": height + 16})

    for width in widths:
        page.set_viewport_size({"width": width, "height": 1900})
        page.wait_for_timeout(800)  # the columns and plots reflow
        region("#run", "#plot-latency" if width >= 800 else "#race-columns", f"{folder}/race-{width}.png")
    page.set_viewport_size({"width": 1500, "height": 1900})
    page.wait_for_timeout(800)
    shown = ""
    if method:
        page.locator("#tree-method input").click()
        page.get_by_role("option", name=method, exact=True).click()
        page.wait_for_function(f"document.querySelector('#step-info')?.innerText.includes('{method} · step')",
                               timeout=timeout)
        page.locator("h1").first.click()
        shown = go_to_most_accepted_step(page, method, timeout)
        page.wait_for_timeout(1500)  # the tree figure redraws after the text
        region("#tree-method", "#step-info", f"{folder}/step.png")
    return {"race": [f"{folder}/race-{width}.png" for width in widths], "step": shown}


def check_controls(page, method: str, methods: list[str], timeout: float) -> dict:
    """The presets move a slider; the typical rule shows as lossy; Stop ends a long run with a note."""
    size = f"#set-{method}-total_tokens input[type=number]"  # the paper's 60 is never a tuned size
    page.get_by_text(f"{method} settings", exact=True).click()  # open its accordion
    page.wait_for_selector(size, timeout=timeout)
    before = page.locator(size).input_value()
    page.locator("#preset-paper").click()
    page.wait_for_function(f"document.querySelector('{size}').value === '60'", timeout=timeout)
    paper = page.locator(size).input_value()
    page.locator("#preset-fastest").click()
    page.wait_for_function(f"document.querySelector('{size}').value === '{before}'", timeout=timeout)
    page.locator("#rule input").click()
    page.get_by_role("option", name="typical acceptance (LOSSY)").click()
    set_slider(page, "max-new", 6)
    page.locator("#run").click()
    page.wait_for_function(f"document.querySelector('{col(methods[-1])} .sv-head')?.innerText.includes('lossy')",
                           timeout=timeout)
    lossy = page.locator(f"{col(methods[-1])} .sv-head").inner_text()
    page.wait_for_function("document.querySelector('#message')?.innerText.includes('lossy')", timeout=timeout)
    page.locator("#rule input").click()
    page.get_by_role("option", name="auto: greedy at T=0, else rejection sampling (lossless)").click()
    set_slider(page, "max-new", 512)
    page.locator("#run").click()
    page.wait_for_function(f"document.querySelector('{col(methods[0])} .sv-head[data-done=\"0\"]')",
                           timeout=timeout)  # the long run has started
    page.locator("#stop").click()
    page.wait_for_function("document.querySelector('#message')?.innerText.includes('Stopped:')", timeout=timeout)
    return {"total_tokens": [before, paper], "lossy_head": lossy, "stopped": page.locator("#message").inner_text()}


def replay(path: str) -> None:
    """Open a downloaded replay page offline, show all steps, and print each column's tokens as JSON."""
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        context = browser.new_context(offline=True)
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"file://{path}", wait_until="load")
        page.locator("#show-all").click()
        texts = page.evaluate("Object.fromEntries([...document.querySelectorAll('#columns .sv-column')].map(c => "
                              "[c.id.replace('replay-', ''), [...c.querySelectorAll('.sv-tokens span')]"
                              ".map(s => s.textContent)]))")
        heads = page.evaluate("[...document.querySelectorAll('#columns .sv-head')].map(h => h.textContent)")
        print(json.dumps({"tokens": texts, "heads": heads, "step": page.locator("#step").inner_text(),
                          "errors": errors}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url", help="the app's address, or a downloaded replay page (a .html file) to check offline")
    p.add_argument("--methods", default="ar,pld")
    p.add_argument("--prompt", default="Write a haiku about speculative decoding.")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--screenshot", default=None)
    p.add_argument("--tree", default=None, help="show this method's draft tree before the screenshot")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--cpu", action="store_true", help="also report chromium's CPU seconds from Run to done")
    p.add_argument("--layout-widths", default="", help="window widths at which to check the columns' layout")
    p.add_argument("--step-through", default="", help="methods to walk in the step-through view (arrow keys)")
    p.add_argument("--preset", choices=("paper", "fastest"), default=None, help="click this preset before Run")
    p.add_argument("--shots", default=None, help="folder for the README's pictures: race-1280.png and race-390.png "
                   "(the columns and plots at a laptop's and a phone's width) and step.png (the first --step-through "
                   "method at a step that accepted the most drafts)")
    p.add_argument("--controls", default="", help="a method with a paper preset: also check the presets, the "
                                                  "rule selector and Stop")
    args = p.parse_args()
    if args.url.endswith(".html"):
        return replay(args.url)
    methods = args.methods.split(",")
    timeout = args.timeout * 1000
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1900})
        page.goto(args.url, wait_until="load")
        page.wait_for_timeout(1500)  # settled, as when a person clicks Run (the queue keeps the network busy)
        page.get_by_label("Prompt").fill(args.prompt)
        pick_methods(page, methods)
        set_slider(page, "max-new", args.max_new_tokens)
        if args.preset:
            page.locator(f"#preset-{args.preset}").click()
            page.wait_for_timeout(1000)
        columns = ", ".join(f"{col(m)} .sv-tokens span" for m in methods)
        done = " && ".join(f"document.querySelector('{col(m)} .sv-head[data-done=\"1\"]')" for m in methods)
        page.evaluate(CLOCK, [columns, done])
        cpu_before = chromium_cpu_s() if args.cpu else 0.0
        page.set_viewport_size({"width": 1500, "height": 700})  # a laptop's fold: the columns start below it
        page.evaluate("window.scrollTo(0, 0)")
        columns_top = "document.querySelector('#race-columns').getBoundingClientRect().top"
        below_fold = page.evaluate(f"{columns_top} > window.innerHeight / 2")
        page.locator("#run").click()
        page.wait_for_function("document.querySelector('#run').disabled", polling=50, timeout=timeout)
        try:
            page.wait_for_function(f"{columns_top} >= -1 && {columns_top} < window.innerHeight / 2", timeout=timeout)
        except PlaywrightTimeout:
            geometry = page.evaluate(f"({{top: {columns_top}, scrollY: window.scrollY, height: window.innerHeight, "
                                     "page: document.documentElement.scrollHeight}})")
            sys.exit(f"Run did not bring the columns to the top half of the window: {geometry}")
        # polled every 100 ms, not every frame: that keeps the page drawing
        page.wait_for_function("window.svClock.done", polling=100, timeout=timeout)
        page.wait_for_function("!document.querySelector('#run').disabled", polling=100, timeout=timeout)
        page.set_viewport_size({"width": 1500, "height": 1900})
        cpu_s = chromium_cpu_s() - cpu_before if args.cpu else None
        clock = page.evaluate("window.svClock")
        first_token_s, done_s = (clock["first"] - clock["click"]) / 1000, (clock["done"] - clock["click"]) / 1000
        for pid in ("plot-alpha", "plot-length", "plot-latency", "plot-tree"):
            page.wait_for_selector(f"#{pid} .js-plotly-plot .main-svg", state="attached", timeout=timeout)
        if args.tree:
            page.locator("#tree-method input").click()
            page.get_by_role("option", name=args.tree, exact=True).click()
            page.wait_for_function("[...document.querySelectorAll('#plot-tree .gtitle')]"
                                   f".some(t => t.textContent.startsWith('{args.tree}'))",
                                   timeout=timeout)
        seen = {
            "first_token_s": first_token_s,
            "done_s": done_s,
            "browser_cpu_s": cpu_s,
            "heads": {m: page.locator(f"{col(m)} .sv-head").inner_text() for m in methods},
            "spans": {m: {kind: page.locator(f"{col(m)} .sv-{kind}").count() for kind in ("acc", "bonus", "rej")}
                      for m in methods},
            "hover": page.locator(f"{col(methods[0])} .sv-tokens span").first.get_attribute("title"),
            "plots": {pid: page.locator(f"#{pid} .js-plotly-plot .main-svg").count() > 0
                      for pid in ("plot-alpha", "plot-length", "plot-latency", "plot-tree")},
            "plot_titles": [t.text_content() for t in page.locator(".js-plotly-plot .gtitle").all()],
            "message": page.locator("#message").inner_text(),
            "columns_were_below_the_fold": below_fold,  # then Run scrolled them up (waited for above)
        }
        seen["steps"] = {}
        for m in [m for m in args.step_through.split(",") if m]:
            page.locator("#tree-method input").click()
            page.get_by_role("option", name=m, exact=True).click()
            page.wait_for_function(f"document.querySelector('#step-info')?.innerText.includes('{m} · step')",
                                   timeout=timeout)
            first = page.locator("#step-info").inner_text()
            page.locator("h1").first.click()  # focus off the inputs: the arrow keys walk the steps
            step = page.evaluate(SHOWN_STEP)
            for attempt in range(5):  # a key pressed while the view still updates can be dropped: press again
                page.keyboard.press("ArrowRight")
                try:  # the step number, not the text: the text also changes while the view updates
                    page.wait_for_function(f"{SHOWN_STEP} > {step}", timeout=timeout / 5)
                    break
                except PlaywrightTimeout:
                    if attempt == 4:
                        raise
            seen["steps"][m] = [first, page.locator("#step-info").inner_text()]
        if args.shots:
            seen["shots"] = take_shots(page, args.shots, args.step_through.split(",")[0], timeout)
        if args.controls:
            seen["controls"] = check_controls(page, args.controls, methods, timeout)
        seen["layout"] = {}
        for width in [int(w) for w in args.layout_widths.split(",") if w]:
            page.set_viewport_size({"width": width, "height": 1900})
            page.wait_for_timeout(400)
            seen["layout"][width] = page.evaluate(LAYOUT, methods)
            if args.screenshot:
                page.screenshot(path=args.screenshot.replace(".png", f"-{width}.png"), full_page=True)
        if args.screenshot:
            page.screenshot(path=args.screenshot, full_page=True)
        browser.close()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
