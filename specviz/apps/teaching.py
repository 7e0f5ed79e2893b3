"""Teaching notes per method for the app's Learn tab: what it drafts from, training, paper, what to look for."""

from __future__ import annotations

from dataclasses import dataclass

# The methods' papers (arXiv): the two that founded the field first.
PAPERS = {
    "Fast Inference from Transformers via Speculative Decoding (Leviathan et al., 2023)":
        "https://arxiv.org/abs/2211.17192",
    "Accelerating Large Language Model Decoding with Speculative Sampling (Chen et al., 2023)":
        "https://arxiv.org/abs/2302.01318",
    "ReDrafter: Recurrent Drafter for Fast Speculative Decoding (Cheng et al., 2024)":
        "https://arxiv.org/abs/2403.09919",
    "HASS: Learning Harmonized Representations for Speculative Sampling (Zhang et al., 2024)":
        "https://arxiv.org/abs/2408.15766",
    "FSPAD: Feature Sampling and Partial Alignment Distillation (Gui et al., 2024)": "https://arxiv.org/abs/2408.15562",
    "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test (Li et al., 2025)":
        "https://arxiv.org/abs/2503.01840",
    "Semi-autoregressive drafting (no public code; built from the paper)": "",
    "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees (Li et al., 2024)":
        "https://arxiv.org/abs/2406.16858",
    "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads (Cai et al., 2024)":
        "https://arxiv.org/abs/2401.10774",
    "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding (Fu et al., 2024)":
        "https://arxiv.org/abs/2402.02057",
}

FOUNDATIONS = (
    "**What speculative decoding is.** A language model writes one token per forward pass, and on most "
    "hardware a pass costs about the same for one token as for a few dozen: the time goes to reading the "
    "weights, not to the arithmetic. So a cheap *drafter* guesses the next few tokens, the *target* checks all "
    "of them in one pass, and the agreeing prefix is kept, plus one token of the target's own (a *bonus* after "
    "the last draft, or a *correction* where a draft was rejected). Every pass yields at least one token, "
    "usually more. With greedy decoding a draft is kept when it is the target's own top token; when sampling, "
    "the rejection rule of Leviathan et al. and Chen et al. (2023) keeps a draft with probability "
    "min(1, p/q) and otherwise draws from what is left of the target's distribution (in a tree, each sibling "
    "is tested in turn against what the earlier rejections left; the step view shows those numbers), so the "
    "output follows the target's distribution exactly: a *lossless* method changes the speed, never the "
    "distribution, and in greedy decoding never the text.\n\n"
    "**How the methods descend from it.** The founding papers drafted with a second, smaller model of the same "
    "family (`sps` here). The methods since differ in where the draft comes from. From the text itself: prompt "
    "lookup (`pld`) copies what followed an earlier occurrence of the last few tokens; lookahead runs Jacobi "
    "iterations and keeps an n-gram pool. From the target with parts skipped: `skip` drafts with some of its "
    "layers left out (self-speculative). From heads on the target's last hidden state: Medusa puts one head "
    "per future position and verifies a tree of their top guesses; ReDrafter replaces the independent heads "
    "with a small recurrent network and beam search, merging the beams into a tree; semi-autoregressive "
    "drafting predicts several tokens per pass. From a one-layer transformer that predicts the target's next "
    "*feature* (EAGLE): EAGLE-2 grows the tree where the drafter is confident; HASS trains the drafter on its "
    "own earlier predictions so that deep drafts see at inference what they saw in training; FSPAD samples the "
    "feature before drafting and distils only part of it; EAGLE-3 fuses low, middle and high layers' features "
    "and drafts tokens directly, trained the way it drafts. The race shows what each buys here."
)

READING = (
    "**How to read the race.** Every column is one method decoding the same prompt with the same target. "
    "The race is fair: one method computes at a time, and the one furthest behind in its own measured time "
    "goes next, so the columns move at the speed each would have alone. τ counts tokens per target forward "
    "(AR = 1). α_k has two definitions, both plotted: *conditional* divides the drafts accepted at depth k by "
    "the steps that tested depth k, having accepted the k-1 before it (EAGLE, Spec-Bench); *unconditional* "
    "divides by all steps (vLLM), so it can only fall with depth. "
    "The trained drafters here saw far less training than the papers' (each method's note says what its "
    "checkpoint saw, and on which machine), so their τ is lower too; each reuses the target's frozen "
    "LM head behind a learned projection (an allowed deviation, stated on its card)."
)


