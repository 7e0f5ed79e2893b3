"""The reliability test's cases and how each outcome is judged: malformed calls to the app's API over raw HTTP.

A case is one call to ``/gradio_api/call/<api>`` with a JSON body built here (so it can carry what
gradio_client never sends: NaN, 400-digit integers, lone surrogates, the wrong number of arguments). Its
outcome is ``served`` (a result, perhaps with clamp notes), ``message`` (an error that says what was wrong),
or a failure: ``silent`` (an error without a message), ``traceback`` (internals leaked to the caller),
``hang`` (no answer within the case's time) or ``http <code>`` (the server itself failed).
"""

from __future__ import annotations

import itertools
import json
import random
import ssl
import time
from dataclasses import asdict, dataclass, field

import httpx

GOOD = ["Count to three.", ["ar", "pld"], 4, 0.0, 1.0, None, "auto", 0, None]  # /compare's arguments, all of them
HUGE_PROMPT = "x" * 10_000_000  # 10 MB
# Each argument's bad values, as raw JSON text (json.dumps cannot write NaN as gradio reads it, nor 10**400).
BAD = {
    0: ['""', '"   "', '"<script>alert(1)</script>"', '"caf\\udce9"', 'null', '12', '[]', '{}', '"\\u0000"',
        json.dumps("a" * 70_000), json.dumps("🏁" * 5000), json.dumps("../../etc/passwd")],
    1: ['[]', 'null', '"ar"', json.dumps(["ar"] * 41), '["nonsense"]', '[1]', '[["ar"]]', '["../x"]', '{"ar": 1}',
        '["AR"]', '["eagle2"]', '["ar", "ar"]'],
    2: ['null', '"abc"', 'NaN', 'Infinity', '-Infinity', '-1', '0', "1" * 400, '1e400', '[]', 'true', '0.5'],
    3: ['null', '"hot"', 'NaN', 'Infinity', '-1', "9" * 400, '1e-42', '{}', '2.5'],
    4: ['null', '"p"', 'NaN', '-Infinity', '0', '-3', "7" * 400, '[0.5]', '1e400'],
    5: ['[]', '"x"', '5', '{"pld": []}', '{"pld": {"num_tokens": ' + "9" * 400 + '}}',
        '{"pld": {"checkpoint": "/etc/passwd"}}', '{"nonsense": {}}', '{"pld": {"num_tokens": null}}',
        '{"pld": {"num_tokens": "many"}}', '{"pld": {"dtype": "float64"}}', '{"ar": {"x": 1}}',
        '{"pld": ' * 40 + '{}' + '}' * 40, '{"skip": {"layers": -5, "num_tokens": 1e9}}'],
    6: ['"bogus"', '5', 'null', '"greedy"', '"typical"', '[]'],
    7: ['-1', '"x"', 'NaN', "9" * 400, '1e400', '[]', 'null', '3.5'],
    8: ['"float64"', '"FLOAT32"', '"bfloat16 "', '5', '[]', '{}', '"../float32"'],
}


@dataclass(frozen=True)
class Case:
    name: str
    body: str  # the request's JSON body
    api: str = "compare"


@dataclass
class Outcome:
    case: str
    kind: str  # served | message | silent | traceback | hang | http <code>
    message: str
    seconds: float

    @property
    def failed(self) -> bool:
        return self.kind not in ("served", "message")


def _body(args: list[str]) -> str:
    return '{"data": [' + ", ".join(args) + "]}"


def _good() -> list[str]:
    return [json.dumps(a) for a in GOOD]


def generated_cases(rounds: int = 1, seed: int = 0) -> list[Case]:
    """Every bad value alone in an otherwise good call, every argument count from none to one too many, then
    ``rounds`` calls with two bad arguments for every pair of argument positions (a covering design: each pair
    of positions meets, which random pairs do not promise), the two bad values drawn at random (seeded)."""
    cases = []
    for position, values in BAD.items():
        for i, value in enumerate(values):
            args = _good()
            args[position] = value
            cases.append(Case(f"arg{position}-bad{i}", _body(args)))
    for count in range(len(GOOD) + 2):
        args = (_good() + ['"extra"'])[:count]
        cases.append(Case(f"{count}-arguments", _body(args)))
    rng = random.Random(seed)
    for r in range(rounds):
        for first, second in itertools.combinations(sorted(BAD), 2):
            args = _good()
            args[first], args[second] = rng.choice(BAD[first]), rng.choice(BAD[second])
            cases.append(Case(f"pair{r}-arg{first}-arg{second}", _body(args)))
    return cases


def huge_case(i: int = 0) -> Case:
    args = _good()
    args[0] = json.dumps(HUGE_PROMPT)
    return Case(f"10MB-prompt-{i}", _body(args))


def _judge(event: str, data: str) -> tuple[str, str]:
    if event == "complete":
        return "served", ""
    try:
        payload = json.loads(data)
    except json.JSONDecodeError:
        payload = data
    message = payload.get("error") if isinstance(payload, dict) else payload
    message = "" if message is None else str(message)
    if "Traceback" in message or 'File "' in message:
        return "traceback", message
    return ("message", message) if message.strip() else ("silent", data)


# One TLS context for every call: httpx builds a new one per client by default (it reads the CA bundle, about
# 60 ms), which would make the callers, not the app, the bottleneck of a burst.
_TLS = ssl.create_default_context()


def call(base: str, case: Case, timeout: float = 120) -> Outcome:
    """Send ``case`` on a connection of its own and read its event stream to the end (``base``: the app's URL)."""
    start = time.perf_counter()
    url = f"{base.rstrip('/')}/gradio_api/call/{case.api}"
    try:
        with httpx.Client(timeout=timeout, verify=_TLS) as http:
            posted = http.post(url, content=case.body.encode("utf-8", "surrogatepass"),
                               headers={"Content-Type": "application/json"})
            if posted.status_code != 200:
                kind = "message" if posted.status_code < 500 and posted.text.strip() else f"http {posted.status_code}"
                return Outcome(case.name, kind, posted.text[:300], time.perf_counter() - start)
            event_id = posted.json()["event_id"]
            event, data = "", ""
            with http.stream("GET", f"{url}/{event_id}") as stream:
                for line in stream.iter_lines():
                    if line.startswith("event:"):
                        event = line.split(":", 1)[1].strip()
                    elif line.startswith("data:"):
                        data = line.split(":", 1)[1].strip()
                        if event in ("complete", "error"):
                            break
            kind, message = _judge(event, data) if event else ("silent", "the stream ended without an event")
            return Outcome(case.name, kind, message[:300], time.perf_counter() - start)
    except httpx.TimeoutException:
        return Outcome(case.name, "hang", f"no answer in {timeout:.0f} s", time.perf_counter() - start)


@dataclass
class Summary:
    """What the results file reports: cases tried, failures by kind, the worst waits."""
    cases: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)
    max_good_first_token_s: float = 0.0  # a well-behaved caller's first token while others abuse
    huge_prompt_refused_s: float = 0.0  # the slowest refusal of a 10 MB prompt, as the caller saw it
    extra: dict = field(default_factory=dict)

    def add(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            self.cases += 1
            self.outcomes[o.kind] = self.outcomes.get(o.kind, 0) + 1
            if o.failed:
                self.failures.append(asdict(o))

    def as_dict(self) -> dict:
        return asdict(self)
