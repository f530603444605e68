"""Engines: two routings of the same tokens (this model at two dtypes, a capture and an engine import, two
imports) — where they choose different experts, and how much of a log-prob gap the routing explains when
one side's routing is replayed in the model. Every number comes from `moeviz.analysis.engine_diff` and
`moeviz.interventions.replay`."""

import pandas as pd
import streamlit as st
from components import caches, engine_sources, exports, load_options, page_input, pickers, prompt, share
from components.engine_sources import REPLAYS
from components.errors import stop_on_error

import moeviz
from moeviz import snippets
from moeviz.charts import (
    layer_mismatch_chart,
    margin_quartile_chart,
    position_heatmap,
    routers_per_token_chart,
    routers_strip_chart,
    token_options,
)
from moeviz.engines.vllm import SOURCE as VLLM_SOURCE
from moeviz.interventions.replay import replay

DIFFERING_ROWS = 2000  # differing (token, layer) listed (and downloaded) on the page
STRIP_TOKENS = 400  # tokens per window of the token strip
LAYER_COLUMNS = {
    "router_mismatch": st.column_config.NumberColumn("router mismatch", format="percent"),
    "top1_mismatch": st.column_config.NumberColumn("top-1 mismatch", format="percent"),
    "jaccard": st.column_config.NumberColumn("mean Jaccard", format="%.4f"),
    "kl": st.column_config.NumberColumn("router KL", format="%.3g"),
    "tv": st.column_config.NumberColumn("router TV", format="%.3g"),
}

st.title("Engines")
model_key = pickers.model_picker()
text = prompt.prompt_form()
st.caption(
    "Two routings of the same tokens from any two sources — this model at two dtypes, a moeviz capture and "
    "what vLLM dispatches running this model, an engine's routing imported with `moeviz import`, two "
    "imports (rollout vs training), two runs of one engine — aligned by sequence and position, and where "
    "they choose different experts. A is the side "
    "replayed (an inference engine's rollout, say), B the reference (the training side)."
)
picked = []
for column, side in zip(st.columns(2), "AB", strict=True):
    with column:
        picked.append(engine_sources.source_picker(side, model_key, text))
a, b = (engine_sources.load(source, text) for source in picked)
with stop_on_error():
    diff = engine_sources.diff_of(a.ident, b.ident, a.trace, b.trace)
share.reproduce(
    lambda: snippets.engines_view(share.engine_input(a, text), share.engine_input(b, text)), "the diff"
)

# ---- the verdict -------------------------------------------------------------------------------------------
pairs = f"{diff.mismatched:,} of {diff.pairs:,} (token, layer)"
if diff.identical:
    st.success(
        f"**identical routing: {pairs} differ** — every expert set agrees"
        + (", and the router logits are bitwise equal" if diff.layers["logits_equal"].eq(True).all() else "")
        + ".",
        icon=":material/check_circle:",
    )
elif diff.nondeterministic:
    st.warning(
        f"**non-determinism: {pairs} differ** although both sides name the same source ({diff.sources[0]}): "
        "the same engine, model, dtype and device should route identically (or one of the captures is "
        "faulty).",
        icon=":material/warning:",
    )
elif diff.mismatched == 0:  # not identical: the first-ranked experts or the logits differ
    reasons = []
    if diff.top1_mismatch > 0:
        reasons.append(f"the first-ranked expert differs in {diff.top1_mismatch:.2%} of them")
    if diff.layers["logits_equal"].eq(False).any():
        reasons.append("the router logits differ (KL and TV per layer below)")
    st.info(
        f"**{pairs} differ**: the expert sets agree everywhere, but the routing is not identical: "
        f"{'; '.join(reasons)}.",
        icon=":material/info:",
    )
else:
    st.info(
        f"**{pairs} differ** (router mismatch {diff.router_mismatch:.2%}): "
        f"{diff.tokens_any_layer:.1%} of {diff.tokens:,} tokens differ in at least one MoE layer.",
        icon=":material/difference:",
    )