PRECISION = (
    "**Why bf16 can leave AR's tokens (and fp32 does not).** A lossless method keeps exactly the tokens the "
    "target itself picks, so in fp32 every column equals AR, token for token. In bf16 the target's body rounds "
    "every sum to 8 bits of mantissa, and a forward over 16 tree tokens adds its numbers in another order than "
    "a forward over one token: the same position gets logits that differ by up to about 0.9 on this model "
    "(0.00006 in fp32). Where the target's two best tokens are that close (a near-tie), the two forwards may "
    "pick different ones and the texts part ways, both being the target's greedy choice up to rounding. The "
    "final norm and the LM head run in fp32 here, so the logits themselves no longer tie on bf16's coarse "
    "steps. The badge says which happened: ✅ identical, ≈ identical up to floating point (AR's top-2 gap was "
    "below the precision's tolerance where they parted), or ❌ differs at a clear decision, which would be a bug."
)

BUDGETS = (
    "**Budgets.** Every method starts with the draft budget (tree depth and size, or chain length) measured to "
    "be fastest on this machine: the target's verify cost for 1 to 64 tokens, and the acceptance the method "
    "showed in a short warm-up, give the expected tokens per second of every budget (`python -m specviz tune`). "
    "The column shows the speedup that budget was expected to reach next to the measured one. A tree that "
    "costs little to verify (bf16 on a CPU with AVX-512 BF16 or AMX, or a GPU) affords more nodes."
)


@dataclass(frozen=True)
class Note:
    source: str  # what the method drafts from
    training: str
    paper: str
    look: str  # what its plots should show


JOINT = (
    "### The (joint) columns: a target trained with its drafter\n"
    "Semi-autoregressive drafting's joint training puts a small LoRA on the target and trains it together with "
    "the drafter, so the target's own features become easier to draft from. The target is then another model: "
    "\"ar (joint)\" shows its own text, and its badge says where that text parts from the base target's (what "
    "the training cost in answers). \"semi-attn (joint)\" drafts for it at the same budget as the base column, "
    "so the difference in τ between the two columns is the joint training's alone; it is lossless against "
    "\"ar (joint)\", not against the base target."
)


BATCHING = (
    "### Why the gain shrinks as the batch grows\n"
    "At batch size 1 a forward reads every weight once to make one token, and verifying eight tokens reads them "
    "once too: on most machines the verify costs little more than one token, so every accepted draft is nearly "
    "free. A batch of B sequences already puts B tokens through every weight it reads; with B draft trees per "
    "forward the machine's arithmetic, not its memory, sets the time, each draft token costs about what a real "
    "one does, and a rejected one is work thrown away. Serving engines therefore draft less as the batch grows "
    "(vLLM keeps a draft length per batch size) or stop drafting at large batches. The Benchmark tab's batch "
    "sweep measures where that happens here. ReDrafter's dynamic tree attention is one answer: its beams share "
    "prefixes, and merged into one tree those are verified once (the sweep runs its beams both ways)."
)

