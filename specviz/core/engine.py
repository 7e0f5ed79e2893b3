"""The decoding loop: draft -> verify -> accept -> commit, one StepRecord per target forward.

Step 0 is the prefill: the same loop with no draft, the whole prompt as what gets committed. A record
holds what the decode did; what only a display needs (the target's probability of every node, the
margin of every emitted token) is filled by observers that the caller attaches (``hover``,
``margins``: the app attaches both, benches neither, except margins on AR's runs, which classify
divergences as near-ties). Observers run after a step's timers stop: a step's timings are decoding work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import Cache

from .errors import SettingsError
from .protocol import Commit, Drafter, DraftRequest
from .target import TargetModel, VerifyPadding
from .timing import PhaseTimer, Timings
from .transfer import to_device
from .tree import DraftTree, on_host
from .verify import Decision, Sampling, accept, follows_argmax, probabilities, top_ids


@dataclass(kw_only=True)
class StepRecord:
    step: int  # 0 = prefill (no draft)
    tree: DraftTree
    path: list[int]  # accepted verify-input indices (root excluded), in depth order
    tokens: list[int]  # tokens emitted this step: accepted drafts then the bonus, cut at EOS/limit
    bonus: int
    timings: Timings = field(default_factory=Timings)
    finished: str | None = None  # "eos" | "length" on the last step
    decisions: list[Decision] = field(default_factory=list)  # as the accept rule saw them; with observers only
    # display extras, empty unless an observer filled them
    margins: list[float] = field(default_factory=list)  # per emitted token: the target's top-1 minus top-2 logit
    node_target_p: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [N] target p of each node
    bonus_target_p: float | None = None  # target p of the bonus token
    shown: bool = False  # the display extras came with the step's one read (``settle``): observers leave them

    @property
    def accepted(self) -> int:
        return len(self.path)

    @property
    def corrected(self) -> bool:
        """Whether the target's own token replaces rejected drafts (a *correction*): the last accepted node, or
        the root when nothing was accepted, has children in the tree, and the accept rule rejected them all.
        Otherwise the draft ended at that node (a leaf, or no draft at all) and the token is a *bonus*: one
        more token the same forward pays for."""
        last = self.path[-1] if self.path else 0
        return bool(len(self.tree)) and bool((self.tree.parents == last).any())


@dataclass
class Verified:
    """One step as an observer sees it: its record, the target's logits over the verify input and what was
    kept (``keep[i]``, root first, is the row that chose emitted token i)."""

    record: StepRecord
    logits: torch.Tensor  # [N+1, V]
    keep: list[int]
    sampling: Sampling


Observer = Callable[[Verified], None]


def _shown_p(seen: Verified) -> torch.Tensor:
    """On the logits' device: the target's probability of each draft token given its parent, then of the bonus."""
    r, logits = seen.record, seen.logits
    rows = torch.cat([r.tree.parents, torch.tensor([seen.keep[-1]])])
    cols = torch.cat([r.tree.tokens, torch.tensor([r.bonus])])
    # only the rows a shown token was chosen at (a tree's inner nodes): a softmax over every row of a wide tree
    # cost several per cent of its step
    need, where = torch.unique(rows, return_inverse=True)
    part = logits[to_device(need, logits.device)].float()
    probs = torch.softmax(part, dim=-1) if seen.sampling.greedy else probabilities(part, seen.sampling)
    return probs[to_device(where, logits.device), to_device(cols, logits.device)]


def _gaps(seen: Verified) -> torch.Tensor:
    """On the logits' device: the top-1 minus top-2 logit at each kept row (fp32)."""
    rows = seen.logits[to_device(torch.tensor(seen.keep), seen.logits.device)]
    if rows.shape[-1] < 2:
        return torch.full((len(seen.keep),), float("inf"), device=rows.device)
    top = rows.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).float()


def _fill_hover(seen: Verified, shown: torch.Tensor) -> None:
    seen.record.node_target_p, seen.record.bonus_target_p = shown[:-1], float(shown[-1])


def _fill_margins(seen: Verified, gaps: list[float]) -> None:
    seen.record.margins = gaps[: len(seen.record.tokens)]


def _display_rows(tree: DraftTree, logits: torch.Tensor, top: torch.Tensor, sampling: Sampling) -> list[torch.Tensor]:
    """On the logits' device, before the accept rule: what ``hover`` and ``margins`` show, for every row, so a GPU
    fetches them with the step's one read: the target's probability of each node given its parent [N], of each
    row's argmax ``top`` [N+1] (the bonus, under a rule that follows the argmax) and each row's top-1 minus top-2
    logit."""
    probs = torch.softmax(logits.float(), -1) if sampling.greedy else probabilities(logits, sampling)
    node = probs[to_device(tree.parents, logits.device), to_device(tree.tokens, logits.device)]
    best = probs.gather(-1, top[:, None])[:, 0]
    if logits.shape[-1] < 2:
        return [node, best, torch.full((logits.shape[0],), float("inf"), device=logits.device)]
    top = logits.topk(2, dim=-1).values
    return [node, best, (top[:, 0] - top[:, 1]).float()]


