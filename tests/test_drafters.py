"""Drafters on their own: prompt lookup vs brute force, chain drafters' incremental cache vs fresh."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from drafters import build_drafter
from drafters.chain_lm import ChainLMDrafter
from drafters.pld import PromptLookupSettings, lookup
from drafters.sps import AssistantDrafter, AssistantSettings
from specviz.core.protocol import DraftRequest
from specviz.core.target import TargetModel
from specviz.core.verify import Sampling, probabilities


def brute_lookup(tokens: list[int], num_tokens: int, max_ngram: int, min_ngram: int, limit: int):
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > len(tokens) - 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # the most recent earlier match
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + min(num_tokens, limit)], start, n
    return [], 0, 0


@pytest.mark.parametrize("seed", range(60))
def test_prompt_lookup_matches_brute_force(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randint(1, 30))]
    max_ngram = rng.randint(1, 5)
    min_ngram = rng.randint(1, max_ngram)
    settings = PromptLookupSettings(num_tokens=rng.randint(1, 10), max_ngram=max_ngram, min_ngram=min_ngram)
    limit = rng.randint(1, 12)
    found, at, n = lookup(torch.tensor(tokens), settings, limit)
    assert (found.tolist(), at, n) == brute_lookup(tokens, settings.num_tokens, settings.max_ngram,
                                                   settings.min_ngram, limit)


def test_prompt_lookup_drafter_chain(tiny_target):
    target = tiny_target(vocab_size=16)
    drafter = build_drafter("pld", target, num_tokens=3, max_ngram=2)
    tree = drafter.propose(None, DraftRequest([1, 2, 3, 4, 5, 1, 2], max_depth=8, sampling=Sampling()))
    assert tree.tokens.tolist() == [3, 4, 5] and tree.parents.tolist() == [0, 1, 2]
    assert tree.info == {"ngram": [1, 2], "ngram_at": 0}  # what the step-through view shows
    tree = drafter.propose(None, DraftRequest([1, 2, 3, 4, 5, 1, 2], max_depth=2, sampling=Sampling()))
    assert tree.tokens.tolist() == [3, 4]
    assert len(drafter.propose(None, DraftRequest([1, 2, 3], max_depth=4, sampling=Sampling()))) == 0
    assert drafter.num_parameters() == 0


def test_ar_proposes_nothing(tiny_target):
    target = tiny_target()
    drafter = build_drafter("ar", target)
    assert len(drafter.propose(drafter.start(), DraftRequest([1, 2], 5, Sampling()))) == 0


@torch.inference_mode()
def reference_draft(model, tokens, depth, vocab, sampling, gen=None):
    """Chain drafting by cache-free full forwards: (tokens, q rows)."""
    seq, drafted, rows = list(tokens), [], []
    for _ in range(depth):
        logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1, :vocab].float()
        q = probabilities(logits, sampling)
        tok = int(q.argmax()) if sampling.greedy else int(torch.multinomial(q, 1, generator=gen))
        drafted.append(tok)
        rows.append(q)
        seq.append(tok)
    return drafted, rows


def evolving_requests(seed: int, vocab: int, steps: int = 14):
    """Token sequences as an engine produces them: grow by a few tokens, sometimes roll back first
    (rejected drafts the drafter had cached)."""
    rng = random.Random(seed)
    seq = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
    for _ in range(steps):
        yield list(seq)
        if rng.random() < 0.4 and len(seq) > 2:
            del seq[-rng.randint(1, min(3, len(seq) - 1)):]
        seq += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]


def truncated_reference(target_model, layers: int):
    """A real model with the target's first ``layers`` layers, norm and head."""
    config = transformers.LlamaConfig(**{**target_model.config.to_dict(), "num_hidden_layers": layers})
    ref = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = ref.load_state_dict(target_model.state_dict(), strict=False)
    assert not missing
    assert unexpected and all(int(k.split("layers.")[1].split(".")[0]) >= layers for k in unexpected)
    return ref