NOTES = {
    "ar": Note("nothing: the target alone, one token per forward", "none", "the baseline",
               "τ = 1 and no draft: every token is amber. All speedups are measured against this column."),
    "pld": Note("the prompt and output so far: the continuation after the last matching n-gram", "none",
                "prompt lookup decoding (Saxena, 2023); transformers' `prompt_lookup_num_tokens`",
                "long green runs when the answer copies the prompt (code edits, summaries), nothing otherwise."),
    "lookahead": Note("the target itself: Jacobi iterations on a window of future positions, run in the same "
                      "forward as verification, feed a pool of n-grams", "none",
                      "Lookahead decoding (Fu et al., 2024), a baseline of HASS, FSPAD and Spec-Bench",
                      "the first steps only warm the window up; then pooled n-grams that start with the last token "
                      "are verified. The tree view shows both branches: the n-gram candidates and the Jacobi window."),
    "skip": Note("the target's own first N layers + final norm + LM head (a self-draft)", "none",
                 "LayerSkip-style self-speculation (a baseline of semi-autoregressive drafting)",
                 "draft cost grows with N; α falls as N shrinks. The latency plot shows the trade."),
    "sps": Note("a second, smaller LM with the same tokenizer: here a one-layer assistant trained on the target's "
                "own answers (or any HF LM given with --assistant)",
                "cross-entropy on the target's greedy answers, target frozen (an HF assistant: none)",
                "Leviathan et al. 2023; Chen et al. 2023",
                "a chain; with sampling the rejection rule keeps the target's distribution exactly."),
    "eagle2": Note("the target's last hidden state + the next token's embedding, through one decoder layer",
                   "SmoothL1 on the next feature + 0.1 · cross-entropy, target frozen",
                   "EAGLE-2 (Li et al., 2024), a baseline of HASS and FSPAD",
                   "a dynamic tree: wide at shallow depths; α falls quickly with depth."),
    "hass": Note("as EAGLE-2",
                 "EAGLE's loss over 3 aligned passes in which the drafter reads its own earlier features; Top-K "
                 "distillation joins for the last fifth of the training", "HASS (Zhang et al., 2024)",
                 "compared with eagle2, α holds up better at depths 2–3."),
    "fspad": Note("as EAGLE-2, with a Feature Sampler that gates the feature with the token embedding",
                  "0.1 · token loss + feature loss on a split output (partial alignment distillation)",
                  "FSPAD (Gui et al., 2024)", "higher α at depth 1 than eagle2 on the same data."),
    "eagle3": Note("the inputs of three of the target's layers (2, L/2, L−3) fused by one projection, + the next "
                   "token's embedding, through one decoder layer",
                   "tokens only (soft cross-entropy per pass, weights 0.8^k) over 5 unrolled passes (7 in the "
                   "paper's code) in which the drafter reads its own hidden states, gradient through all of them "
                   "(training-time test)",
                   "EAGLE-3 (Li et al., 2025), the reference point after EAGLE-2, HASS and FSPAD",
                   "what changed from EAGLE-2: the drafter is no longer asked to imitate the target's last feature, "
                   "a goal it misses a little more at every depth it feeds itself; trained on its own outputs, it "
                   "should keep α higher at depths 3–6, where EAGLE-2's errors compound. Compare α_3 and α_4 with "
                   "hass, which took the first step (aligned passes, but features still regressed and detached). "
                   "Retrained here at the shared budget (13.7k prompts, 4 epochs), its held-out agreement at depths "
                   "1–4 (0.72 / 0.68 / 0.66 / 0.64) is above hass's (0.67 / 0.63 / 0.61 / 0.60), and on all 80 "
                   "MT-bench questions at EAGLE-2's tree its τ is 3.27 against hass's 3.03 (+8 %; +10 % on "
                   "HumanEval), the lead growing with depth; compare its α per depth in the race."),
    "medusa": Note("the target's last hidden state only: head k guesses the token k places ahead",
                   "cross-entropy per head, target frozen",
                   "Medusa (Cai et al., 2024), a baseline of ReDrafter and semi-AR drafting",
                   "a static tree of the same shape every step; α drops fast with depth since the heads never see "
                   "the tokens between. Typical acceptance is lossy: the badge turns red."),
    "redrafter": Note("the target's last hidden state + an RNN over the drafted tokens",
                      "cross-entropy on the next tokens, target frozen", "ReDrafter (Cheng et al., 2024)",
                      "beam search, then shared prefixes merged: the tree view shows the beams before and after "
                      "dedup and the compression ratio."),
    "semi-attn": Note("the target's hidden state h_p (computed once per step) + a fixed-attention mean over the "
                      "drafted tokens", "cross-entropy, target frozen (separate training, λ = 1)",
                      "semi-autoregressive drafting",
                      "a K-token chain that costs almost nothing to draft: the draft bar in the latency plot is tiny."),
    "semi-lstm": Note("the target's hidden state h_p + a 2-layer LSTM over the drafted tokens",
                      "cross-entropy, target frozen", "semi-autoregressive drafting",
                      "as semi-attn; compare α at depths 3–4, where the LSTM remembers more."),
}
UNKNOWN = Note("–", "–", "–", "–")

