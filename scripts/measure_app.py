"""Measure the app on the embedded target (a benchmark, not a test): cold start, first token, UI overhead.

    python3 scripts/measure_app.py [--runs 4] [--max-new-tokens 128] [--dtype float32] [--split-cores] [--out FILE]

Starts ``python app.py``, then for each run and method: the CLI's ``generate``, ``/compare`` and a
streamed ``/race`` through gradio_client, and the page in headless chromium (scripts/browser_check.py),
with the CPU chromium used meanwhile. Then, as a control, the CLI again beside a busy loop that takes
as much CPU as chromium did: what sharing the cores alone costs, with no app in the way.
Prints one JSON line per measurement and a summary: medians and their ratio to the CLI.

With ``--split-cores`` the server and the CLI get core 0 and one torch thread, and this script, its
client and chromium get core 1: a one-core server whose page is drawn elsewhere, as on a Space.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from datetime import date
from pathlib import Path

from gradio_client import Client

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test harness starts the app
from app_harness import ROOT, free_port  # noqa: E402
from specviz.apps.machine import machine_fingerprint  # noqa: E402
from specviz.apps.web.handlers import SHOW_EVERY_S  # noqa: E402
from specviz.apps.web.views import PLOT_EVERY_S  # noqa: E402

PROMPT = "Explain in a short paragraph why the sky is blue."


def tokens_in(column: str) -> int:
    return int(re.search(r"· (\d+) / \d+ tokens", column).group(1))  # the header's "n / max tokens"


# where the app and the CLI run (see --split-cores); no background tuning: it would share the server's core with
# the runs measured, and the CLI and the page then race the same (fixed) settings
SERVER = {"env": {**os.environ, "SPECVIZ_TUNE": "off"}, "cores": None}


def on_server_cores() -> None:
    if SERVER["cores"]:
        os.sched_setaffinity(0, SERVER["cores"])


def cli(method: str, n: int) -> float:
    """The CLI at the settings and the precision the app runs with tuning off (``SERVER``'s env): the methods'
    fixed defaults, in the app's dtype (the CLI's own default, auto, is bf16 on a CPU with AMX or AVX-512 BF16)."""
    spec = method if method == "ar" else f"{method}:preset=fixed"
    out = subprocess.run([sys.executable, "-m", "specviz", "generate", "--method", spec, "--max-new-tokens", str(n),
                          "--prompt", PROMPT, "--color", "never", "--dtype", SERVER["env"]["SPECVIZ_DTYPE"]],
                         capture_output=True, text=True, cwd=ROOT,
                         env=SERVER["env"], preexec_fn=on_server_cores).stdout
    return float(re.search(r"tokens in [\d.]+ s = ([\d.]+) tok/s", out).group(1))


def compare(client: Client, method: str, n: int) -> float:
    start = time.perf_counter()
    out = client.predict(PROMPT, [method], n, api_name="/compare")
    return out["methods"][method]["metrics"]["new_tokens"] / (time.perf_counter() - start)


def race(client: Client, method: str, n: int) -> tuple[float, float]:
    start = time.perf_counter()
    job = client.submit(PROMPT, [method], n, 0.0, 1.0, True, api_name="/race")
    while len(job.outputs()) < 2 and not job.done():  # the start, then the first tokens
        time.sleep(0.005)
    first = time.perf_counter() - start
    final = job.result()
    wall = time.perf_counter() - start
    column = next(x for x in final if isinstance(x, str) and f"<b>{method}</b>" in x)
    return tokens_in(column) / wall, first


def browser(url: str, method: str, n: int) -> tuple[float, float, float]:
    """Tokens/s on the page, the first token's delay, and the cores chromium kept busy from Run to done."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "browser_check.py"), url, "--methods", method,
                          "--max-new-tokens", str(n), "--prompt", PROMPT, "--cpu"], capture_output=True, text=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    return (tokens_in(seen["heads"][method]) / seen["done_s"], seen["first_token_s"],
            seen["browser_cpu_s"] / seen["done_s"])


