"""Attention: per-head summaries per layer, one head's map over a visible window, the KV-cache what-if."""

import streamlit as st
from components import caches, exports, page_input, pickers, prompt, widgets

from moeviz.charts import (
    HEAD_METRICS,
    attention_block_frame,
    attention_map_chart,
    head_metric_heatmap,
    kv_whatif_heatmap,
    token_window,
)
from moeviz.charts.attention import MAP_SCALES
from moeviz.whatif.kv_cache import kv_cache_whatif

WINDOW_SIZES = [16, 32, 64, 128]  # query rows (and key columns) of the visible map: at most 128² cells

st.title("Attention")
source = pickers.model_picker()
page_input.runs_the_model("Attention")  # a routing file chosen elsewhere: said, not used
text = prompt.prompt_form()
trace = caches.load_or_stop(source, text)
att = caches.get_attention(source, text)
if att is None or not att.map_layers:
    reasons = "; ".join(f"layer {k}: {v}" for k, v in sorted((att.no_map if att else {}).items()))
    st.warning("This model has no softmax attention map to show." + (f" {reasons}" if reasons else ""))
    st.stop()

seqs = sorted(trace.tokens["seq"].unique().tolist())
seq = 0 if len(seqs) == 1 else st.selectbox("Sequence", seqs)
tokens = trace.tokens[trace.tokens["seq"] == seq]
num_tokens = len(tokens)
st.caption(
    f"{trace.model.architecture} · {num_tokens} tokens · {len(att.map_layers)} layers with a map"
    + (f", {len(att.no_map)} without" if att.no_map else "")
    + f" · {att.layers[att.map_layers[0]].num_heads} query heads, "
    f"{att.layers[att.map_layers[0]].num_kv_heads} KV heads"
)


