"""Integration: the embedded SmolLM2-135M target, every training-free method equal to AR (fp32).

Every decode here costs about one full 135M-parameter forward per step (and a prefill per prompt), so each
method decodes the prompts where it has something to show, and AR's reference for a prompt is decoded once
for the whole module."""

import pytest
import torch

from drafters import build_drafter
from drafters.skip import truncated_view
from drafters.sps import AssistantDrafter, AssistantSettings
from specviz.apps.questions import load_questions
from specviz.core.engine import run

TOKENS = {"chat0": 24, "chat1": 24, "code": 32}  # new tokens decoded from each prompt: AR's reference length


@pytest.fixture(scope="module")
def target():
    from specviz.core.load import load_target

    return load_target(None, "float32", "cpu")


@pytest.fixture(scope="module")
def prompts(target):
    """The first two MT-bench questions (chat) and the first HumanEval one (code, which prompt lookup copies from)."""
    chat = load_questions("mt-bench", limit=2)
    code = load_questions("humaneval", limit=1)
    return {"chat0": target.text.encode_chat(chat[0].prompt), "chat1": target.text.encode_chat(chat[1].prompt),
            "code": target.text.encode_chat(code[0].prompt)}


@pytest.fixture(scope="module")
def ar_reference(target, prompts):
    """AR's greedy output for a prompt and a number of new tokens, shared by every test in the module: each
    prompt is decoded once, to TOKENS, and a shorter request gets its prefix. That prefix is AR's own answer to
    the shorter request: greedy decoding chooses each token from the tokens before it only, and stops at the
    same EOS (the slice keeps it, and nothing after it)."""
    ar, done = build_drafter("ar", target), {}

    def reference(prompt: str, new_tokens: int) -> list[int]:
        assert new_tokens <= TOKENS[prompt], "raise TOKENS: the references are decoded to it"
        if prompt not in done:
            done[prompt] = run(target, ar, prompts[prompt], TOKENS[prompt]).output_ids
            assert len(done[prompt]) == TOKENS[prompt] or done[prompt][-1] in target.text.eos_token_ids
        return done[prompt][:new_tokens]

    return reference


def top2_gap(target, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = target.model(torch.tensor([ids])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_same_as_ar(target, prompt, output, reference):
    """Equal to AR token for token: in fp32 a divergence is a failure, even at a near-tie, and the message
    shows where, both tokens and AR's top-2 logit gap there."""
    if output == reference:
        return
    first = next((i for i, (a, b) in enumerate(zip(output, reference)) if a != b), min(len(output), len(reference)))
    gap = top2_gap(target, prompt + reference[:first])
    got, want = output[first:first + 1], reference[first:first + 1]
    pytest.fail(f"output diverges from AR at token {first} (method {got}, AR {want}; lengths {len(output)} and "
                f"{len(reference)}); AR's top-2 logit gap there is {gap:.2e}")


# Each method decodes one prompt, where its drafts are accepted as well as rejected (measured). Prompt lookup
# drafts on the code prompt (on the two chat prompts it finds one n-gram in 2 x 32 tokens): drafts of 10
# tokens wholly and partly accepted, then steps with no match. Lookahead's pool's n-grams are accepted 1 and 3
# deep. One setting each: the defaults (prompt lookup's 5-token drafts on the code prompt, lookahead on chat1)
# run exactly the lines of drafters/ and specviz/core/ that these run (traced), with smaller verifies. Skip's
# 12-layer drafts are rejected at every step but one of 30 in 32 tokens: it decodes 8 (7 steps, every draft
# rejected); its chain drafter's acceptance is sps's test, on a 24-layer view.
@pytest.mark.parametrize(
    "method,settings,prompt,new_tokens",
    [("pld", {"num_tokens": 10, "max_ngram": 2}, "code", 32), ("skip", {"layers": 12, "num_tokens": 3}, "chat0", 8),
     ("lookahead", {"window": 8, "ngram": 4, "guesses": 8}, "chat0", 24)],
)
def test_method_equals_ar(target, prompts, ar_reference, method, settings, prompt, new_tokens):
    drafter, ids = build_drafter(method, target, **settings), prompts[prompt]
    result = run(target, drafter, ids, new_tokens)
    assert_same_as_ar(target, ids, result.output_ids, ar_reference(prompt, new_tokens))


def test_sps_with_an_assistant_equals_ar(target, prompts, ar_reference):
    assistant = truncated_view(target.model, 24)  # no second embedded model: 24 of 30 layers as assistant
    drafter = AssistantDrafter(target, AssistantSettings(num_tokens=3), model=assistant,
                               tokenizer=target.text.tokenizer)
    result = run(target, drafter, prompts["chat0"], 16)  # 5 of its 10 steps accept a drafted token
    assert any(r.accepted for r in result.records), "the assistant never had a token accepted"
    assert_same_as_ar(target, prompts["chat0"], result.output_ids, ar_reference("chat0", 16))


# Floors for the shipped checkpoints at their default (CPU) settings, greedy: τ, the mean over the two chat
# prompts of tokens per decode step (AR 1.0; a broken drafter or a wrong checkpoint has about 1.0), decoding 24
# tokens from each (29-37 steps in all; 64 tokens from each of 3 prompts before). Measured here: the two-node
# trees 1.56-1.64 (hass 1.56, eagle3 1.60, eagle2 and fspad 1.64), the hidden-state drafters 1.25-1.44 (medusa
# 1.25, semi-attn 1.28, semi-lstm 1.40, redrafter 1.44); the old 3 x 64 tokens gave eagle2 1.53, medusa 1.23.
# The margins over the lowest, 0.36 and 0.20, are about 9 of hass's 16 accepted tokens and 7 of medusa's 9:
# the floors fail a broken drafter or a wrong checkpoint, not a change of a token or two.
TAU_FLOORS = {"eagle2": 1.2, "hass": 1.2, "fspad": 1.2, "eagle3": 1.2, "medusa": 1.05, "redrafter": 1.05,
              "semi-attn": 1.05, "semi-lstm": 1.05, "sps": 1.05}  # sps: its own assistant LM, 4 tokens a draft
FLOOR_TOKENS = 24


@pytest.mark.parametrize("method", sorted(TAU_FLOORS))
def test_shipped_checkpoint_beats_floor_and_equals_ar(target, prompts, ar_reference, method):
    from specviz.core.metrics import summarize

    drafter = build_drafter(method, target)  # the checkpoint in assets/drafters/<method>
    taus = []
    for prompt in ("chat0", "chat1"):
        result = run(target, drafter, prompts[prompt], FLOOR_TOKENS)
        assert_same_as_ar(target, prompts[prompt], result.output_ids, ar_reference(prompt, FLOOR_TOKENS))
        taus.append(summarize(result.records).tau)
    assert sum(taus) / len(taus) >= TAU_FLOORS[method], taus
