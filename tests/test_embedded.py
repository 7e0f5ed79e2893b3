"""Integration: the embedded SmolLM2-135M target, every training-free method equal to AR (fp32)."""

import pytest
import torch

from drafters import build_drafter
from drafters.skip import truncated_view
from drafters.sps import AssistantDrafter, AssistantSettings
from specviz.apps.questions import load_questions
from specviz.core.engine import run

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def target():
    from specviz.core.load import load_target

    return load_target(None, "float32", "cpu")


@pytest.fixture(scope="module")
def prompts(target):
    questions = load_questions("mt-bench", limit=2) + load_questions("humaneval", limit=1)
    return [target.encode_chat(q.prompt) for q in questions]


def top2_gap(target, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = target.model(torch.tensor([ids])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_same_as_ar(target, prompt, output, reference):
    """Equal to AR, or the first difference is a numerical near-tie (top-2 gap < 1e-4), shown."""
    if output == reference:
        return
    first = next(i for i, (a, b) in enumerate(zip(output, reference)) if a != b)
    gap = top2_gap(target, prompt + reference[:first])
    assert gap < 1e-4, f"outputs diverge at token {first} where AR's top-2 logit gap is {gap:.2e} (not a tie)"
    pytest.skip(f"near-tie at token {first}: top-2 gap {gap:.1e}")


@pytest.mark.parametrize(
    "method,settings",
    [("pld", {}), ("pld", {"num_tokens": 10, "max_ngram": 2}), ("skip", {"layers": 12, "num_tokens": 3}),
     ("lookahead", {}), ("lookahead", {"window": 8, "ngram": 4, "guesses": 8})],
)
def test_method_equals_ar(target, prompts, method, settings):
    drafter = build_drafter(method, target, **settings)
    ar = build_drafter("ar", target)
    for ids in prompts:
        reference = run(target, ar, ids, NEW_TOKENS).output_ids
        result = run(target, drafter, ids, NEW_TOKENS)
        assert len(reference) == NEW_TOKENS or reference[-1] in target.eos_token_ids
        assert_same_as_ar(target, ids, result.output_ids, reference)


def test_sps_with_an_assistant_equals_ar(target, prompts):
    assistant = truncated_view(target.model, 24)  # no second embedded model: 24 of 30 layers as assistant
    drafter = AssistantDrafter(target, AssistantSettings(num_tokens=3), model=assistant, tokenizer=target.tokenizer)
    ar = build_drafter("ar", target)
    for ids in prompts:
        reference = run(target, ar, ids, NEW_TOKENS).output_ids
        result = run(target, drafter, ids, NEW_TOKENS)
        assert any(r.accepted for r in result.records), "the assistant never had a token accepted"
        assert_same_as_ar(target, ids, result.output_ids, reference)


# Floors for the shipped checkpoints at their default (CPU) settings, greedy, 64 tokens: the two-node
# trees give 1.34-1.41 on these 3 prompts (1.40-1.47 on all 80, cards) and the one-token drafts of the
# hidden-state drafters 1.13-1.20 on held-out prompts; these fail a broken drafter or a wrong checkpoint.
TAU_FLOORS = {"eagle2": 1.2, "hass": 1.2, "fspad": 1.2, "eagle3": 1.2, "medusa": 1.05, "redrafter": 1.05,
              "semi-attn": 1.05, "semi-lstm": 1.05}


@pytest.mark.parametrize("method", sorted(TAU_FLOORS))
def test_shipped_checkpoint_beats_floor_and_equals_ar(target, method):
    from specviz.core.metrics import summarize

    drafter = build_drafter(method, target)  # the checkpoint in assets/drafters/<method>
    ar = build_drafter("ar", target)
    taus = []
    for q in load_questions("mt-bench", limit=3):
        ids = target.encode_chat(q.prompt)
        reference = run(target, ar, ids, 64).output_ids
        result = run(target, drafter, ids, 64)
        assert_same_as_ar(target, ids, result.output_ids, reference)
        taus.append(summarize(result.records).tau)
    assert sum(taus) / len(taus) >= TAU_FLOORS[method], taus
