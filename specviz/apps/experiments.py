"""The papers' own evidence, one experiment each: which arms it compares, trained at which budget.

An experiment is a list of arms. An arm with ``train`` is a trained method or a training variant
(``drafters.variants``) trained first at the experiment's budget, so every trained arm of it saw the same data,
epochs and settings, and is then benched from that checkpoint; an arm without ``train`` benches a shipped
drafter as its spec says. Every arm is benched beside AR on the same prompts in one process
(``experiment_run``); the trained arms also report their held-out agreement per depth from training.

Budgets: ``shared`` is the shipped drafters' own (every ShareGPT first turn, 4 epochs, bf16: minutes an arm on
a GPU, hours on a 2-core CPU, resumed across sessions with ``--train-only``);
``small`` is what a 2-core CPU trains within a session (the 1,000 shipped prompts, 2 epochs); ``medium`` (500
prompts, 2 epochs) and ``mini`` (200 prompts, 1 epoch, a quick end-to-end check) are for joint training on a
CPU, whose every step runs the target backwards. An experiment's arms share one budget, and its results file
names it: figures at ``small`` compare arms with each other, not with the papers' absolute numbers. Where the
arms' checkpoints come from (shipped, cached, trained, carried from a GPU): ``experiment_train``.
"""

from __future__ import annotations

from dataclasses import dataclass

from specviz.core.errors import SettingsError


@dataclass(frozen=True)
class Budget:
    name: str
    samples: str  # ShareGPT prompts ("all" or a number)
    prompts: str  # "first" or "all" (every chunk's first human turn)
    max_prompt_tokens: int
    epochs: int
    dtype: str  # the self-distillation and feature dtype (and "bf16" autocast in training where it is bfloat16)
    note: str
    answer_tokens: int = 256  # the longest self-distilled answer
    shipped_bases: bool = False  # an arm training a shipped method benches the shipped checkpoint (its budget)

    def as_dict(self) -> dict:
        return {"name": self.name, "samples": self.samples, "prompts": self.prompts,
                "max_prompt_tokens": self.max_prompt_tokens, "epochs": self.epochs, "dtype": self.dtype}


BUDGETS = {b.name: b for b in (
    Budget("shared", "all", "all", 512, 4, "bfloat16", "the shipped drafters' budget (minutes an arm on a "
           "GPU, hours on a 2-core CPU: --train-only resumes)",
           shipped_bases=True),
    Budget("small", "1000", "first", 256, 2, "float32", "1,000 prompts, 2 epochs: what a 2-core CPU trains"),
    Budget("medium", "500", "first", 256, 2, "float32", "500 prompts, 2 epochs: joint training within a CPU "
                                                        "session"),
    Budget("mini", "200", "first", 256, 1, "float32", "200 prompts, 1 epoch: joint training (through the target) "
                                                      "on a 2-core CPU"),
)}


@dataclass(frozen=True)
class Arm:
    label: str
    spec: str  # the method spec benched (a trained arm's checkpoint is added to it)
    train: str | None = None  # a trained method or variant, trained at the budget first
    x: float | None = None  # the arm's value on the experiment's axis (beta, passes, K, width), where it has one
    lam: float | None = None  # trained jointly with a LoRA on the target at this lambda (benched on that target)


@dataclass(frozen=True)
class Experiment:
    name: str
    paper: str
    reproduces: str  # the paper's table or figure
    question: str  # what the experiment asks, in one sentence
    arms: tuple[Arm, ...]
    axis: str = ""  # what ``Arm.x`` is
    temperatures: tuple[float, ...] = (0.0,)
    domain: str = ""  # train on this slice's own answers (not self-distilled) and bench on its held-out prompts

    @property
    def trains(self) -> list[str]:
        return list(dict.fromkeys(a.train for a in self.arms if a.train and a.lam is None))

    @property
    def joint(self) -> dict[float, list[str]]:
        """lambda -> the methods trained jointly at it."""
        out: dict[float, list[str]] = {}
        for a in self.arms:
            if a.train and a.lam is not None and a.train not in out.setdefault(a.lam, []):
                out[a.lam].append(a.train)
        return out

    @property
    def trained_runs(self) -> list[tuple[str, float | None]]:
        """(method or variant, joint lambda or None) of each training run: the separate ones, then the joint ones."""
        return [(n, None) for n in self.trains] + [(n, lam) for lam, ns in self.joint.items() for n in ns]


EAGLE_TREE = ":preset=paper"  # every tree arm at its paper's tree (EAGLE-2's: depth 6, top_k 10, 60 nodes)
HASS_BASE = Arm("EAGLE-2", "eagle2" + EAGLE_TREE, "eagle2")


def _hass(label: str, train: str, x: float | None = None) -> Arm:
    return Arm(label, "hass" + EAGLE_TREE, train, x)


