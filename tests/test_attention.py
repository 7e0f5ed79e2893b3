"""Grouped-query attention without copying the cache per head (``core.attention``): the same logits as
transformers' own SDPA path for trees, batches and chains, lossless decoding on it, and models it must leave."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_llama
from drafters import build_drafter
from drafters.ar import AutoregressiveDrafter
from specviz.core.attention import NAME, grouped_sdpa, transformers_attention, use_grouped_attention
from specviz.core.batch import batch_mask, run_batch
from specviz.core.batch_cache import BatchSlabCache
from specviz.core.cache import SlabCache
from specviz.core.engine import output_ids, run
from specviz.core.load import prepare
from specviz.core.target import TargetModel
from specviz.core.tree import DraftTree

VOCAB = 64
PROMPTS = [[3, 7, 1, 9, 3, 7, 1], [5, 5, 2, 8, 11, 2, 8, 5, 5, 2], [30, 1, 4, 1, 5, 9, 2, 6]]


def pair(num_layers: int = 2) -> tuple[TargetModel, TargetModel]:
    """The same tiny grouped-query model twice: on transformers' SDPA, and prepared (grouped attention)."""
    plain, grouped = make_llama(VOCAB, 0, num_layers), prepare(make_llama(VOCAB, 0, num_layers))
    assert plain.config.num_attention_heads > plain.config.num_key_value_heads
    assert plain.config._attn_implementation == "sdpa" and grouped.config._attn_implementation == NAME
    return TargetModel(plain), TargetModel(grouped)


def random_tree(nodes: int, seed: int) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    parents = [int(torch.randint(0, i + 1, (1,), generator=gen)) for i in range(nodes)]
    return DraftTree(torch.randint(0, VOCAB, (nodes,), generator=gen), torch.tensor(parents))


def test_a_tree_verify_gives_transformers_logits_and_a_sequential_decodes():
    plain, grouped = pair()
    for nodes, seed in ((1, 0), (4, 1), (9, 2), (17, 3)):
        tree = random_tree(nodes, seed)
        out = []
        for target in (plain, grouped):
            cache = SlabCache(target.num_layers, 64)
            target.prefill(PROMPTS[0], cache)
            out.append(target.verify(7, tree, cache)[0])
        torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)
        for i in range(nodes + 1):  # each input against its own prefix, decoded without a cache
            path, node = [], i
            while node:
                path.append(int(tree.tokens[node - 1]))
                node = int(tree.parents[node - 1])
            ids = torch.tensor([PROMPTS[0] + [7] + path[::-1]])
            with torch.inference_mode():
                want = plain.model(ids).logits[0, -1]
            torch.testing.assert_close(out[1][i], want, rtol=1e-4, atol=1e-4)


def test_a_batch_of_rows_at_different_lengths_gives_transformers_logits():
    plain, grouped = pair()
    trees = [random_tree(n, seed=n) for n in (5, 1, 9)]
    out = []
    for target in (plain, grouped):
        batch = BatchSlabCache(target.num_layers, batch=3, capacity=64)
        for prompt in PROMPTS:
            single = SlabCache(target.num_layers, 64)
            target.prefill(prompt, single)
            batch.adopt(batch.add(), single)
        pasts, n = batch.lengths, max(len(t) + 1 for t in trees)
        ids, positions = torch.zeros(3, n, dtype=torch.long), torch.zeros(3, n, dtype=torch.long)
        for b, (tree, past) in enumerate(zip(trees, pasts)):
            ids[b, : len(tree) + 1], positions[b, : len(tree) + 1] = tree.input_ids(7), tree.positions(past)[0]
        mask = batch_mask(pasts, [t.ancestors() for t in trees], target.dtype)
        out.append(target.forward_rows(ids, positions, mask, batch)[0])
    for b, tree in enumerate(trees):
        torch.testing.assert_close(out[1][b, : len(tree) + 1], out[0][b, : len(tree) + 1], rtol=1e-5, atol=1e-5)