metrics = st.container(horizontal=True, gap="large")
for label, value, help_text in (
    (
        "Router mismatch",
        f"{diff.router_mismatch:.2%}",
        "Share of (token, layer) whose top-k expert sets differ",
    ),
    (
        "Top-1 mismatch",
        "–" if diff.top1_mismatch != diff.top1_mismatch else f"{diff.top1_mismatch:.2%}",
        "Share of (token, layer) whose first-ranked expert differs (where both sides rank their slots)",
    ),
    ("Mean Jaccard", f"{diff.jaccard:.4f}", "Mean |A∩B| / |A∪B| of the two expert sets (1 = identical)"),
    (
        "Tokens differing",
        f"{diff.tokens_any_layer:.1%}",
        "Tokens whose set differs in at least one MoE layer",
    ),
    (
        "Routers per token",
        f"{diff.routers_per_token_mean:.3f}",
        "MoE layers whose set differs, mean per token",
    ),
):
    metrics.metric(label, value, help=help_text, width="content")
st.caption(
    f"A: {a.label} ({diff.sources[0]}) · B: {b.label} ({diff.sources[1]}) · {diff.tokens:,} tokens "
    f"aligned by {diff.aligned_by.replace('_', ' ')}" + "".join(f" · {note}" for note in diff.notes)
)
logits = {side.side: any(r.has_logits for r in side.trace.layers) for side in (a, b)}
ranked = {side.side: all(r.ranked for r in side.trace.layers) for side in (a, b)}
missing = []
without = [side for side, has in logits.items() if not has]
if without:
    missing.append(
        f"{' and '.join(without)} {'have' if len(without) > 1 else 'has'} no router scores (an engine import "
        "records only the chosen experts), so router KL and TV are not shown"
        + (
            " and neither are the margin quartiles nor the margins of the differing pairs"
            if len(without) == 2
            else f"; margins are {diff.margin_side.upper()}'s"
        )
    )
# unranked: in id order (Megatron's router trace), or in the order vLLM's CPU router dispatched them
dispatched = {s.side for s in (a, b) if any(r.decision_source == VLLM_SOURCE for r in s.trace.layers)}
unranked = [side for side, is_ranked in ranked.items() if not is_ranked and side not in dispatched]
unranked_vllm = [side for side, is_ranked in ranked.items() if not is_ranked and side in dispatched]
orders = []
if unranked:
    orders.append(
        f"{' and '.join(unranked)} {'write' if len(unranked) > 1 else 'writes'} each token's experts in id "
        "order"
    )
if unranked_vllm:
    orders.append(
        f"{' and '.join(unranked_vllm)} {'list' if len(unranked_vllm) > 1 else 'lists'} each token's experts "
        "in the order vLLM dispatched them, not by rank"
    )
if orders:
    missing.append(" and ".join(orders) + ", so top-1 mismatch is not defined")
if missing:
    st.caption("Not shown: " + "; ".join(missing) + ". The expert sets compare all the same.")

# ---- per layer ---------------------------------------------------------------------------------------------
st.subheader("Per MoE layer")
exports.show_chart(layer_mismatch_chart(diff.layers), "engines_layers")
st.caption(
    "Router mismatch = share of the layer's tokens whose top-k sets differ (slot order ignored); top-1 "
    "mismatch on slot 0; 1 − Jaccard = 1 − mean |A∩B|/|A∪B|; router TV = mean ½Σ|p_A − p_B| of the router "
    "distributions (where both have logits; KL(A‖B) on hover and in the table). Its line over depth is the "
    "mismatch by depth."
)
st.dataframe(diff.layers, hide_index=True, column_config=LAYER_COLUMNS)
exports.table_downloads(diff.layers, "engines_layers")

st.subheader("By layer and position")
layer_position = diff.layer_position_frame()
exports.show_chart(
    exports.many_marks(position_heatmap(layer_position), len(layer_position)), "engines_positions"
)
st.caption(
    "Share of (token, layer) whose expert sets differ, per MoE layer and token position"
    + (
        f" (positions in bins of {diff.position_bin}, merged further for long inputs)"
        if diff.position_bin > 1
        else ""
    )
    + "; hover for the counts."
)
exports.table_downloads(layer_position, "engines_layer_position")

