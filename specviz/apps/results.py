"""A bench's results as typed data: the run's facts, one summary per method, one row per prompt.

The JSON layout on disk is the one every committed file in ``assets/bench`` has, so old and new files are
one format: ``from_dict`` takes files written before a key existed (the key's default stands in), and
``to_dict`` writes every key a reader may look for. Optional figures a run did not produce (τ for
transformers' own ``generate``, a budget for a method that has none) are left out rather than written as
null, as the bench always did. Speeds compare within one run only: a merged result keeps, per method, the
number of the run it came from.
"""

from __future__ import annotations

import json
import lzma
from dataclasses import dataclass, field
from pathlib import Path

from specviz.core import files
from specviz.core.attention import NAME as GROUPED_ATTENTION
from specviz.core.errors import SettingsError


def _some(**values) -> dict:
    """The keyword arguments that are not None (optional keys a run did not produce stay out of the file)."""
    return {k: v for k, v in values.items() if v is not None}


@dataclass(frozen=True)
class RunSampling:
    temperature: float
    top_p: float
    rule: str
    lossless: bool | None = None  # files from before the rule's losslessness was recorded lack it

    @classmethod
    def from_dict(cls, d: dict) -> RunSampling:
        return cls(d["temperature"], d["top_p"], d["rule"], d.get("lossless"))

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "rule": self.rule,
                **_some(lossless=self.lossless)}


@dataclass(frozen=True)
class MethodBudget:
    """The settings a method ran at and, when the tuner chose them, what it expected of them."""

    settings: dict
    tuned: bool = False
    expected_tau: float | None = None
    expected_speedup: float | None = None
    expected_ms_per_token: dict[str, float] | None = None  # draft, verify, accept+other

    @classmethod
    def from_dict(cls, d: dict) -> MethodBudget:
        if "settings" not in d:  # the earliest run logs kept a budget as its settings alone
            return cls(dict(d))
        return cls(dict(d["settings"]), bool(d.get("tuned", False)), d.get("expected_tau"),
                   d.get("expected_speedup"), d.get("expected_ms_per_token"))

    def to_dict(self) -> dict:
        if not self.tuned:
            return {"settings": self.settings}
        return {"settings": self.settings, "tuned": True, "expected_tau": self.expected_tau,
                "expected_speedup": self.expected_speedup, "expected_ms_per_token": self.expected_ms_per_token}


@dataclass(frozen=True)
class CategorySummary:
    tau: float | None  # None for a method without step records (transformers' generate)
    speedup: float


@dataclass
class MethodSummary:
    """One method over all prompts against AR on the same prompts (``core.metrics.compare``'s figures)."""

    prompts: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    speedup: float
    identical_to_ar: int  # prompts whose output equals AR's token for token
    by_category: dict[str, CategorySummary] = field(default_factory=dict)
    extra_memory_pct: float = 0.0
    exactness: dict[str, int] | None = None  # identical / near-tie / clear, when AR's margins were known
    tau: float | None = None  # the engine's figures: None for transformers' generate
    latency_ms: dict[str, float] | None = None
    mean_tree_size: float | None = None
    mean_compression: float | None = None
    alpha_conditional: list[float] | None = None
    alpha_unconditional: list[float] | None = None
    budget: MethodBudget | None = None
    identical_to_ar_note: str | None = None
    run: int | None = None  # in merged results: which run the figures came from

    @classmethod
    def from_dict(cls, d: dict) -> MethodSummary:
        return cls(d["prompts"], d["new_tokens"], d["wall_s"], d["tokens_per_s"], d["speedup"], d["identical_to_ar"],
                   {k: CategorySummary(c.get("tau"), c["speedup"]) for k, c in d.get("by_category", {}).items()},
                   d.get("extra_memory_pct", 0.0), d.get("exactness"), d.get("tau"), d.get("latency_ms"),
                   d.get("mean_tree_size"), d.get("mean_compression"), d.get("alpha_conditional"),
                   d.get("alpha_unconditional"),
                   None if d.get("budget") is None else MethodBudget.from_dict(d["budget"]),
                   d.get("identical_to_ar_note"), d.get("run"))

    def to_dict(self) -> dict:
        engine = {} if self.tau is None else {  # mean_compression is null for methods that merge no beams
            "tau": self.tau, "latency_ms": self.latency_ms, "mean_tree_size": self.mean_tree_size,
            "mean_compression": self.mean_compression, "alpha_conditional": self.alpha_conditional,
            "alpha_unconditional": self.alpha_unconditional}
        return {"prompts": self.prompts, "new_tokens": self.new_tokens, "wall_s": self.wall_s,
                "tokens_per_s": self.tokens_per_s, "speedup": self.speedup, "identical_to_ar": self.identical_to_ar,
                **_some(exactness=self.exactness), **engine,
                "by_category": {k: {"tau": c.tau, "speedup": c.speedup} for k, c in self.by_category.items()},
                "extra_memory_pct": self.extra_memory_pct,
                **_some(budget=None if self.budget is None else self.budget.to_dict(),
                        identical_to_ar_note=self.identical_to_ar_note, run=self.run)}

    def exactness_text(self) -> str:
        """'8/8', or with near-ties and clear divergences counted apart: '5/8 (+3 near-ties, 0 clear)'."""
        text = f"{self.identical_to_ar}/{self.prompts}"
        e = self.exactness
        if e and (e["near-tie"] or e["clear"]):
            text += f" (+{e['near-tie']} near-tie{'s' * (e['near-tie'] != 1)}, {e['clear']} clear)"
        return text