def hover(seen: Verified) -> None:
    """The target's probability of each draft token given its parent and of the bonus token, as hovers
    show it: the sampling distribution, or the softmax at T=1 when greedy."""
    if not seen.record.shown:
        _fill_hover(seen, _shown_p(seen).cpu())


def margins(seen: Verified) -> None:
    """Each emitted token's margin: the target's top-1 minus top-2 logit where it chose it (how close that
    choice came to a tie)."""
    if not seen.record.shown:
        _fill_margins(seen, _gaps(seen).cpu().tolist())


def display(seen: Verified) -> None:
    """``hover`` and ``margins`` together, computed on the device and fetched to the host in one copy."""
    if seen.record.shown:
        return
    shown = _shown_p(seen)
    both = torch.cat([shown.float(), _gaps(seen)]).cpu()
    _fill_hover(seen, both[: shown.numel()])
    _fill_margins(seen, both[shown.numel():].tolist())


DISPLAY: tuple[Observer, ...] = (display,)  # what the app shows


def output_ids(records: list[StepRecord]) -> list[int]:
    """Every token the records emitted, in order."""
    return [t for r in records for t in r.tokens]


def check_request(target: TargetModel, prompt_ids: list[int], max_new_tokens: int) -> None:
    if not prompt_ids:
        raise SettingsError("the prompt is empty")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SettingsError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    room = target.max_length - len(prompt_ids)
    if room < 1:
        raise SettingsError(f"the prompt has {len(prompt_ids)} tokens; the target's context is {target.max_length}")
    if max_new_tokens > room:
        raise SettingsError(
            f"max_new_tokens={max_new_tokens} does not fit: the prompt uses {len(prompt_ids)} of the "
            f"target's {target.max_length}-token context, leaving {room}"
        )


@dataclass
class Decode:
    """One sequence's decode as the loop advances it: its drafter state, generator and output so far.
    ``engine.generate`` runs one; ``batch.generate_batch`` runs several, one per row of its cache."""

    prompt: list[int]
    limit: int  # max new tokens
    state: object  # the drafter's state for this decode
    generator: torch.Generator | None
    index: int = 0  # its place among the caller's prompts
    sequence: list[int] = field(default_factory=list)  # prompt + output, the pending root last
    produced: int = 0
    step: int = 0  # 0: its prefill is next

    def __post_init__(self) -> None:
        self.sequence = self.sequence or list(self.prompt)

    def request(self, sampling: Sampling) -> DraftRequest:
        return DraftRequest(self.sequence, self.limit - self.produced - 1, sampling, self.generator)

    def propose(self, drafter: Drafter, sampling: Sampling) -> DraftTree:
        request = self.request(sampling)
        return drafter.propose(self.state, request) if request.max_depth > 0 else DraftTree.empty()


def settle(drafter: Drafter, decode: Decode, tree: DraftTree, logits: torch.Tensor, feats: torch.Tensor,
           inputs: torch.Tensor | None, commit: Callable[[list[int]], None], sampling: Sampling, eos,
           timer: PhaseTimer, explain: bool = False, top: list[int] | None = None) -> StepRecord:
    """After a verify: accept, commit the kept rows (``commit(keep)``; none at the prefill, where the whole prompt
    is committed), tell the drafter, grow the output (cut at EOS or the limit); the step's record.

    ``logits`` and ``feats`` are this decode's rows of the verify input (``inputs``, root first; None: the tree's
    own after the root, ``decode.sequence[-1]``; at the prefill the prompt's last logits and every position's
    features); ``top``: their argmax per row, where the caller read it already (``verify.accept``). A tree still on
    the device is read here, with the argmax where the rule reads only that, and on a GPU with what a display
    shows (``explain``): the step's one wait for the device."""
    with timer("accept"):
        argmax = follows_argmax(sampling) and top is None
        shown = explain and argmax and logits.device.type != "cpu"  # on the CPU a read costs no wait
        extra = [top_ids(logits)] if argmax else []
        if shown:
            extra += _display_rows(tree, logits, extra[0], sampling)
        (tree,), read = on_host([tree], extra)
        top = read.pop(0).tolist() if argmax else top
        if inputs is None and decode.step:
            inputs = tree.input_ids(decode.sequence[-1])
        result = accept(tree, logits, sampling, decode.generator, explain=explain, top=top)
        keep = [0] + result.path
        if decode.step == 0:
            done = Commit(torch.as_tensor(decode.prompt), feats, result.bonus)
            new = [result.bonus]
        else:
            commit(keep)
            top = None
            if drafter.reads_verified_top:  # the greedy rule has read it already: no second copy from the device
                top = torch.tensor(result.top) if result.top is not None else top_ids(logits).cpu()
            rows = torch.tensor(keep)  # a list index into a device tensor would be copied over blocking
            done = Commit(inputs[rows], feats[to_device(rows, feats.device)], result.bonus, top, tree)
            new = done.tokens[1:].tolist() + [result.bonus]
    with timer("draft"):
        drafter.observe(decode.state, done)
    with timer("other"):
        new, finished = _finish(new, decode.produced, decode.limit, eos)
        decode.sequence += new
        decode.produced += len(new)
    record = StepRecord(step=decode.step, tree=tree, path=result.path, tokens=new, bonus=result.bonus,
                        timings=timer.timings, finished=finished, decisions=result.decisions)
    if shown:
        node_p, best_p, gaps = read
        record.node_target_p, record.bonus_target_p = node_p, float(best_p[keep[-1]])
        record.margins, record.shown = gaps[keep].tolist()[: len(new)], True
    decode.step += 1
    return record