# Widgets rerun only their part: a clicked head or a moved window redraws the grid and the map, the
# what-if inputs redraw the what-if.
@st.fragment
def heads_and_map() -> None:
    """The head grid (every layer × head) and one head's map over a visible window."""
    st.subheader("Every head at a glance")
    window = widgets.number(
        "Local window W (tokens)",
        "attention_window",
        32,
        1,
        4096,
        help="Keys with 0 ≤ i − j < W count as local (local mass; kind local when > 0.5).",
    )
    bar = st.progress(0.0, text="Summarising the heads…")
    for i, layer in enumerate(att.map_layers):  # fills the capture's cache, layer by layer, with progress
        bar.progress(i / len(att.map_layers), text=f"Summarising the heads of layer {layer}…")
        att.summaries(window, layers=[layer])
    bar.empty()
    heads = att.head_summary(window)

    events = []
    longest = int(att.lengths.max())  # the colour scales run to what a head can reach at this length
    columns = st.columns(2)
    for i, (metric, (_, _, explanation)) in enumerate(HEAD_METRICS.items()):
        with columns[i % 2]:
            events.append(
                exports.show_chart(
                    head_metric_heatmap(heads, metric, num_tokens=longest), f"heads_{metric}", select=True
                )
            )
            st.caption(explanation)
    if att.no_map:
        st.info(
            "Layers without a map (grey): "
            + "; ".join(f"layer {k}: {v}" for k, v in sorted(att.no_map.items())),
            icon=":material/info:",
        )
    exports.table_downloads(heads, "head_summary")

    # one head's map ---------------------------------------------------------------------------------------
    st.subheader("One head's map", anchor="map")
    layer, head = pickers.pick_head(
        att.map_layers, att.layers[att.map_layers[0]].num_heads, pickers.clicked_head(*events)
    )
    size = WINDOW_SIZES[-1]
    if num_tokens > WINDOW_SIZES[0]:
        size = st.select_slider(
            "Window (tokens)",
            WINDOW_SIZES,
            value=64,
            help="Query rows and key columns shown; computed on demand",
        )
    r0, c0 = 0, 0
    if num_tokens > size:
        a, b = st.columns(2)
        r0 = a.slider("First query shown", 0, num_tokens - size, num_tokens - size, step=max(size // 4, 1))
        c0 = b.slider("First key shown", 0, num_tokens - size, r0, step=max(size // 4, 1))
    rows = range(*token_window(num_tokens, max_tokens=size, start=r0))
    cols = range(*token_window(num_tokens, max_tokens=size, start=c0))
    block = att.block(layer, head, seq, rows=list(rows), cols=list(cols))
    cells = attention_block_frame(block, rows, cols, tokens)
    picked = heads[(heads["layer"] == layer) & (heads["head"] == head)].iloc[0]
    # log by default: over hundreds of keys the weights are ~1/T, one flat grey on a 0–1 scale
    shade = st.radio(
        "Colour", list(MAP_SCALES), format_func=MAP_SCALES.get, horizontal=True, key="attention_map_scale"
    )
    exports.show_chart(
        attention_map_chart(cells, title=f"Layer {layer}, head {head} ({picked['kind']})", scale=shade),
        "attention_map",
    )
    st.caption(
        "Cell (i, j) = p_ij = softmax_j(scaling · q_i · k_j + mask), the share of query i's attention on "
        "key j, recomputed exactly from the captured queries and keys for this window only (never the whole "
        "T × T map). "
        "Rows are normalised over all keys, so a window's row may sum to less than 1; future keys are 0."
    )
    m1, m2, m3, m4 = st.columns(4)
    m1.metric("Entropy", f"{picked['mean_entropy']:.2f} nats", help=HEAD_METRICS["mean_entropy"][2])
    m2.metric(
        "Mean distance", f"{picked['mean_mean_distance']:.1f}", help=HEAD_METRICS["mean_mean_distance"][2]
    )
    m3.metric("Sink mass", f"{picked['mean_sink_mass']:.0%}", help=HEAD_METRICS["mean_sink_mass"][2])
    m4.metric("Local mass", f"{picked['mean_local_mass']:.0%}", help=HEAD_METRICS["mean_local_mass"][2])
    exports.table_downloads(cells, f"attention_L{layer}_H{head}")


@st.fragment
def kv_cache() -> None:
    """KV-cache bytes per token and the mass each head would lose with a smaller cache."""
    st.subheader("KV cache: what if it kept less?")
    per_token = att.kv_cache_bytes_per_token()
    total = int(per_token["bytes_per_token"].sum())
    k1, k2, k3 = st.columns(3)
    k1.metric(
        "KV bytes per token",
        f"{total:,}",
        help="Σ over softmax layers of Hkv · (Dk + Dv) · dtype bytes: what one more token adds to the cache.",
    )
    k2.metric(
        f"Cache at {num_tokens} tokens",
        f"{att.kv_cache_bytes(num_tokens) / 2**20:.2f} MiB",
        help="Σ over softmax layers of bytes per token × the tokens the layer keeps: all of them, or at most "
        f"its sliding window (capped_at). {att.dtype_bytes} bytes per element (the loaded model's dtype).",
    )
    latent = per_token.get("mla_latent_bytes")
    if latent is not None and latent.notna().any():
        k3.metric(
            "MLA latent bytes per token",
            f"{int(latent.fillna(0).sum()):,}",
            help="(kv_lora_rank + qk_rope_head_dim) · dtype bytes per layer: what DeepSeek-style engines "
            "cache",
        )
    st.dataframe(per_token, hide_index=True)
    exports.table_downloads(per_token, "kv_bytes_per_token")

    a, b = st.columns(2)
    with a:
        keep_last = widgets.number(
            "Keep the last W keys", "whatif_window", min(256, max(num_tokens // 2, 1)), 1, 1_000_000
        )
    with b:
        keep_first = widgets.number("… plus the first G tokens", "whatif_global", 4, 0, 1_000_000)
    with st.spinner("Measuring the mass each head would lose…"):
        whatif = kv_cache_whatif(att, keep_last, keep_first)
    exports.show_chart(
        kv_whatif_heatmap(whatif, title=f"Attention mass lost with W = {keep_last}, G = {keep_first}"),
        "kv_whatif",
    )
    # one row per layer: the byte columns repeat on every head row of a layer (two layers may have equal
    # sizes, so never deduplicate the values themselves)
    sizes = whatif.groupby("layer")[["full_cache_bytes", "whatif_cache_bytes"]].first()
    full, kept = int(sizes["full_cache_bytes"].sum()), int(sizes["whatif_cache_bytes"].sum())
    st.caption(
        "Lost mass of query i = Σ p_ij over the keys such a cache would have evicted (i − j ≥ W and j ≥ G): "
        f"what the head could no longer see. The cache would hold {kept / 2**20:.2f} MiB instead of "
        f"{full / 2**20:.2f} MiB at the longest sequence (saves {1 - kept / full if full else 0:.0%}): per "
        "layer, at most W + G of the tokens it keeps now (all of them, or its own sliding window)."
    )
    exports.table_downloads(whatif, "kv_whatif")


heads_and_map()
kv_cache()