@dataclass(frozen=True)
class DivergenceAt:
    """Where a method's greedy output left AR's, and whether AR's own choice there was a near-tie."""

    kind: str  # "near-tie" or "clear"
    at: int  # the first differing token
    gap: float  # AR's top-1 minus top-2 logit there


@dataclass
class MethodRow:
    """One method on one prompt."""

    new_tokens: int
    wall_s: float
    identical_to_ar: bool
    divergence: DivergenceAt | None = None
    steps: int | None = None  # target forwards after prefill (engine runs only)
    accepted_per_step: list[int] | None = None

    @classmethod
    def from_dict(cls, d: dict) -> MethodRow:
        div = d.get("divergence")
        return cls(d["new_tokens"], d["wall_s"], d["identical_to_ar"],
                   None if div is None else DivergenceAt(div["kind"], div["at"], div["gap"]),
                   d.get("steps"), d.get("accepted_per_step"))

    def to_dict(self) -> dict:
        div = self.divergence
        return {"new_tokens": self.new_tokens, "wall_s": self.wall_s, "identical_to_ar": self.identical_to_ar,
                **_some(divergence=None if div is None else {"kind": div.kind, "at": div.at, "gap": div.gap},
                        steps=self.steps, accepted_per_step=self.accepted_per_step)}


@dataclass
class PromptRow:
    id: str
    category: str
    prompt_tokens: int
    methods: dict[str, MethodRow]

    @classmethod
    def from_dict(cls, d: dict) -> PromptRow:
        return cls(d["id"], d["category"], d["prompt_tokens"],
                   {label: MethodRow.from_dict(m) for label, m in d["methods"].items()})

    def to_dict(self) -> dict:
        return {"id": self.id, "category": self.category, "prompt_tokens": self.prompt_tokens,
                "methods": {label: m.to_dict() for label, m in self.methods.items()}}


@dataclass
class BenchResult:
    """A bench run: where and how it ran, each method's summary and each prompt's row (AR always included)."""

    target: str
    device: str
    dtype: str
    max_new_tokens: int
    sampling: RunSampling
    date: str  # "2026-11-23"; merged results join their runs' dates with " + "
    machine: str  # ``machine.machine_description()``; merged results join theirs with " + "
    methods: dict[str, MethodSummary]
    per_prompt: list[PromptRow]
    interrupted: bool = False  # True while prompts are still to run (or were left when the run was killed)
    questions: str | None = None  # the question set as the command named it
    linear_kernels: str | None = None  # "packed" or "default" (older files: not recorded)
    verify_padding: dict[str, dict[str, int]] | None = None  # shape -> {size: padded size}
    cores_used: int | None = None
    merged_from: list[str] | None = None
    engine: str | None = None  # the target's forward path (``TargetModel.engine``); older files: eager
    attention: str | None = None  # the target's attention function (``core.attention``); older files: SDPA's

    @classmethod
    def from_dict(cls, d: dict) -> BenchResult:
        return cls(d["target"], d["device"], d["dtype"], d["max_new_tokens"], RunSampling.from_dict(d["sampling"]),
                   d["date"], d["machine"], {label: MethodSummary.from_dict(m) for label, m in d["methods"].items()},
                   [PromptRow.from_dict(p) for p in d["per_prompt"]], bool(d.get("interrupted", False)),
                   d.get("questions"), d.get("linear_kernels"), d.get("verify_padding"), d.get("cores_used"),
                   d.get("merged_from"), d.get("engine"), d.get("attention"))

    def to_dict(self) -> dict:
        return {"target": self.target, "device": self.device, "dtype": self.dtype,
                "max_new_tokens": self.max_new_tokens, "sampling": self.sampling.to_dict(), "date": self.date,
                "machine": self.machine,
                **_some(linear_kernels=self.linear_kernels, verify_padding=self.verify_padding,
                        cores_used=self.cores_used, engine=self.engine, attention=self.attention),
                "interrupted": self.interrupted,
                "methods": {label: m.to_dict() for label, m in self.methods.items()},
                "per_prompt": [p.to_dict() for p in self.per_prompt],
                **_some(questions=self.questions, merged_from=self.merged_from)}

    def save(self, path: Path) -> None:
        """Write as JSON, xz-compressed when ``path`` ends in ``.xz``, all or nothing (a kill mid-write leaves
        the previous version)."""
        files.atomic_write(Path(path), json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Path) -> BenchResult:
        path = Path(path)
        if not path.exists():
            raise SettingsError(f"no results file {str(path)!r}")
        try:
            return cls.from_dict(json.loads(files.read_bytes(path)))
        except (lzma.LZMAError, EOFError, ValueError) as e:
            raise SettingsError(f"{path} is not a bench results file ({e})") from None
        except (KeyError, TypeError, AttributeError) as e:
            raise SettingsError(f"{path} is not a bench results file (no {e} where one belongs)") from None

    @property
    def kernels_note(self) -> str:
        """'' on default kernels, else which kernels the engine's linear layers ran on."""
        engine = f"target forwards {self.engine} (a label's `engine=eager`: the eager path)" \
            if self.engine and not self.engine.startswith("eager") else ""
        if self.attention == GROUPED_ATTENTION:
            engine = "; ".join(filter(None, [engine, "grouped-query attention without per-head copies"]))
        if (self.linear_kernels or "default") == "default":
            return engine
        kernels = f"linear layers on {self.linear_kernels} kernels (`hf` on the default ones)"
        return f"{kernels}; {engine}" if engine else kernels


