"""Load and collapse: how evenly each layer spreads tokens over its experts, and the verdicts — of the model
on text, of a routing file, or of an engine's expert counts (a load table: `moeviz import` of counts)."""

import streamlit as st
from components import docs, expert_axis, exports, page_input, pickers, share

from moeviz import snippets
from moeviz.analysis import (
    AUX_LOSS_FORMS,
    CollapseThresholds,
    aux_loss_frame,
    balance_frame,
    coactivation_pair_counts,
    collapse_frame,
    collapse_report,
    expert_balance_frame,
    loss_frame,
)
from moeviz.analysis.balance import load_balance_frame, load_expert_balance_frame
from moeviz.analysis.collapse import (
    NOT_ENOUGH_TOKENS,
    STATUS_JUDGED,
    STATUS_TOO_FEW,
    load_collapse_report,
    note_kind,
    summarise_report,
)
from moeviz.charts import (
    aux_loss_chart,
    balance_chart,
    dead_hot_experts,
)
from moeviz.report import STEPS_ARE_SEQUENCES

INDICATORS = {
    "load_entropy": "H(f) / log E, f_e = c_e / (kT) the share of all kT slots: 1 = even, 0 = one expert "
    "takes all.",
    "effective_experts": "exp(H(f)): how many equally loaded experts give the same entropy (E when even).",
    "max_share": "max_e f_e: the busiest expert's share of all kT slots; 1/E when even.",
    "max_vio": "max_e c_e / mean_e c_e − 1 over the dispatched slots: how far the busiest expert exceeds the "
    "mean load (0 when even; equal to max c / (kT/E) − 1 when nothing is dropped).",
    "cv": "Coefficient of variation of the counts with the population std (ddof 0), std(c) / mean(c) "
    "(0 when even).",
    "cv_unbiased": "The same with the sample std (ddof 1), cv · √(E/(E−1)): the CV NeMo, Megatron-Core and "
    "TensorRT-LLM log.",
    "gini": "Textbook Gini coefficient of the counts, in [0, (E−1)/E]: 0 = even, (E−1)/E = all on one "
    "expert.",
    "gini_megatron": "Megatron-Core's Gini, gini − 1/E: −1/E when even.",
    "jain": "Jain's fairness (Σc)² / (E Σc²): 1 = even, 1/E = all on one expert.",
    "dead_fraction": "Share of experts that received no token (0 when every expert is used).",
    "dropped_fraction": "Share of the kT slots dropped by expert capacity (0 without a capacity).",
}

FEW_FLAGGED = 6  # layers with reasons listed open; more start folded under the summary


def layer_bullets(layers) -> str:
    """One bullet per layer (its verdict), its reasons then its notes as bullets under it, in full."""
    return "".join(
        f"- **{lv.label.capitalize()}** — {lv.verdict!s}\n"
        + "".join(f"  - {reason}\n" for reason in lv.reasons)
        + "".join(f"  - *note:* {note}\n" for note in lv.notes)
        for lv in layers
    )


def notes_of(layers) -> str:
    """The layers' notes counted by kind, e.g. "47 not significant, 11 not enough tokens to judge"."""
    kinds = [note_kind(note) for lv in layers for note in dict.fromkeys(lv.notes)]
    counts = {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}
    return ", ".join(f"{n} {kind}" for kind, n in counts.items())


st.title("Load and collapse")
source = pickers.model_picker()
chosen = page_input.page_input(source, corpus=True)
thresholds = CollapseThresholds()
sequences = False  # a load table whose steps are sequences (MoE-Infinity's per-sequence matrices)
if chosen.is_load:  # an engine's expert counts: every indicator and verdict from the counts, no tokens
    load = chosen.routing
    trace = None
    sequences = load.source in STEPS_ARE_SEQUENCES  # as `moeviz report` judges them
    st.caption(
        f"{load.model.architecture} · a load table of {load.counts.shape[0]} step(s) · {len(load.layers)} "
        f"MoE layers · {load.num_experts} experts, top-{load.top_k} · {chosen.label}"
    )
    st.caption(
        "A load table counts each layer's experts without tokens: each layer's tokens T = Σ counts / k. The "
        "balancing losses and z-loss need each token's router scores and are not shown; the verdicts apply "
        "the load rules alone, and "
        + (
            "count each step as one sequence."
            if sequences
            else "take the tokens as independent (the table does not say which share a sequence), which can "
            "call one text's uneven routing significant."
        )
    )
    experts = load_expert_balance_frame(load)
    balance = load_balance_frame(load)
    report = load_collapse_report(load, thresholds, steps_are_sequences=sequences)
