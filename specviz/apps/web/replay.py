"""A finished race as one self-contained HTML page that replays it offline, step by step (``export``'s JSON inside).

No network, no library: the race's JSON sits in the page, and a few lines of script rebuild each method's
column one speculation step at a time (accepted drafts green, the target's own token amber, with its step,
depth and whether it was a bonus or a correction on hover). Play, pause, a speed, and "show all" for the end.
Token texts are set as text, never as markup, so a prompt or a token cannot inject anything.
"""

from __future__ import annotations

import html
import json
import tempfile
from pathlib import Path

from .. import render

SCRIPT = """
const race = JSON.parse(document.getElementById("race").textContent);
const labels = Object.keys(race.methods);
const steps = Math.max(...labels.map(m => race.methods[m].steps.length));
let shown = 0, timer = null;
const columns = {};
for (const m of labels) {
  const col = document.createElement("div"); col.className = "sv-column"; col.id = "replay-" + m;
  const head = document.createElement("div"); head.className = "sv-head"; head.textContent = m;
  const tokens = document.createElement("div"); tokens.className = "sv-tokens";
  col.append(head, tokens); document.getElementById("columns").append(col); columns[m] = {head, tokens, n: 0};
}
function show(upto) {
  for (const m of labels) {
    const c = columns[m], run = race.methods[m];
    for (; c.n < Math.min(upto, run.steps.length); c.n++) {
      const s = run.steps[c.n];
      s.texts.forEach((text, i) => {
        const span = document.createElement("span");
        const own = i >= s.accepted;
        span.className = own ? "sv-bonus" : "sv-acc";
        span.title = `step ${s.step} · ` + (own ? (s.corrected ? "the target's correction" : "the target's bonus token")
                                                 : `accepted draft, depth ${i + 1}`);
        span.textContent = text; c.tokens.append(span);
      });
    }
    const tokens = run.steps.slice(0, c.n).reduce((n, s) => n + s.tokens.length, 0);
    c.head.textContent = `${m} · ${tokens} tokens in ${c.n} steps` + (c.n ? ` · τ ${(tokens / c.n).toFixed(2)}` : "");
  }
  shown = upto; document.getElementById("step").textContent = `step ${Math.min(shown, steps)} of ${steps}`;
}
function play() {
  if (timer) { clearInterval(timer); timer = null; return; }
  timer = setInterval(() => { if (shown >= steps) { clearInterval(timer); timer = null; } else show(shown + 1); },
                      Number(document.getElementById("speed").value));
}
document.getElementById("play").onclick = play;
document.getElementById("show-all").onclick = () => show(steps);
show(0);
"""


def replay_html(race: dict) -> str:
    """The page for ``race`` (``export.race_dict``)."""
    data = json.dumps(race, ensure_ascii=False).replace("</", "<\\/")  # the JSON cannot close its script tag
    sampling = race.get("sampling") or {}
    how = "greedy" if not sampling.get("temperature") else (f"sampled at temperature {sampling['temperature']}, "
                                                             f"seed {sampling.get('seed')}")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>specviz race replay</title>"
            "<style>body { font-family: sans-serif; margin: 2em; } #columns { display: grid; "
            f"grid-template-columns: repeat(auto-fill, minmax(300px, 1fr)); gap: 1em; }} {render.CSS}</style>"
            "</head><body>"
            f"<h1>specviz: a race, replayed</h1><p>Prompt: <code>{html.escape(race.get('prompt', ''))}</code> · {how}. "
            f"{render.LEGEND}</p><p><button id='play'>play / pause</button> <select id='speed'>"
            "<option value='600'>slow</option><option value='250' selected>normal</option>"
            "<option value='60'>fast</option></select> <button id='show-all'>show all</button> <span id='step'></span>"
            f"</p><div id='columns'></div><script type='application/json' id='race'>{data}</script>"
            f"<script>{SCRIPT}</script></body></html>")


def replay_file(race: dict) -> Path:
    path = Path(tempfile.mkdtemp(prefix="specviz-replay-")) / "race-replay.html"
    path.write_text(replay_html(race))
    return path
