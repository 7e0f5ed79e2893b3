"""Teaching notes per method for the app's Learn tab: what it drafts from, training, paper, what to look for."""

from __future__ import annotations

# The four seed papers and the two baselines they compare against (arXiv).
PAPERS = {
    "ReDrafter (seed 003): Recurrent Drafter for Fast Speculative Decoding": "https://arxiv.org/abs/2403.09919",
    "HASS (seed 004): Learning Harmonized Representations for Speculative Sampling": "https://arxiv.org/abs/2408.15766",
    "FSPAD (seed 002): Feature Sampling and Partial Alignment Distillation": "https://arxiv.org/abs/2408.15562",
    "Semi-autoregressive drafting (seed 001; no public code, built from the paper)": "",
    "EAGLE-2": "https://arxiv.org/abs/2406.16858",
    "Medusa": "https://arxiv.org/abs/2401.10774",
}

READING = (
    "**How to read the race.** Every column is one method decoding the same prompt with the same target. "
    "The race is fair: one method computes at a time, and the one furthest behind in its own measured time "
    "goes next, so the columns move at the speed each would have alone. τ counts tokens per target forward "
    "(AR = 1). α_k has two definitions, both plotted: *conditional* divides the drafts accepted at depth k by "
    "the steps whose draft reached depth k (EAGLE, Spec-Bench); *unconditional* divides by all steps (vLLM). "
    "The trained drafters here were trained on a 2-core CPU at reduced scale (1,000 ShareGPT prompts), so "
    "their τ is far below the papers'; each reuses the target's frozen LM head behind a learned projection "
    "(an allowed deviation, stated on its card)."
)

NOTES = {
    "ar": dict(source="nothing: the target alone, one token per forward", training="none", paper="the baseline",
               look="τ = 1 and no draft: every token is amber. All speedups are measured against this column."),
    "pld": dict(source="the prompt and output so far: the continuation after the last matching n-gram",
                training="none", paper="prompt lookup decoding (Saxena, 2023); transformers' `prompt_lookup_num_tokens`",
                look="long green runs when the answer copies the prompt (code edits, summaries), nothing otherwise."),
    "skip": dict(source="the target's own first N layers + final norm + LM head (a self-draft)", training="none",
                 paper="LayerSkip-style self-speculation (baseline of seed 001)",
                 look="draft cost grows with N; α falls as N shrinks. The latency plot shows the trade."),
    "sps": dict(source="a second, smaller LM with the same tokenizer", training="none (any assistant)",
                paper="Leviathan et al. 2023; Chen et al. 2023",
                look="a chain; with sampling the rejection rule keeps the target's distribution exactly."),
    "eagle2": dict(source="the target's last hidden state + the next token's embedding, through one decoder layer",
                   training="SmoothL1 on the next feature + 0.1 · cross-entropy, target frozen",
                   paper="EAGLE-2 (Li et al., 2024), baseline of HASS and FSPAD",
                   look="a dynamic tree: wide at shallow depths; α falls quickly with depth."),
    "hass": dict(source="as EAGLE-2", training="EAGLE's loss + Top-K distillation + 3 aligned passes in which the "
                 "drafter reads its own earlier features", paper="HASS (seed 004)",
                 look="compared with eagle2, α holds up better at depths 2–3."),
    "fspad": dict(source="as EAGLE-2, with a Feature Sampler that gates the feature with the token embedding",
                  training="0.1 · token loss + feature loss on a split output (partial alignment distillation)",
                  paper="FSPAD (seed 002)", look="higher α at depth 1 than eagle2 on the same data."),
    "medusa": dict(source="the target's last hidden state only: head k guesses the token k places ahead",
                   training="cross-entropy per head, target frozen", paper="Medusa (Cai et al., 2024), baseline of seeds 001 and 003",
                   look="a static tree of the same shape every step; α drops fast with depth since the heads never see the "
                   "tokens between. Typical acceptance is lossy: the badge turns red."),
    "redrafter": dict(source="the target's last hidden state + an RNN over the drafted tokens",
                      training="cross-entropy on the next tokens, target frozen", paper="ReDrafter (seed 003)",
                      look="beam search, then shared prefixes merged: the tree view shows the beams before and after "
                      "dedup and the compression ratio."),
    "semi-attn": dict(source="the target's hidden state h_p (computed once per step) + a fixed-attention mean over "
                      "the drafted tokens", training="cross-entropy, target frozen (separate training, λ = 1)",
                      paper="semi-autoregressive drafting (seed 001)",
                      look="a K-token chain that costs almost nothing to draft: the draft bar in the latency plot is tiny."),
    "semi-lstm": dict(source="the target's hidden state h_p + a 2-layer LSTM over the drafted tokens",
                      training="cross-entropy, target frozen", paper="semi-autoregressive drafting (seed 001)",
                      look="as semi-attn; compare α at depths 3–4, where the LSTM remembers more."),
}


def note(method: str, title: str, params: int, extra_pct: float) -> str:
    n = NOTES.get(method, {})
    return (f"### {method}\n{title}\n\n- **Drafts from:** {n.get('source', '–')}\n- **Trained:** {n.get('training', '–')}\n"
            f"- **Paper:** {n.get('paper', '–')}\n- **Parameters added:** {params:,} ({extra_pct:.1f} % of the target)\n"
            f"- **What the plots should show:** {n.get('look', '–')}\n")