def generate(
    target: TargetModel,
    drafter: Drafter,
    prompt_ids: list[int],
    max_new_tokens: int = 128,
    sampling: Sampling | None = None,
    stop_on_eos: bool = True,
    cache: Cache | None = None,
    observers: Sequence[Observer] = (),
    padding: VerifyPadding | None = None,
    state: object = None,
) -> Iterator[StepRecord]:
    """Yield one StepRecord for the prefill and one per verify step until EOS or the token limit.

    The run's KV cache is ``cache`` (emptied first) or a new one, and the drafter's state ``state`` (fresh
    from ``drafter.start()``, for a caller that drafts on from where the run ended) or a new one: nothing
    else touches either, so decodes may interleave. ``observers`` fill a record's display extras before it
    is yielded; ``padding``: the verify sizes this machine pads."""
    sampling = sampling or Sampling()
    check_request(target, prompt_ids, max_new_tokens)
    gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    eos = target.text.eos_token_ids if stop_on_eos else frozenset()
    cache = target.new_cache(len(prompt_ids) + max_new_tokens + 64) if cache is None else cache  # 64: a tree's rows
    decode = Decode(list(prompt_ids), max_new_tokens, state, gen)
    finished = None
    while finished is None:
        timer = PhaseTimer(target.device)
        if decode.step == 0:  # the prefill: no draft; the whole prompt is what gets committed
            tree, past = DraftTree.empty(), 0
            with timer("draft"):
                decode.state = drafter.start() if decode.state is None else decode.state
            with timer("verify"):
                logits, feats = target.prefill(prompt_ids, cache)
                logits = logits[None]
        else:
            with timer("draft"):
                tree = decode.propose(drafter, sampling)
            with timer("verify"):
                past = cache.get_seq_length()
                logits, feats = target.verify(decode.sequence[-1], tree, cache, padding)
        record = settle(drafter, decode, tree, logits, feats, None,
                        lambda keep: target.commit(cache, past, keep), sampling, eos, timer, bool(observers))
        finished = record.finished
        if observers:  # decisions: for a display
            seen = Verified(record, logits, [0] + record.path, sampling)
            for observe in observers:
                observe(seen)
        yield record


def _finish(new: list[int], produced: int, limit: int, eos) -> tuple[list[int], str | None]:
    """``new`` cut after the first EOS or at the token limit, and why the run ends there (None: it goes on)."""
    for i, tok in enumerate(new):
        if tok in eos:
            return new[: i + 1], "eos"
    if produced + len(new) >= limit:
        return new[: limit - produced], "length"
    return new, None


@dataclass
class RunResult:
    method: str
    prompt_ids: list[int]
    records: list[StepRecord]
    wall_s: float

    @property
    def output_ids(self) -> list[int]:
        return output_ids(self.records)


def run(target: TargetModel, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int = 128,
        sampling: Sampling | None = None, stop_on_eos: bool = True, observers: Sequence[Observer] = (),
        padding: VerifyPadding | None = None) -> RunResult:
    """Run a whole generation and collect its records (``generate``'s arguments)."""
    start = time.perf_counter()
    records = list(generate(target, drafter, prompt_ids, max_new_tokens, sampling, stop_on_eos,
                            observers=observers, padding=padding))
    return RunResult(drafter.name, list(prompt_ids), records, time.perf_counter() - start)