else:
    trace = chosen.routing
    st.caption(
        f"{trace.model.architecture} · {len(trace.tokens)} tokens · {len(trace.layer_keys)} MoE layers"
        + (f" · {chosen.label}" if chosen.from_file else "")
    )
    page_input.not_shown(trace, scores="the balancing losses and z-loss")
    experts = expert_balance_frame(trace)
    balance = balance_frame(trace)
    report = collapse_report(trace, thresholds)

axis = expert_axis.expert_axis(experts, None if trace is None else lambda: coactivation_pair_counts(trace))
expert_axis.show_layer_expert_heatmap(
    experts, "utilisation", axis, "load_heatmap", "Load per layer and expert"
)
st.caption(
    "Utilisation u_e = c_e / (kT/E): tokens an expert received over its fair share (k slots × T tokens "
    "spread over E experts). White = exactly fair, red = overloaded, blue = underused; log₂ scale, "
    "so ½× and 2× look equally strong."
)
exports.table_downloads(experts, "expert_load")

st.subheader("Balance per layer")
metric = st.selectbox("Indicator", list(INDICATORS), key="balance_metric")
exports.show_chart(balance_chart(balance, metric), "balance")
st.caption(f"{INDICATORS[metric]} Dashed red tick = the value under perfectly uniform load.")
with st.expander("All indicators, explained"):
    for name, explanation in INDICATORS.items():
        st.markdown(f"- **{name}** — {explanation}")
st.dataframe(balance, hide_index=True)
exports.table_downloads(balance, "balance")

if trace is not None and page_input.has_scores(trace):  # the losses replay the router's probabilities
    st.subheader("Balancing losses: aux loss and z-loss")
    losses = aux_loss_frame(loss_frame(trace))
    exports.show_chart(aux_loss_chart(losses), "aux_losses")
    st.caption(
        "The balancing losses a trainer would add for this text, replayed from the captured router "
        "probabilities P_e (mean over tokens) and loads f_e, unscaled (α = 1). Each `…_balanced` column is "
        "the loss under perfectly even load (f_e = k/E for every expert, whatever P): 1 or k, the layer's "
        "experts per token. Read: on the dashed line = load as even as the loss asks for; to the right = the "
        "busiest experts get both the tokens and the probability, which the loss penalises (2 = twice its "
        "balanced value).\n"
        + "".join(
            f"\n- `{name}` — {form.description}; balanced value {form.balanced}."
            for name, form in AUX_LOSS_FORMS.items()
        )
        + "\n- `z_loss` — ST-MoE router z-loss, mean_t (log Σ_e exp logit_te)²: the size of the router "
        "logits, not their balance, so it has no balanced value (large = logits that make the softmax "
        "brittle).\n\n"
        'Definitions: docs/routing-metrics.md, "Balancing losses".'
    )
    st.dataframe(
        losses,
        hide_index=True,
        column_config={
            name: st.column_config.NumberColumn(name, format="%.4f") for name in (*AUX_LOSS_FORMS, "z_loss")
        },
    )
    exports.table_downloads(losses, "balancing_losses")

