"""Hidden-state drafters (Medusa, ReDrafter, semi-AR): networks, loss alignment and beam search, checked by hand."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from trained_helpers import checkpoint_fixtures

from drafters import build_drafter
from drafters.heads import DEPTH, beam_search
from drafters.medusa import MedusaHeads
from drafters.redrafter import RecurrentHead
from drafters.semi_ar import FixedAttentionLM, LstmLM, semi_network
from drafters.training.losses import chain_loss, teacher_forced

VOCAB, HIDDEN = 64, 64
METHODS = ("medusa", "redrafter", "semi-attn", "semi-lstm")
NETWORKS = {"medusa": MedusaHeads, "redrafter": RecurrentHead, "semi-attn": FixedAttentionLM, "semi-lstm": LstmLM,
            # the ablations' networks (drafters.variants)
            "redrafter-no-rnn": lambda h: RecurrentHead(h, recurrent=False),
            "semi-hq-last": lambda h: semi_network(h, "last"),
            "semi-hq-tf2": lambda h: semi_network(h, "transformer", 2)}


target, checkpoints = checkpoint_fixtures(VOCAB, METHODS, epochs=4)


class OneHot:
    """A stand-in for FrozenTarget: embeddings are one-hot rows, the LM head is the identity."""

    def __init__(self, vocab: int):
        self.vocab_map = torch.arange(vocab)
        self.head = torch.eye(vocab)
        self.norm = None

    def embed(self, tokens):
        return F.one_hot(tokens, self.vocab_map.numel()).float()

    def logits(self, head_in):
        return head_in @ self.head.T


# -- networks --------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", NETWORKS)
def test_network_shapes(method):
    net = NETWORKS[method](HIDDEN)
    frozen = OneHot(HIDDEN)
    tokens = torch.randint(0, HIDDEN, (3, 7))
    feats = torch.randn(3, 7, HIDDEN)
    outs = teacher_forced(net, frozen, tokens, feats, DEPTH)
    assert len(outs) == DEPTH and all(o.shape == (3, 7, HIDDEN) for o in outs)
    state = net.start(feats[0, :2], frozen.embed(tokens[0, :2]))
    assert all(s.shape[0] == 2 for s in state)
    assert net.head(state, feats[0, :2], 1).shape == (2, HIDDEN)
    beams, logps = beam_search(net, frozen, feats[0, :1], 5, width=3, length=DEPTH)
    assert beams.shape == logps.shape == (3, DEPTH) and beams.dtype == torch.long


def test_redrafter_recurrence_by_hand():
    torch.manual_seed(0)
    net = RecurrentHead(4, blocks=1)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.5)
    e0, e1, e2, x = torch.randn(4, 1, 4).unbind(0)
    U, W, b = net.U.weight, net.W.weight, net.W.bias
    s0 = e0
    s1 = F.silu(s0 @ U.T + e1 @ W.T + b)
    s2 = F.silu(s1 @ U.T + e2 @ W.T + b)
    state = net.start(x, e0)
    assert torch.equal(state[0], s0)  # s_0 = e_0
    state = net.advance(state, e1, 1)
    torch.testing.assert_close(state[0], s1)
    state = net.advance(state, e2, 2)
    torch.testing.assert_close(state[0], s2)
    h = torch.cat([s2, x], dim=-1)
    block = net.blocks[0].linear
    expected = net.out(h + F.silu(h @ block.weight.T + block.bias))  # ResBlock over [s_i, x], then projection
    torch.testing.assert_close(net.head(state, x, 3), expected)


def test_semi_attn_is_an_alpha_weighted_mean():
    torch.manual_seed(0)
    net = FixedAttentionLM(8, positions=3)
    with torch.no_grad():
        net.alpha_logit.copy_(torch.tensor([0.3, -1.0, 2.0]))
    e = torch.randn(3, 1, 8)
    x = torch.randn(1, 8)
    state = net.start(x, e[0])
    state = net.advance(state, e[1], 1)
    state = net.advance(state, e[2], 2)
    a = net.alpha
    h_q = sum(a[i] * net.mlp(e[i]) for i in range(3)) / a.sum()
    torch.testing.assert_close(net.head(state, x, 3), net.f(x, h_q))
    assert net.mlp[0].out_features == 4 and net.mlp[2].out_features == 4  # width H/2


def test_semi_attn_alpha_stays_inside_unit_interval(target, checkpoints):
    net = FixedAttentionLM(8)
    for value in (-1e4, 0.0, 1e4):
        with torch.no_grad():
            net.alpha_logit.fill_(value)
        assert bool(((net.alpha > 0) & (net.alpha < 1)).all()), value
    trained = build_drafter("semi-attn", target, checkpoint=str(checkpoints["semi-attn"]))
    assert trained.net.alpha.shape == (DEPTH,)
    assert bool(((trained.net.alpha > 0) & (trained.net.alpha < 1)).all())
    assert not torch.equal(trained.net.alpha_logit, torch.zeros(DEPTH))  # training moved them


def test_semi_lstm_layers():
    net = LstmLM(16)
    assert net.lstm.num_layers == 2 and net.lstm.hidden_size == 8
    state = net.start(torch.randn(2, 16), torch.randn(2, 16))
    assert state[0].shape == (2, 2, 8)  # rows, layers, H/2


# -- the loss reads the right positions -------------------------------------------------------------

class Oracle(torch.nn.Module):
    """Head inputs that are the target's own features ``shift`` positions later (ignores its inputs)."""

    def __init__(self, feats, shift: int = 0):
        super().__init__()
        self.feats, self.shift = feats, shift

    def start(self, x, e):
        return ()

    def advance(self, state, e, depth):
        return state

    def head(self, state, x, depth):
        flat = self.feats.reshape(-1, self.feats.shape[-1])
        position = (x[:, None, :] == flat[None]).all(-1).float().argmax(1)  # which flat position each row is
        return self.feats.roll(-(depth + self.shift), dims=1).reshape(flat.shape)[position]