@contextmanager
def busy(cores: float):
    """A process that keeps ``cores`` of one core busy (spinning that share of every 10 ms)."""
    loop = (f"import time\nwhile True:\n    t = time.perf_counter()\n"
            f"    while time.perf_counter() - t < {0.01 * cores}: pass\n"
            f"    time.sleep({0.01 * (1 - cores)})")
    proc = subprocess.Popen([sys.executable, "-c", loop])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="ar,eagle2")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the app's and the CLI's precision (default: float32, the page's own default)")
    p.add_argument("--out", help="also write the measurements and their medians here (assets/bench/app_vs_cli_*.json)")
    p.add_argument("--split-cores", action="store_true", help="server and CLI on core 0 (1 thread), the rest on core 1")
    args = p.parse_args()
    SERVER["env"]["SPECVIZ_DTYPE"] = args.dtype
    if args.split_cores:
        SERVER.update(env={**SERVER["env"], "OMP_NUM_THREADS": "1"}, cores={0})
        os.sched_setaffinity(0, {1})  # this script, its client and chromium
    port = free_port()
    env = {**SERVER["env"], "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False",
           "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    app = subprocess.Popen([sys.executable, str(ROOT / "app.py")], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.STDOUT, preexec_fn=on_server_cores)
    url = f"http://127.0.0.1:{port}/"
    rows = []

    def note(**row) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    try:
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                time.sleep(0.1)
        note(how="cold start", seconds=round(time.perf_counter() - start, 2))
        client = Client(url, verbose=False)
        for _ in range(args.runs):
            for m in args.methods.split(","):
                n = args.max_new_tokens
                note(how="cli", method=m, tok_s=cli(m, n))
                note(how="/compare", method=m, tok_s=round(compare(client, m, n), 2))
                rate, first = race(client, m, n)
                note(how="/race", method=m, tok_s=round(rate, 2), first_update_s=round(first, 3))
                rate, first, cores = browser(url, m, n)
                note(how="browser", method=m, tok_s=round(rate, 2), first_token_s=round(first, 3),
                     chromium_cores=round(cores, 3))
    finally:
        app.terminate()
        app.wait()
    cores = statistics.median(r["chromium_cores"] for r in rows if r["how"] == "browser")
    print(f"chromium kept {cores:.2f} cores busy during a run (median)")
    if not args.split_cores:  # the control: sharing the cores alone, no app
        with busy(min(cores, 0.95)):
            for _ in range(args.runs):
                for m in args.methods.split(","):
                    note(how="cli beside busy", method=m, tok_s=cli(m, args.max_new_tokens), busy_cores=round(cores, 3))
    summary = medians(rows, args.methods.split(","), args.split_cores)
    for key, v in summary.items():
        print(f"{key:24} median {v['tok_s']:6.1f} tok/s  {v['x_cli']:.2f}x CLI")
    firsts = sorted(r["first_token_s"] for r in rows if r["how"] == "browser")
    print(f"first token on screen: {firsts[0]:.2f}-{firsts[-1]:.2f} s, "
          f"{sum(f < 1 for f in firsts)} of {len(firsts)} under 1 s")
    if args.out:  # the layout `python -m specviz report` reads into docs/results.md
        where = ("server and CLI on core 0 with one torch thread, the script, client and chromium on core 1"
                 if args.split_cores else "everything on every core")
        Path(args.out).write_text(json.dumps({
            "command": "python3 scripts/measure_app.py " + " ".join(sys.argv[1:]), "date": str(date.today()),
            "machine": f"{machine_fingerprint()}; {where}",
            "dtype": args.dtype + (" (the app's default)" if args.dtype == "float32" else ""),
            "settings": ("SPECVIZ_TUNE=off; the CLI at preset=fixed (the same settings); the page redrawn at most "
                         f"every {SHOW_EVERY_S:g} s, its plots every {PLOT_EVERY_S:g} s"),
            "max_new_tokens": args.max_new_tokens, "summary": summary,
            "first_token_on_screen_s": [firsts[0], firsts[-1]], "chromium_cores_median": cores,
            "measurements": rows}, indent=1) + "\n")


def medians(rows: list[dict], methods: list[str], split_cores: bool) -> dict[str, dict]:
    """"METHOD WAY" -> the median tok/s through that way and its ratio to the CLI's median."""
    out = {}
    for m in methods:
        base = statistics.median(r["tok_s"] for r in rows if r["how"] == "cli" and r.get("method") == m)
        for how in ("cli", "/compare", "/race", "browser") + (() if split_cores else ("cli beside busy",)):
            v = statistics.median(r["tok_s"] for r in rows if r["how"] == how and r.get("method") == m)
            out[f"{m} {how}"] = {"tok_s": round(v, 2), "x_cli": round(v / base, 3)}
    return out


if __name__ == "__main__":
    main()