st.subheader("Collapse verdicts")
verdicts = collapse_frame(report)
judged = (verdicts["status"] == STATUS_JUDGED).any()
st.markdown(
    f"Model verdict: **{report.verdict.name.lower()}** (the worst layer's)."
    + (
        ""
        if judged
        else f" No layer was judged on load: {NOT_ENOUGH_TOKENS}; give a longer or several texts."
    )
)
st.caption(
    f"A load threshold (warning: {thresholds.warning_dead_fraction:.0%} dead, "
    f"{thresholds.warning_share_factor}× the fair share or entropy < {thresholds.warning_load_entropy}; "
    f"collapsed: {thresholds.collapsed_dead_fraction:.0%} dead, > {thresholds.collapsed_max_share:.0%} on "
    f"one expert or entropy < {thresholds.collapsed_load_entropy}) counts only when significant against "
    f"uniform routing: p < α / (3 · layers), α = {thresholds.alpha:g} (column `alpha`)."
    + (
        ""  # a load table without sequences: its tokens are taken as independent (said above)
        if trace is None and not sequences
        else " Tokens of one text are not independent (one text ≈ at most "
        f"{1 / thresholds.token_correlation:g} effective tokens), so a layer with too few is "
        f"*{NOT_ENOUGH_TOKENS}*."
    )
)
shown = verdicts.assign(status=verdicts["status"].replace({STATUS_TOO_FEW: NOT_ENOUGH_TOKENS}))
# The reasons and notes are sentences: a table cell cuts them, so they are listed in full below it (one
# bullet each) and only counted in the table.
shown = shown.drop(columns=["reasons", "notes"]).assign(
    reasons=[len(lv.reasons) for lv in report.layers], notes=[len(lv.notes) for lv in report.layers]
)
st.dataframe(
    shown,
    hide_index=True,
    column_config={
        "reasons": st.column_config.NumberColumn("reasons", help="How many reasons (listed in full below)"),
        "notes": st.column_config.NumberColumn("notes", help="How many notes (listed in full below)"),
        "effective_tokens": st.column_config.NumberColumn(
            "effective_tokens", format="%.1f", help="Kish effective sample size of the layer's tokens"
        ),
        **{
            name: st.column_config.NumberColumn(
                name, format="%.2g", help=f"p-value of {name[2:]} (NaN: not fired)"
            )
            for name in ("p_dead", "p_max_share", "p_entropy")
        },
    },
)
summary = summarise_report(report)
# Counted first, the sentences folded below: at 58 layers the notes alone ran to ~230 bullets, most of them
# "not significant". The layers with reasons open by themselves while they are few.
with st.container(key="verdict_summary"):
    st.markdown(f"{summary.headline()} {summary.notes_line()}".strip())
quiet = [lv for lv in report.layers if lv.notes and not lv.findings]
with st.container(key="verdict_reasons"):
    if summary.flagged:
        worst = ", ".join(
            f"{n} {name}" for name, n in reversed(summary.by_verdict.items()) if n and name != "healthy"
        )
        with st.expander(
            f"Reasons: {len(summary.flagged)} of {summary.layers} layers ({worst})",
            expanded=len(summary.flagged) <= FEW_FLAGGED,
        ):
            st.markdown(layer_bullets(summary.flagged))
    if quiet:
        other = "the other " if summary.flagged else ""
        with st.expander(f"Notes on {other}{len(quiet)} layers ({notes_of(quiet)})"):
            st.markdown(layer_bullets(quiet))
    if not summary.flagged and not quiet:
        st.markdown("No layer has a reason or a note.")
exports.table_downloads(verdicts, "collapse_verdicts")
rule = docs.verdict_rule()
if rule:
    with st.expander("How a verdict is reached (docs/verdicts.md)"):
        st.markdown(rule)

st.subheader("Dead and hot experts")
flagged = dead_hot_experts(experts, hot_factor=thresholds.warning_share_factor)
st.caption(
    f"Dead = received no token; hot = utilisation above {thresholds.warning_share_factor}× its fair share."
)
if flagged.empty:
    st.success("No dead or hot expert.")
else:
    st.dataframe(flagged, hide_index=True)
exports.table_downloads(flagged, "dead_hot_experts")
share.reproduce(lambda: snippets.load_view(share.snippet_input(source, chosen), metric, chosen.is_load))