def test_chain_loss_targets_token_t_plus_1_plus_depth():
    torch.manual_seed(0)
    frozen = OneHot(HIDDEN)
    feats = 5 * torch.randn(2, 12, HIDDEN)
    tokens = torch.randint(0, HIDDEN, (2, 12))
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[:, -1] = False
    _, stats = chain_loss(Oracle(feats), frozen, tokens, feats, valid, depth=3)
    assert [stats[f"acc{d}"] for d in (1, 2, 3)] == [1.0, 1.0, 1.0]
    _, off = chain_loss(Oracle(feats, shift=-1), frozen, tokens, feats, valid, depth=3)
    assert max(off[f"acc{d}"] for d in (1, 2, 3)) < 0.5


def dense_chain_loss(net, frozen, tokens, feats, valid, depth):
    """The loss written plainly: every position through the network, masked afterwards."""
    t = tokens.shape[1]
    goal_p = torch.softmax(frozen.logits(feats), dim=-1)
    total = 0.0
    for d, head_in in enumerate(teacher_forced(net, frozen, tokens, feats, depth), start=1):
        ok = valid.clone()
        ok[:, : t - d] &= valid[:, d:]
        ok[:, t - d:] = False
        per_position = -(goal_p.roll(-d, dims=1) * torch.log_softmax(frozen.logits(head_in), dim=-1)).sum(-1)
        total = total + (per_position * ok).sum() / ok.sum()
    return total