MERGE_KEYS = ("questions", "target", "max_new_tokens", "dtype", "sampling")  # what runs that merge share


def merge(runs: list[BenchResult], names: list[str]) -> BenchResult:
    """Several runs over the same prompts and settings as one (the first run's figures win for a label two runs
    share). Each method keeps the number of the run it came from (``run``): speeds compare only within one run."""
    first = runs[0]
    ids = sorted(p.id for p in first.per_prompt)
    merged = BenchResult(**{**vars(first), "methods": {},
                            "per_prompt": [PromptRow(p.id, p.category, p.prompt_tokens, dict(p.methods))
                                           for p in first.per_prompt]})
    by_id = {p.id: p for p in merged.per_prompt}
    for n, (result, name) in enumerate(zip(runs, names)):
        for key in MERGE_KEYS:
            if getattr(result, key) != getattr(first, key):
                raise SettingsError(f"{name} has another {key} ({getattr(result, key)!r}) than {names[0]} "
                                    f"({getattr(first, key)!r}): only runs of the same prompts and settings merge")
        if sorted(p.id for p in result.per_prompt) != ids:
            raise SettingsError(f"{name} ran other prompts than {names[0]}: only runs of the same prompts merge")
        for label, summary in result.methods.items():
            if label in merged.methods:
                continue
            merged.methods[label] = MethodSummary(**{**vars(summary), "run": n})
            for prompt in result.per_prompt:
                by_id[prompt.id].methods[label] = prompt.methods[label]
    if len(runs) > 1:
        merged.merged_from = list(names)
        merged.interrupted = any(r.interrupted for r in runs)
        merged.machine = " + ".join(dict.fromkeys(r.machine for r in runs))
        merged.date = " + ".join(dict.fromkeys(r.date for r in runs))
    return merged


def markdown_rows(header: list[str], rows: list[str]) -> str:
    """A Markdown table from its column names and its rows ('' when there are no rows)."""
    if not rows:
        return ""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header), *rows])


def _figures(values: list[float] | None, depth: int = 4) -> str:
    return " / ".join(f"{a:.2f}" for a in (values or [])[:depth]) or "–"


def markdown_table(result: BenchResult) -> str:
    """τ, α, speed and equality per method, in the README's format."""
    lines = []
    for label, m in result.methods.items():
        tau = "–" if m.tau is None else f"{m.tau:.2f}"
        lat = " · ".join(f"{v:.1f}" for v in m.latency_ms.values()) if m.latency_ms else "–"
        lines.append(f"| `{label}` | {tau} | {_figures(m.alpha_conditional)} | {_figures(m.alpha_unconditional)} "
                     f"| {m.tokens_per_s:.1f} | {m.speedup:.2f}× | {m.exactness_text()} | {lat} |")
    return markdown_rows(["method", "τ", "α_1..4 conditional", "α_1..4 unconditional", "tok/s", "speedup vs ar",
                          "identical to AR", "ms/token draft · verify · accept · other"], lines)


def budget_table(result: BenchResult) -> str:
    """Each tuned method's expected figures next to the measured ones ('' when none was tuned)."""
    rows = []
    for label, m in result.methods.items():
        b = m.budget
        if b is None or not b.tuned:
            continue
        settings = ", ".join(f"{k} {v}" for k, v in b.settings.items() if k != "checkpoint")
        want, got = b.expected_ms_per_token or {}, m.latency_ms or {}
        split = (" · ".join(f"{want[k]:.1f}" for k in ("draft", "verify", "accept+other")) + " / "
                 + " · ".join(f"{v:.1f}" for v in (got["draft"], got["verify"], got["accept"] + got["other"]))
                 if want and got else "–")
        tau = float("nan") if m.tau is None else m.tau
        rows.append(f"| `{label}` | {settings} | {b.expected_tau:.2f} / {tau:.2f} "
                    f"| {b.expected_speedup:.2f}× / {m.speedup:.2f}× | {split} |")
    return markdown_rows(["method", "tuned budget", "τ expected / measured", "speedup expected / measured",
                          "ms/token draft · verify · accept+other, expected / measured"], rows)