@pytest.mark.parametrize("kind", ["sps", "skip-1", "skip-3"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_chain_drafter_incremental_equals_fresh(kind, greedy, tiny_llama):
    vocab = 24
    target = TargetModel(tiny_llama(vocab, seed=0, num_layers=4))
    if kind == "sps":
        model = tiny_llama(vocab + 8, seed=5)  # a larger vocabulary: drafts only use the target's rows
        drafter = AssistantDrafter(target, AssistantSettings(num_tokens=4), model=model)
        assert drafter.num_parameters() == sum(p.numel() for p in model.parameters())
    else:
        layers = int(kind.split("-")[1])
        drafter = build_drafter("skip", target, layers=layers, num_tokens=4)
        model = truncated_reference(target.model, layers)
        assert drafter.num_parameters() == 0
    sampling = Sampling() if greedy else Sampling(temperature=0.8, top_p=0.9)
    state = drafter.start()
    for step, tokens in enumerate(evolving_requests(seed=len(kind) + greedy, vocab=vocab)):
        depth = 1 + step % 4
        gen = torch.Generator().manual_seed(step)
        tree = drafter.propose(state, DraftRequest(tokens, depth, sampling, gen))
        expected, rows = reference_draft(model, tokens, depth, vocab, sampling, torch.Generator().manual_seed(step))
        assert tree.tokens.tolist() == expected, f"step {step}"
        assert tree.parents.tolist() == list(range(depth))
        assert tree.logprobs is not None and tree.logprobs.shape == (depth,)
        if greedy:
            assert tree.child_dists is None
        else:
            assert tree.child_dists.shape == (depth + 1, vocab)
            torch.testing.assert_close(tree.child_dists[:-1], torch.stack(rows), atol=1e-5, rtol=1e-4)
            assert float(tree.child_dists[-1].abs().sum()) == 0.0
    # the target model itself was left intact by the skip view
    assert len(target.model.get_decoder().layers) == 4 and target.model.config.num_hidden_layers == 4


def test_chain_lm_keeps_only_the_shared_prefix_cached(tiny_llama):
    """After the sequence changes (rejected drafts), only the tokens both sequences share stay cached. The cache
    holds the sequence's tokens and the fed drafts, which the host has not read (``ChainState.fed``)."""
    target = TargetModel(tiny_llama(24, seed=0, num_layers=4))
    drafter = build_drafter("skip", target, layers=2, num_tokens=3)
    assert isinstance(drafter, ChainLMDrafter)
    greedy = Sampling()
    state = drafter.start()
    drafter.propose(state, DraftRequest([1, 2, 3, 4, 5], 3, greedy))
    assert state.cached == [1, 2, 3, 4, 5] and state.cache.get_seq_length() == len(state.cached) + len(state.fed) == 7
    drafter.propose(state, DraftRequest([1, 2, 3, 9, 9, 9], 3, greedy))  # diverges after three tokens
    assert state.cached == [1, 2, 3, 9, 9, 9] and state.cache.get_seq_length() == len(state.cached) + len(state.fed)
    fresh = drafter.start()
    assert fresh.cached == [] and fresh.cache.get_seq_length() == 0


def test_lookahead_tree_is_the_jacobi_window_plus_pooled_ngrams(tiny_target):
    """Level 0 is a chain off the root; each later level hangs one node under each column (so a node at
    column j, level l sees level 0 up to j and its own column: depth j + 1 + l); pooled n-grams that start
    with the root come first, merged where they share a prefix; the target's next tokens make the next level."""
    from drafters.lookahead import LookaheadDrafter
    from specviz.core.protocol import Commit

    target = tiny_target(vocab_size=16)
    drafter = build_drafter("lookahead", target, window=3, ngram=3, guesses=2)
    assert isinstance(drafter, LookaheadDrafter)
    state = drafter.start()
    drafter.observe(state, Commit(torch.tensor([5, 6, 7]), torch.zeros(3, 64), 9))  # the prefill
    assert len(state.levels[0]) == 3 and set(state.levels[0]) <= {5, 6, 7}  # guesses taken from the prompt
    state.levels = [level0 := [5, 6, 7]]
    tree = drafter.propose(state, DraftRequest([5, 6, 7, 9], max_depth=16, sampling=Sampling()))
    assert tree.tokens.tolist() == level0 and tree.parents.tolist() == [0, 1, 2]  # no pool yet: the window only
    top = torch.tensor([1, 11, 12, 13])  # the target's next token after the root and each level-0 node
    drafter.observe(state, Commit(torch.tensor([9]), torch.zeros(1, 64), 1, top))
    assert state.levels == [level0, [11, 12, 13]]
    tree = drafter.propose(state, DraftRequest([5, 6, 7, 9, 1], max_depth=16, sampling=Sampling()))
    assert tree.parents.tolist() == [0, 1, 2, 1, 2, 3] and tree.depths.tolist() == [1, 2, 3, 2, 3, 4]
    top = torch.tensor([2, 0, 0, 0, 21, 22, 23])
    drafter.observe(state, Commit(torch.tensor([1]), torch.zeros(1, 64), 2, top))  # full levels: n-grams go to the pool
    assert state.pool == {5: [(11, 21)], 6: [(12, 22)], 7: [(13, 23)]}
    assert state.levels == [[11, 12, 13], [21, 22, 23]]
    tree = drafter.propose(state, DraftRequest([5, 6, 7, 9, 1, 6], max_depth=16, sampling=Sampling()))
    assert tree.tokens.tolist()[:2] == [12, 22] and tree.info["candidates"] == 2  # the n-gram after root 6
    assert tree.parents.tolist()[:2] == [0, 1] and tree.info["lookahead"] == 6
    short = drafter.propose(state, DraftRequest([5, 6, 7, 9, 1, 11], max_depth=2, sampling=Sampling()))
    assert short.max_depth <= 2  # nothing the run could never use