# What each drafter reads, what it runs, and what it hands the target (the Learn tab's diagrams).
FEATURE_IN = ("target features (last hidden state)", "next token's embedding")
DIAGRAMS = {
    "ar": ((), "no drafter", "nothing: the target adds one token"),
    "pld": (("prompt + output so far",), "find the last match of the final n-gram", "chain: what followed it"),
    "lookahead": (("the target's own guesses (Jacobi window)", "n-gram pool"), "Jacobi update in the verify forward",
                  "n-grams after the root + the window"),
    "skip": (("prompt + output so far",), "the target's first N layers + its head", "chain of K tokens"),
    "sps": (("prompt + output so far",), "a small assistant LM", "chain of K tokens (+ its distributions)"),
    "eagle2": (FEATURE_IN, "1 decoder layer → predicted feature → target's frozen head",
               "dynamic tree (top-k, rerank)"),
    "hass": (FEATURE_IN, "1 decoder layer, trained on its own earlier features", "dynamic tree (top-k, rerank)"),
    "fspad": (FEATURE_IN, "feature sampler + 1 layer, split output", "dynamic tree (top-k, rerank)"),
    "eagle3": (("target layers 2, L/2, L−3 (fused)", "next token's embedding"),
               "1 decoder layer, unrolled on its own outputs in training", "dynamic tree (top-k, rerank)"),
    "medusa": (("target features (last hidden state)",), "K independent heads (ResBlocks)",
               "static tree of rank paths"),
    "redrafter": (("target features (last hidden state)", "drafted tokens"), "RNN + beam search",
                  "beams merged into a tree"),
    "semi-attn": (("target features h_p (once per step)", "drafted tokens"), "fixed-attention mean + head",
                  "K-token chain"),
    "semi-lstm": (("target features h_p (once per step)", "drafted tokens"), "2-layer LSTM + head", "K-token chain"),
}


def note(method: str, title: str, params: int, extra_pct: float, card: dict | None = None) -> str:
    n = NOTES.get(method, UNKNOWN)
    budget = f"- **This checkpoint (its card):** {checkpoint_facts(card)}\n" if card else ""
    return (f"### {method}\n{title}\n\n- **Drafts from:** {n.source}\n- **Trained:** {n.training}\n{budget}"
            f"- **Paper:** {n.paper}\n- **Parameters added:** {params:,} ({extra_pct:.1f} % of the target)\n"
            f"- **What the plots should show:** {n.look}\n")


def checkpoint_facts(card: dict) -> str:
    """What a trained checkpoint saw and how well it agrees with the target, from its card."""
    data, training = card.get("data") or {}, card.get("training") or {}
    facts = []
    if published := card.get("published"):  # not trained here: its source says what it is
        facts.append(f"published checkpoint {published.get('source')} ({published.get('layout')} layout), "
                     "trained by its authors, not by specviz")
    if "train_samples" in data:
        distilled = "self-distilled " if data.get("self_distilled") else ""
        facts.append(f"{data['train_samples']:,} {distilled}ShareGPT prompts")
    if "answer_tokens_seen" in training:
        epochs = training.get("epochs", "?")
        facts.append(f"{training['answer_tokens_seen'] / 1e6:.2f}M answer tokens seen in {epochs} "
                     f"epoch{'' if epochs == 1 else 's'}, {training.get('steps', 0):,} steps")
    if "wall_s" in training:
        facts.append(f"{training['wall_s'] / 60:.0f} min on {training.get('machine', '?')}")
    val = ((card.get("history") or [{}])[-1]).get("val") or {}
    agreement = [val[f"acc{d}"] for d in range(1, 5) if f"acc{d}" in val]
    if agreement:
        facts.append("held-out agreement with the target at depths 1–4: " + " / ".join(f"{a:.2f}" for a in agreement))
    return "; ".join(facts) or "no training facts on its card"
