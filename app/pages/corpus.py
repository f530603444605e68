"""Corpus: routing at corpus scale from a Parquet store — load, balance and domain specialisation."""

import streamlit as st
from components import expert_axis, exports
from components.corpus_store import run_options, store_picker

from moeviz.charts import balance_chart, load_heatmap
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
if len(load) and expert_axis.at_scale(int(load["expert"].max()) + 1):  # sorted, overview + brushed detail
    axis = expert_axis.expert_axis(load)
    expert_axis.show_heatmap(load, "utilisation", axis, "corpus_load")
else:
    exports.show_chart(load_heatmap(load), "corpus_load")
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
exports.show_chart(domain_specialisation_heatmap(spec), "corpus_specialisation")
st.caption("How much more often each expert is chosen for a domain's tokens than chance (lift = DS / (k/E)).")
exports.table_downloads(spec, "corpus_domain_specialisation")
