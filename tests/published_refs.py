"""Tiny checkpoints in the published layouts, made by the published code itself, and the drafts to compare.

The references are the packages their authors publish on PyPI, installed by ``setup.sh --tests``:
``eagle-llm`` (EAGLE's ``cnets.Model``), ``medusa-llm`` (Medusa's ``ResBlock`` heads) and ``speculators``
(``Eagle3DraftModel``, its converter and its loader). A test builds a checkpoint with their classes, saves it
as they save it, and checks that specviz drafts what their forward computes.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import make_llama
from specviz.core.protocol import Commit, DraftRequest
from specviz.core.target import TargetModel
from specviz.core.verify import Sampling

VOCAB, LAYERS, DRAFT_VOCAB = 48, 8, 32
PROMPT = [3, 9, 1, 40, 7, 22, 13, 5, 30]


def target_fixtures(seed: int):
    """A test module's ``target_dir`` (a tiny Llama saved: the packages read their verifier from a folder) and
    ``target`` (the same weights as a ``TargetModel``) fixtures: ``target_dir, target = target_fixtures(seed)``."""

    @pytest.fixture(scope="module")
    def target_dir(tmp_path_factory):
        folder = tmp_path_factory.mktemp("published") / "target"
        make_llama(VOCAB, seed=seed, num_layers=LAYERS).save_pretrained(folder)
        return folder

    @pytest.fixture(scope="module")
    def target():
        return TargetModel(make_llama(VOCAB, seed=seed, num_layers=LAYERS))

    return target_dir, target


def randomise(module: nn.Module, seed: int) -> None:
    """Every weight random (norms near one), so a wrong reading shows in the drafts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)


def eagle_model(target, folder: Path, seed: int = 1, intermediate: int = 96):
    """EAGLE's own ``cnets.Model`` (eagle-llm), saved as EAGLE publishes it: pytorch_model.bin + a Llama config."""
    from eagle.model.cnets import Model

    c = target.config
    fields = dict(vocab_size=target.vocab_size, hidden_size=c.hidden_size, intermediate_size=intermediate,
                  num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                  num_key_value_heads=c.num_key_value_heads, rms_norm_eps=1e-6, max_position_embeddings=256,
                  pad_token_id=None, hidden_act="silu")
    # EAGLE's code predates transformers' rope_parameters: it reads these attributes only
    model = Model(SimpleNamespace(**fields, rope_scaling=None, rope_theta=10000.0, pretraining_tp=1), bias=True)
    randomise(model, seed)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps({**fields, "architectures": ["LlamaForCausalLM"], "bias": True,
                                                    "model_type": "llama", "rope_theta": 10000.0}))
    return model.eval()


@torch.no_grad()
def eagle_chain(model, target, prompt: list[int], depth: int) -> list[int]:
    """EAGLE's chain draft: its network re-run on its own fed-back features, the target's head on each output."""
    feats, pending = prefill(target, prompt, taps=False)
    hidden, ids, drafted = feats[None], torch.tensor([prompt[1:] + [pending]]), []
    for _ in range(depth):
        out = model(hidden, ids)
        out = out[0] if isinstance(out, tuple) else out
        drafted.append(int(target.model.lm_head(out[0, -1]).argmax()))
        hidden, ids = torch.cat([hidden, out[:, -1:]], 1), torch.cat([ids, torch.tensor([[drafted[-1]]])], 1)
    return drafted


def speculators_model(target, target_dir: Path, aux=(1, 2, 4), seed: int = 2, norm_before_residual: bool = False):
    """speculators' ``Eagle3DraftModel`` with a draft vocabulary of DRAFT_VOCAB tokens, untrained but random."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    c = target.config
    layer = LlamaConfig(vocab_size=VOCAB, hidden_size=c.hidden_size, intermediate_size=96, num_hidden_layers=1,
                        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                        rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False)
    layer._attn_implementation = "eager"  # its default, flex attention, is for GPUs
    verifier = VerifierConfig(name_or_path=str(target_dir), architectures=["LlamaForCausalLM"])
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB, eagle_aux_hidden_state_layer_ids=list(aux),
        norm_before_residual=norm_before_residual,
        speculators_config=SpeculatorsConfig(algorithm="eagle3", default_proposal_method="greedy", verifier=verifier,
                                             proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)]))
    model = Eagle3DraftModel(config)
    randomise(nn.ModuleDict({k: m for k, m in model.named_children() if k not in ("embed_tokens", "verifier_lm_head",
                                                                                   "verifier_norm")}), seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[vocab] = True
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
    model.load_vocab_mappings(t2d, vocab - torch.arange(DRAFT_VOCAB))
    return model.float().eval()


@torch.no_grad()
def speculators_drafts(model, target, prompt: list[int]) -> list[int]:
    """The first draft token (a target id) after every prefix of ``prompt``, by speculators' own forward."""
    hidden = target.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    aux = torch.cat([hidden[i] for i in model.config.eagle_aux_hidden_state_layer_ids], dim=-1)
    ids = torch.tensor([prompt[1:] + [prefill(target, prompt)[1]]])
    with warnings.catch_warnings():  # its layer still passes transformers' deprecated ``past_key_values`` name
        warnings.simplefilter("ignore", FutureWarning)
        drafted = model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=1)[0][0]
    return (drafted + model.d2t[drafted]).tolist()


def medusa_heads(target, folder: Path, heads: int = 3, layers: int = 1, seed: int = 3) -> nn.ModuleList:
    """Medusa's ``medusa_head`` as ``MedusaModel`` builds it (``[ResBlock] * layers`` shares one block), saved as
    its ``medusa_lm_head.pt``."""
    from medusa.model.medusa_model import ResBlock

    h = target.config.hidden_size
    net = nn.ModuleList(nn.Sequential(*([ResBlock(h)] * layers), nn.Linear(h, VOCAB, bias=False)) for _ in range(heads))
    randomise(net, seed)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), folder / "medusa_lm_head.pt")
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                    "base_model_name_or_path": "tiny"}))
    return net.eval()


@torch.no_grad()
def prefill(target, prompt: list[int], taps: bool = True) -> tuple[torch.Tensor, int]:
    """The target's features over ``prompt`` (with any tapped layers, else the final-norm output only) and its
    greedy next token."""
    logits, feats = target.prefill(prompt, target.new_cache())
    return (feats if taps else feats[:, :target.config.hidden_size]), int(logits[-1].argmax())


@torch.no_grad()
def propose(drafter, target, prompt: list[int], pending: int | None = None):
    """The drafter's tree after ``prompt`` has been prefilled, rooted at ``pending`` (default: the target's token)."""
    feats, greedy = prefill(target, prompt)
    pending = greedy if pending is None else pending
    state = drafter.start()
    drafter.observe(state, Commit(torch.tensor(prompt), feats, pending))
    return drafter.propose(state, DraftRequest(prompt + [pending], 16, Sampling()))


def first_drafts(drafter, target, prompt: list[int]) -> list[int]:
    """The drafter's first draft token after every prefix of ``prompt``, rooted at the prompt's next token (the
    target's own after the whole prompt), as a teacher-forced forward over the prompt computes them."""
    roots = prompt[1:] + [None]
    return [int(propose(drafter, target, prompt[:t], roots[t - 1]).tokens[0]) for t in range(1, len(prompt) + 1)]