quartiles = diff.margin_quartile_frame()
if len(quartiles):
    st.subheader("By router margin")
    side = diff.margin_side.upper()
    exports.show_chart(margin_quartile_chart(quartiles, side=side), "engines_margins")
    st.caption(
        f"Router margin of {side} ("
        + (
            "both sides have router logits: the reference's"
            if all(logits.values())
            else "the side with logits"
        )
        + ") = min score of its chosen set − best score outside it, on the selection scores; quartiles per "
        "layer, pooled. A difference that precision causes sits in quartile 1, where the router "
        "hesitated."
    )
    st.dataframe(quartiles, hide_index=True)
    exports.table_downloads(quartiles, "engines_margin_quartiles")

# ---- per token ---------------------------------------------------------------------------------------------
st.subheader("Per token")
tokens = diff.token_frame()
start = 0
if len(tokens) > STRIP_TOKENS:
    start = st.slider(
        "First token of the strip",
        0,
        len(tokens) - STRIP_TOKENS,
        0,
        step=STRIP_TOKENS // 4,
        key="engines_strip_start",
    )
strip = routers_strip_chart(tokens, num_layers=len(diff.layers), max_tokens=STRIP_TOKENS, start=start)
exports.show_chart(exports.many_marks(strip, 2 * min(len(tokens), STRIP_TOKENS)), "engines_strip")
st.caption(
    f"Each token coloured by the number of MoE layers (of {len(diff.layers)}) where A's and B's expert sets "
    "differ; grey: a token one side did not route. Hover for the count."
)
exports.show_chart(routers_per_token_chart(diff.routers_frame()), "engines_routers")
exports.table_downloads(tokens, "engines_tokens")

st.subheader("Differing (token, layer)")
differing = diff.differing_frame(limit=DIFFERING_ROWS)
if differing.empty:
    st.caption("None: every (token, layer) both sides routed has the same expert set.")
else:
    if diff.mismatched > DIFFERING_ROWS:
        st.caption(f"The first {DIFFERING_ROWS:,} of {diff.mismatched:,}, by layer then token.")
    shown = differing.drop(columns=["margin"]) if differing["margin"].isna().all() else differing
    st.dataframe(shown, hide_index=True)
    exports.table_downloads(shown, "engines_differing")
    captured = [side for side in (a, b) if side.model_key is not None]
    if not captured:
        st.caption(
            "The Routing page shows the sidebar model's capture of the prompt: neither side is one, so there "
            "is no token to open there."
        )
    else:
        labels = {
            f"layer {row.layer} · {row.pos}:{row.token} · A {{{row.experts_a}}} vs B {{{row.experts_b}}}": (
                int(row.row),
                int(row.seq),
                int(row.pos),
                row.site,
                int(row.layer),
            )
            for row in differing.itertuples()
        }
        c1, c2 = st.columns([3, 1])
        pick = c1.selectbox("Open a differing token", list(labels), key="engines_pick")
        whose = c2.selectbox(
            "With the scores of",
            [f"{side.side} ({side.dtype})" for side in captured],
            key="engines_whose",
            help="The Routing page shows the sidebar model; its dtype is set to this side's.",
        )
        chosen = captured[[f"{s.side} ({s.dtype})" for s in captured].index(whose)]

        def open_on_routing(row: int, seq: int, pos: int, site: str, layer: int) -> None:
            """Point the Routing page's pickers at the token and layer, the sidebar at the side's dtype."""
            trace = chosen.trace
            token_labels = {key: label for label, key in token_options(trace.tokens).items()}
            layer_labels = {key: label for label, key in pickers.layer_options(trace.layer_keys).items()}
            st.session_state["layer"] = layer_labels[(site, layer)]
            st.session_state["token"] = token_labels[(seq, pos)]
            # the Routing page's window starts a little before the token (clamped there)
            st.session_state["routing_start"] = row - 8
            st.session_state["scale_token_detail"] = True  # over 20 experts, its drill-down drawn
            st.session_state["load_dtype"] = chosen.dtype
            # the Routing page opens on the capture, not on a routing file chosen as the pages' input
            st.session_state[page_input.INPUT] = page_input.MODEL
            st.session_state["engines_go_routing"] = True

        st.button(
            "Open it on the Routing page",
            key="engines_open_routing",
            icon=":material/alt_route:",
            on_click=open_on_routing,
            args=labels[pick],
        )
        if st.session_state.pop("engines_go_routing", False):
            st.switch_page("pages/routing.py")