def _beams() -> tuple[Arm, ...]:
    return tuple(Arm(f"width {w}, length {n}", f"redrafter:width={w}:length={n}", None, w)
                 for n in (2, 4) for w in (1, 2, 4, 8))


TRAINED_SHIPPED = ("eagle2", "hass", "fspad", "eagle3", "medusa", "redrafter", "semi-attn", "semi-lstm", "sps")

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (
    Experiment("hass-beta", "HASS", "Table 5, Fig. 6",
               "Does down-weighting the later aligned passes (beta < 1) help, and at which depth?",
               (HASS_BASE, _hass("HASS beta 1", "hass", 1.0), _hass("HASS beta 0.5", "hass-beta0.5", 0.5),
                _hass("HASS beta 0.25", "hass-beta0.25", 0.25)), "beta"),
    Experiment("hass-passes", "HASS", "Table 4",
               "How many aligned passes does harmonized context alignment need?",
               (HASS_BASE, *(_hass(f"HASS {n} pass{'es' * (n > 1)}", "hass" if n == 3 else f"hass-passes{n}", n)
                             for n in (1, 2, 3, 4, 5))), "aligned passes"),
    Experiment("hass-topk", "HASS", "Fig. 4, Table 7",
               "What do the Top-K distillation term's K and weight w add?",
               (_hass("HASS no Top-K", "hass-topk0", 0), _hass("HASS K 1", "hass-topk1", 1),
                _hass("HASS K 5", "hass-topk5", 5), _hass("HASS K 10", "hass", 10),
                _hass("HASS K 20", "hass-topk20", 20),
                _hass("HASS K 10, w 0.5", "hass-w0.5"), _hass("HASS K 10, w 2", "hass-w2")), "K"),
    Experiment("fspad-ablation", "FSPAD", "Table 3",
               "Which of FSPAD's two components, the feature sampler or partial alignment, carries its lead?",
               (Arm("FSPAD", "fspad" + EAGLE_TREE, "fspad"),
                Arm("FSPAD without sampler", "fspad" + EAGLE_TREE, "fspad-no-sampler"),
                Arm("FSPAD without PAD", "fspad" + EAGLE_TREE, "fspad-no-pad"),
                Arm("neither (EAGLE-2)", "eagle2" + EAGLE_TREE, "eagle2"),
                Arm("FSPAD, paper's sampler", "fspad" + EAGLE_TREE, "fspad-paper-sampler"))),
    Experiment("semi-hq-sweep", "semi-autoregressive drafting", "Fig. 4",
               "How much sequence model does h_q need, from none (as Hydra) to an N-layer transformer, and what "
               "does each cost in draft time?",
               (Arm("0 layers (last token, as Hydra)", "semi-attn:preset=paper", "semi-hq-last", 0),
                Arm("fixed attention (the paper's)", "semi-attn:preset=paper", "semi-attn"),
                Arm("2-layer LSTM", "semi-lstm:preset=paper", "semi-lstm"),
                Arm("1-layer transformer", "semi-attn:preset=paper", "semi-hq-tf1", 1),
                Arm("2-layer transformer", "semi-attn:preset=paper", "semi-hq-tf2", 2)), "transformer layers"),
    Experiment("semi-joint", "semi-autoregressive drafting", "§4.2, Fig. 5",
               "Does training a LoRA on the target with its drafter (lambda 0.25) raise acceptance over separate "
               "training, and what does it cost the target's quality on the domain?",
               tuple(Arm(f"{m} {how}", f"{m}:preset=paper", m, lam=lam) for m in ("semi-attn", "semi-lstm")
                     for how, lam in (("separate", None), ("joint, lambda 0.25", 0.25))), domain="code"),
    Experiment("redrafter-rnn", "ReDrafter", "Fig. 4",
               "What do the recurrent state and the depth of the ResNet head buy?",
               (Arm("ReDrafter (RNN, 2 blocks)", "redrafter:preset=paper", "redrafter"),
                Arm("no RNN (U = W = I)", "redrafter:preset=paper", "redrafter-no-rnn"),
                Arm("4 ResNet blocks", "redrafter:preset=paper", "redrafter-4blocks"))),
    Experiment("redrafter-beams", "ReDrafter", "Fig. 5a/b",
               "How do tokens per step and the compression of merged beams grow with beam width and length?",
               _beams(), "beam width"),
    Experiment("temperature", "HASS, FSPAD (the T = 1 columns)", "the T = 0 / T = 1 halves of their tables",
               "Does each trained drafter keep its lead when the target samples (lossless rejection sampling)?",
               tuple(Arm(m, f"{m}:preset=paper" if m != "sps" else "sps:preset=fixed") for m in TRAINED_SHIPPED),
               temperatures=(0.0, 0.5, 1.0)),
)}

def experiment(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise SettingsError(f"no experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]


def budget(name: str) -> Budget:
    if name not in BUDGETS:
        raise SettingsError(f"no budget {name!r}; choose from {', '.join(BUDGETS)}")
    return BUDGETS[name]