@pytest.mark.parametrize("method", NETWORKS)
def test_chain_loss_on_valid_rows_equals_the_dense_loss(method):
    torch.manual_seed(1)
    net = NETWORKS[method](HIDDEN)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.1)
    frozen = OneHot(HIDDEN)
    tokens = torch.randint(0, HIDDEN, (3, 10))
    feats = torch.randn(3, 10, HIDDEN)
    valid = torch.zeros(3, 10, dtype=torch.bool)
    valid[0, 2:9], valid[1, 0:5], valid[2, 4:7] = True, True, True  # answers of different lengths, padding
    valid[2, 8] = True  # not contiguous: still only the pairs (t, t+d) that are both valid count
    loss, _ = chain_loss(net, frozen, tokens, feats, valid, depth=DEPTH)
    grads = torch.autograd.grad(loss, list(net.parameters()))
    expected = dense_chain_loss(net, frozen, tokens, feats, valid, DEPTH)
    expected_grads = torch.autograd.grad(expected, list(net.parameters()))
    torch.testing.assert_close(loss, expected)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e)


def test_teacher_forced_inputs_are_root_then_true_tokens():
    class LastToken(Oracle):
        def start(self, x, e):
            return (e,)

        def advance(self, state, e, depth):
            return (e,)

        def head(self, state, x, depth):
            return state[0]

    frozen = OneHot(HIDDEN)
    tokens = torch.randint(0, HIDDEN, (2, 9))
    outs = teacher_forced(LastToken(None), frozen, tokens, torch.zeros(2, 9, HIDDEN), 3)
    for d, out in enumerate(outs, start=1):  # depth d at position t saw token t+d last (the root is t+1)
        assert torch.equal(out.argmax(-1)[:, : 9 - d], tokens[:, d:])


# -- beam search -----------------------------------------------------------------------------------

class Markov(torch.nn.Module):
    """Toy drafter: the next token's log-probs depend on the last token (and the depth)."""

    def __init__(self, vocab: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(2 * torch.randn(DEPTH + 1, vocab, vocab, generator=g), dim=-1)

    def start(self, x, e):
        return (e,)

    def advance(self, state, e, depth):
        return (e,)

    def head(self, state, x, depth):
        return state[0] @ self.table[depth]  # one-hot rows pick the table row; logits are log-probs


def brute_force(net: Markov, root: int, vocab: int, length: int) -> dict[tuple, float]:
    scores = {}
    for seq in itertools.product(range(vocab), repeat=length):
        prev, total = root, 0.0
        for d, tok in enumerate(seq, start=1):
            total += float(net.table[d, prev, tok])
            prev = tok
        scores[seq] = total
    return scores


@pytest.mark.parametrize("seed", range(3))
def test_beam_search_returns_the_true_top_beams(seed):
    vocab, length = 4, 3
    net, frozen = Markov(vocab, seed), OneHot(vocab)
    truth = brute_force(net, 1, vocab, length)
    best = sorted(truth, key=truth.get, reverse=True)
    # nothing is pruned before the last depth when width >= vocab ** (length - 1): exact top-width
    width = vocab ** (length - 1)
    beams, logps = beam_search(net, frozen, torch.zeros(1, vocab), 1, width, length)
    assert [tuple(b) for b in beams.tolist()] == best[:width]
    torch.testing.assert_close(logps.sum(-1), torch.tensor([truth[b] for b in best[:width]]))
    # width 1 is the greedy chain
    greedy, prev = [], 1
    for d in range(1, length + 1):
        prev = int(net.table[d, prev].argmax())
        greedy.append(prev)
    chain, _ = beam_search(net, frozen, torch.zeros(1, vocab), 1, 1, length)
    assert chain.tolist() == [greedy]


def test_beam_search_on_independent_heads_is_exact_for_any_width():
    class Independent(Markov):
        def head(self, state, x, depth):
            return self.table[depth, 0].expand(x.shape[0], -1)

    vocab, length = 5, 3
    net, frozen = Independent(vocab, 7), OneHot(vocab)
    scores = {seq: sum(float(net.table[d + 1, 0, t]) for d, t in enumerate(seq))
              for seq in itertools.product(range(vocab), repeat=length)}
    best = sorted(scores, key=scores.get, reverse=True)
    for width in (1, 2, 5, 9):
        beams, _ = beam_search(net, frozen, torch.zeros(1, vocab), 0, width, length)
        assert [tuple(b) for b in beams.tolist()] == best[:width]