# ---- replay ------------------------------------------------------------------------------------------------
st.subheader("Replay")
train_key, infer_key = engine_sources.replay_models(a, b, model_key)
replay_key = (a.ident, b.ident, train_key)
train_source, train_options = load_options.split_key(train_key)
st.caption(
    f"Runs {train_source}"
    + (f" ({train_options.label()})" if train_options.label() else "")
    + " with A's expert sets forced "
    "and its own router scores renormalised over them (R3: g_i = 1[i∈S] e^{s_i} / Σ_{j∈S} e^{s_j}), and "
    "compares the next-token log-probs."
)
if st.button("Replay A's routing in this model", key="engines_replay", icon=":material/replay:"):
    with st.status("Replaying A's routing…", expanded=True) as status:
        try:
            loaded = caches.get_model(train_key)
            infer_model = caches.get_model(infer_key) if infer_key is not None else None
            bar = st.progress(0.0, text="Replaying…")
            replayed = replay(
                loaded,
                a.trace,
                infer_model=infer_model,
                ids_from=b.trace,
                progress=lambda fraction, message: bar.progress(min(fraction, 1.0), text=message),
            )
        except moeviz.MoevizError as exc:  # e.g. a routing of another model: said here, the page goes on
            status.update(label="Replay refused", state="error", expanded=True)
            st.error(str(exc))
        else:
            status.update(label="Replayed A's routing", state="complete", expanded=False)
            st.session_state[REPLAYS] = {replay_key: replayed}  # the latest replay of this session
result = st.session_state.get(REPLAYS, {}).get(replay_key)
if result is not None:
    after = result.after
    before = result.before
    cells = st.container(horizontal=True, gap="large")
    for label, name, fmt, help_text in (
        ("Mean Δ", "mean_delta", "{:+.4f}", "mean over next tokens of Δ (nats)"),
        ("k3 KL", "k3_kl", "{:.3g}", "mean(e^Δ − 1 − Δ): the k3 estimate of the KL between the two policies"),
        (
            "Extreme tokens",
            "extreme_fraction",
            "{:.2%}",
            "share of next tokens with |Δ| > ln 2 (a factor of 2)",
        ),
    ):
        change = None if before is None else after[name] - before[name]
        delta = None if not change else fmt.format(change)  # no arrow when replay changed nothing
        cells.metric(
            label + (" after replay" if before is not None else ""),
            fmt.format(after[name]),
            delta=delta,
            delta_color="off" if name == "mean_delta" else "inverse",
            help=help_text + ("; the arrow: the change from before replay" if before is not None else ""),
            width="content",
        )
    rows = [{"gap": "after replay" if result.mode == "gap" else "shift", **after}]
    if before is not None:
        rows.insert(0, {"gap": "before replay", **before})
    table = pd.DataFrame(rows)
    st.dataframe(
        table,
        hide_index=True,
        column_config={
            "mean_delta": st.column_config.NumberColumn("mean Δ", format="%+.4g"),
            "k3_kl": st.column_config.NumberColumn("k3 KL", format="%.4g"),
            "extreme_fraction": st.column_config.NumberColumn("|Δ| > ln 2", format="percent"),
        },
    )
    exports.table_downloads(table, "engines_replay")
    if result.mode == "gap":
        st.caption(
            f"Δ = log π(this model) − log π(A as it ran: {result.reference}) per next token, before replay "
            "(the model's own routing) and after (A's expert sets forced): the less of the gap remains after "
            "replay, the more of it the routing difference explains. "
            f"{result.pairs_replayed:,} of {result.pairs:,} (token, layer) took A's set."
        )
    else:
        st.caption(
            "A is not a capture of this model, so there are no log-probs of A: Δ = log π(own routing) − "
            "log π(A's routing) — how far forcing A's routing alone moves this model's next-token log-probs. "
            f"{result.pairs_replayed:,} of {result.pairs:,} (token, layer) took A's set."
        )
    exports.table_downloads(result.tokens, "engines_replay_tokens")