def test_a_mask_per_head_and_a_boolean_mask_are_laid_out_alike():
    """The stacked layout against transformers' path on the attention function itself: an additive mask with one
    row per head, and a boolean one shared by the heads."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = make_llama(VOCAB, 0, 1).model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 3):  # one query too: transformers packs it only outside torch.compile
        q, k, v = (torch.randn(2, 4, rows, 16, generator=gen), torch.randn(2, 2, 10, 16, generator=gen),
                   torch.randn(2, 2, 10, 16, generator=gen))
        allowed = torch.rand(2, 4, rows, 10, generator=gen) > 0.3
        allowed[..., 0] = True  # no empty row
        for mask in (torch.zeros(2, 4, rows, 10).masked_fill(~allowed, -1e9), allowed[:, :1]):
            got, _ = grouped_sdpa(module, q, k, v, mask, scaling=0.25)
            want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_one_query_without_a_mask_stacks_its_group_and_matches_transformers(monkeypatch):
    """A decode step's one query sees every key, so no mask comes: where our kernel does not take it (``attend.cpp``,
    tested on its own), its group's heads go to SDPA as query rows of one key/value head (transformers' path would
    hand SDPA the grouped heads, one query each, which on the CPU is several times slower), with transformers'
    output, in fp32 and bf16."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import specviz.core.attention as attention

    monkeypatch.setattr(attention, "few_queries", lambda *a: False)
    module = make_llama(VOCAB, 0, 1).model.layers[0].self_attn
    shapes = []
    real = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda q, *a, **k: shapes.append(tuple(q.shape)) or real(q, *a, **k))
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(2, 4, 1, 16, generator=gen).to(dtype)
        k, v = (torch.randn(2, 2, 10, 16, generator=gen).to(dtype) for _ in range(2))
        got, _ = grouped_sdpa(module, q, k, v, None, scaling=0.25)
        assert shapes.pop() == (2, 2, 2, 16)  # two key/value heads, each with its group's two queries as rows
        want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25)
        assert got.shape == want.shape == (2, 1, 4, 16)
        torch.testing.assert_close(got, want)
    several = torch.randn(2, 4, 3, 16, generator=gen)
    grouped_sdpa(module, several, k.float(), v.float(), None, scaling=0.25)
    assert shapes.pop()[1:3] == (4, 3)  # several queries without a mask: transformers' own path, heads as they are


@pytest.mark.parametrize("method,settings", [("pld", {}), ("lookahead", dict(window=4, ngram=3, guesses=4)),
                                             ("skip", dict(layers=1, num_tokens=3))], ids=str)
def test_decoding_on_grouped_attention_is_lossless(method, settings):
    plain, grouped = pair()
    drafter = build_drafter(method, grouped, **settings)
    for prompt in PROMPTS:
        want = run(plain, AutoregressiveDrafter(), prompt, 30, stop_on_eos=False).output_ids
        assert run(grouped, drafter, prompt, 30, stop_on_eos=False).output_ids == want
    records = run_batch(grouped, build_drafter(method, grouped, **settings), PROMPTS, 20, batch_size=2,
                        stop_on_eos=False)
    for prompt, rs in zip(PROMPTS, records):
        assert output_ids(rs) == run(plain, AutoregressiveDrafter(), prompt, 20, stop_on_eos=False).output_ids


def test_transformers_own_attention_runs_inside_the_block_and_ours_after_it():
    model = prepare(make_llama(VOCAB, 0, 1))
    with transformers_attention(model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == NAME
    plain = make_llama(VOCAB, 0, 1)
    with transformers_attention(plain):  # a model never switched stays as it is
        assert plain.config._attn_implementation == "sdpa"
    assert plain.config._attn_implementation == "sdpa"


def test_models_it_must_not_change_are_left_as_they_are():
    eager = make_llama(VOCAB, 0, 1)
    eager.set_attn_implementation("eager")
    assert not use_grouped_attention(eager) and eager.config._attn_implementation == "eager"
    full = make_llama(VOCAB, 0, 1)
    full.config.num_key_value_heads = full.config.num_attention_heads  # no groups: nothing to save
    assert not use_grouped_attention(full) and full.config._attn_implementation == "sdpa"


def test_importing_registers_nothing_and_saving_writes_no_name(tmp_path):
    code = ("from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as functions\n"
            "import specviz.core.attention as attention, specviz.core.load\n"
            "print(attention.NAME in functions)\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]
    model = prepare(make_llama(VOCAB, 0, 1))
    model.save_pretrained(tmp_path)
    assert NAME not in (tmp_path / "config.json").read_text()  # an export or a LoRA target reloads on plain SDPA
