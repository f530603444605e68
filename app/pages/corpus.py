"""Corpus: routing at corpus scale from a Parquet store — load, balance and domain specialisation."""

import streamlit as st
from components import expert_axis, exports, share
from components.corpus_store import run_options, store_picker

from moeviz import snippets
from moeviz.analysis import domain_top_experts, filter_experts
from moeviz.charts import balance_chart
from moeviz.charts.checkpoints import domain_specialisation_heatmap
from moeviz.store import StoreQuery

st.title("Corpus")
full = store_picker()
store = full.root
if not full.runs:
    st.warning("The store holds no traced run.")
    st.stop()
st.dataframe(full.summary(), hide_index=True)

a, b, c, d = st.columns(4)
model = a.selectbox("Model", run_options(full, "model"), key="corpus_model")
checkpoints = [r.checkpoint for r in full.runs if r.model == model]
checkpoint = b.selectbox("Checkpoint", checkpoints, index=len(checkpoints) - 1, key="corpus_checkpoint")
scope = StoreQuery(store, model=model, checkpoint=checkpoint, validate=False)
domains = scope.sql("SELECT DISTINCT domain FROM rows ORDER BY domain")["domain"].tolist()
layers = scope.sql("SELECT DISTINCT layer FROM rows ORDER BY layer")["layer"].astype(int).tolist()
chosen_domains = c.multiselect("Domains", domains, key="corpus_domains", placeholder="all")
chosen_layers = d.multiselect("Layers", layers, key="corpus_layers", placeholder="all")
query = StoreQuery(
    store,
    model=model,
    checkpoint=checkpoint,
    domain=chosen_domains or None,
    layer=chosen_layers or None,
    validate=False,
)

st.subheader("Load per layer and expert")
load = query.expert_balance()
axis = expert_axis.expert_axis(load)
expert_axis.show_layer_expert_heatmap(load, "utilisation", axis, "corpus_load")
st.caption("Tokens each expert received over its fair share (white = fair, red = over, blue = under).")
exports.table_downloads(load, "corpus_expert_load")

st.subheader("Balance per layer")
balance = query.balance()
indicator = st.selectbox(
    "Indicator",
    [
        "load_entropy",
        "max_share",
        "dead_fraction",
        "dropped_fraction",
        "cv",
        "cv_unbiased",
        "gini",
        "gini_megatron",
        "jain",
    ],
    key="corpus_metric",
    help="cv: population std (ddof 0), cv_unbiased: sample std (ddof 1, as NeMo/Megatron log it); gini: "
    "textbook, in [0, (E−1)/E], gini_megatron = gini − 1/E; dropped_fraction: of the kT slots, dropped by "
    "expert capacity. The Load & collapse page explains every indicator.",
)
exports.show_chart(balance_chart(balance, indicator), "corpus_balance")
st.caption("One balance indicator per layer; the dashed tick is its value under perfectly even load.")
verdicts = query.collapse()
st.dataframe(verdicts, hide_index=True)
exports.table_downloads(balance, "corpus_balance")
exports.table_downloads(verdicts, "corpus_collapse")

st.subheader("Domain specialisation")
spec = query.domain_specialisation()
shown = filter_experts(spec, axis.shown)
chart = expert_axis.sort_axis(domain_specialisation_heatmap(shown), axis.shown, "x")
exports.show_chart(exports.many_marks(chart, len(shown)), "corpus_specialisation")
expert_axis.caption_shown(axis, more="; one panel per layer (choose layers above to show fewer)")
st.caption("How much more often each expert is chosen for a domain's tokens than chance (lift = DS / (k/E)).")
exports.table_downloads(spec, "corpus_domain_specialisation")

st.subheader("Top experts per domain")
# The null pools every domain of the run (not only those chosen above): an expert's share of all slots.
top = domain_top_experts(scope.domain_specialisation(), top_n=3, level=0.95)
e, f = st.columns(2)
top_domains = e.multiselect("Domain", domains, key="corpus_top_domains", placeholder="all")
top_layers = f.multiselect("Layer", layers, key="corpus_top_layers", placeholder="all")
if top_domains:
    top = top[top["domain"].isin(top_domains)]
if top_layers:
    top = top[top["layer"].isin(top_layers)]
top = top.reset_index(drop=True)
TOP_COLUMNS = ["domain", "layer", "rank", "expert", "share", "null_share", "lift", "null_lo", "null_hi"]
st.dataframe(
    top[[*TOP_COLUMNS, "p_value", "significant", "dispatched", "slots"]],
    hide_index=True,
    key="corpus_top_experts",
    column_config={
        "share": st.column_config.NumberColumn("share", format="percent", help="of the domain's slots"),
        "null_share": st.column_config.NumberColumn(
            "null share", format="percent", help="the expert's share of all domains' slots"
        ),
        "lift": st.column_config.NumberColumn("lift", format="%.2f", help="share / null share"),
        "null_lo": st.column_config.NumberColumn("null 2.5 %", format="percent"),
        "null_hi": st.column_config.NumberColumn("null 97.5 %", format="percent"),
        "p_value": st.column_config.NumberColumn(
            "p", format="%.2g", help="P(share ≥ observed | no specialisation)"
        ),
    },
)
st.caption(
    "The 3 experts taking the largest share of each domain's routing slots, per layer. Null = no "
    "specialisation: the domain labels permuted over the layer's tokens, so a domain would give each expert "
    "its share over all domains (null share; lift = share / null share). The band is the central 95 % of "
    "the share under that permutation (exact hypergeometric); significant = p below 0.05 / (domains × "
    "experts). Tokens are treated as exchangeable: neighbouring tokens route alike, so read significance as "
    "a screen and lift as the effect."
)
exports.table_downloads(top, "corpus_top_experts")
share.reproduce(
    lambda: snippets.corpus_view(str(store), model, checkpoint, chosen_domains, chosen_layers, indicator)
)
