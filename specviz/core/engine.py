"""The decoding loop: draft -> verify -> accept -> commit, one StepRecord per target forward."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .errors import SettingsError
from .protocol import Commit, Drafter, DraftRequest
from .target import TargetModel
from .timing import PhaseTimer, Timings
from .tree import DraftTree
from .verify import Sampling, accept, probabilities


@dataclass
class StepRecord:
    step: int  # 0 = prefill (no draft)
    tree: DraftTree
    path: list[int]  # accepted verify-input indices (root excluded), in depth order
    tokens: list[int]  # tokens emitted this step: accepted drafts then the bonus, cut at EOS/limit
    bonus: int
    node_target_p: torch.Tensor  # [N] target prob of each draft token given its parent
    bonus_target_p: float
    timings: Timings = field(default_factory=Timings)
    finished: str | None = None  # "eos" | "length" on the last step
    margins: list[float] = field(default_factory=list)  # per emitted token: the target's top-1 minus top-2 logit

    @property
    def accepted(self) -> int:
        return len(self.path)


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


def shown_p(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The target's probability of token ``cols[i]`` at verify row ``rows[i]``, as hovers show it: the
    sampling distribution, or the softmax at T=1 when greedy."""
    probs = torch.softmax(logits.float(), dim=-1) if s.greedy else probabilities(logits, s)
    return probs[rows.to(logits.device), cols.to(logits.device)].cpu()


def top_two(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over the verify logits [N+1, V]: the target's top token at every row, and its margin (top-1
    minus top-2 logit: how close its choice came to a tie), both on the CPU."""
    if logits.shape[-1] < 2:
        return logits.argmax(-1).cpu(), torch.full((logits.shape[0],), float("inf"))
    values, indices = logits.topk(2, dim=-1)
    return indices[:, 0].cpu(), (values[:, 0] - values[:, 1]).float().cpu()


def generate(
    target: TargetModel,
    drafter: Drafter,
    prompt_ids: list[int],
    max_new_tokens: int = 128,
    sampling: Sampling | None = None,
    stop_on_eos: bool = True,
    cache: DynamicCache | None = None,
    hover: bool = True,
) -> Iterator[StepRecord]:
    """Yield one StepRecord for the prefill and one per verify step until EOS or the token limit.

    The run's KV cache is ``cache`` (emptied first) or a new one; nothing else touches it. ``hover``:
    fill in the target probabilities the app shows (a softmax over every verified row; benches skip it)."""
    sampling = sampling or Sampling()
    check_request(target, prompt_ids, max_new_tokens)
    gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    eos = target.eos_token_ids if stop_on_eos else set()
    cache = target.new_cache() if cache is None else cache

    def finish(new: list[int], produced: int) -> tuple[list[int], str | None]:
        for i, tok in enumerate(new):
            if tok in eos:
                return new[: i + 1], "eos"
        if produced + len(new) >= max_new_tokens:
            return new[: max_new_tokens - produced], "length"
        return new, None

    device = target.device
    timer = PhaseTimer(device)
    with timer("draft"):
        drafter.reset()
    with timer("verify"):
        logits, feats = target.prefill(prompt_ids, cache)
    with timer("accept"):
        first = accept(DraftTree.empty(), logits[None], sampling, gen).bonus
    with timer("draft"):
        drafter.observe(Commit(torch.as_tensor(prompt_ids), feats, first))
    tokens, finished = finish([first], 0)
    p_first = float(shown_p(logits[None], torch.zeros(1, dtype=torch.long), torch.tensor([first]), sampling)[0])
    yield StepRecord(0, DraftTree.empty(), [], tokens, first, torch.zeros(0), p_first, timer.timings, finished,
                     top_two(logits[None])[1].tolist())
    sequence, produced, step = list(prompt_ids) + tokens, len(tokens), 0
    while finished is None:
        step += 1
        timer = PhaseTimer(device)
        with timer("draft"):
            request = DraftRequest(sequence, max_new_tokens - produced - 1, sampling, gen)
            tree = drafter.propose(request) if request.max_depth > 0 else DraftTree.empty()
        with timer("verify"):
            past = cache.get_seq_length()
            logits, feats = target.verify(sequence[-1], tree, cache)
        with timer("accept"):
            result = accept(tree, logits, sampling, gen)
            keep = [0] + result.path
            target.commit(cache, past, keep)
        with timer("draft"):
            committed = tree.input_ids(sequence[-1])[keep]
            top, gap = top_two(logits)
            drafter.observe(Commit(committed, feats[keep], result.bonus, top))
        with timer("other"):
            last = result.path[-1] if result.path else 0
            shown = shown_p(logits, torch.cat([tree.parents, torch.tensor([last])]),
                            torch.cat([tree.tokens, torch.tensor([result.bonus])]), sampling) if hover \
                else torch.full((len(tree) + 1,), float("nan"))
            new, finished = finish(committed[1:].tolist() + [result.bonus], produced)
            sequence += new
            produced += len(new)
            gaps = gap[keep].tolist()[: len(new)]  # row keep[i] chose emitted token i
        yield StepRecord(step, tree, result.path, new, result.bonus, shown[:-1], float(shown[-1]), timer.timings,
                         finished, gaps)


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
        sampling: Sampling | None = None, stop_on_eos: bool = True, hover: bool = True) -> RunResult:
    """Run a whole generation and collect its records."""
    start = time.perf_counter()
    records = list(generate(target, drafter, prompt_ids, max_new_tokens, sampling, stop_on_eos, hover=hover))
    return RunResult(drafter.name, list(prompt_ids), records, time.perf_counter() - start)
