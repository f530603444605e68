"""Attention: per-head summaries per layer, one head's map over a visible window, the KV-cache what-if."""

import streamlit as st
from components import caches, exports, page_input, pickers, prompt, share, widgets
from streamlit.delta_generator import DeltaGenerator

from moeviz import snippets
from moeviz.charts import (
    HEAD_METRICS,
    attention_block_frame,
    attention_map_chart,
    head_metric_heatmap,
    kv_whatif_heatmap,
    token_window,
)
from moeviz.charts.attention import MAP_SCALES, attention_map_raster
from moeviz.charts.raster import RASTER_ABOVE, use_raster
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


# At scale (a 61-layer model) the page summarises only the layers its head grid shows, GRID_LAYERS at a
# time, each layer once per window (cached in the capture). Nothing is summarised before the head's map is
# drawn: the browser paints the title and the map while the server computes the summaries, then the map's
# metrics (its own layer) and the grid fill in.
GRID_LAYERS = 12
HEAD_GRID_KEYS = [f"heads_{metric}_chart" for metric in HEAD_METRICS]


def grid_layers() -> list[int]:
    """The layers the head grid (and the KV what-if) shows: every map layer up to GRID_LAYERS, else a
    window of GRID_LAYERS chosen with a slider."""
    layers = att.map_layers
    if len(layers) <= GRID_LAYERS:
        return layers
    first = st.select_slider(
        "Layers in the head grid (from)",
        layers[: len(layers) - GRID_LAYERS + 1],
        key="attention_grid_from",
        help=f"{len(layers)} layers: the grid and the KV what-if show {GRID_LAYERS} at a time, each layer "
        "summarised when first shown.",
    )
    start = layers.index(first)
    return layers[start : start + GRID_LAYERS]


# Widgets rerun only their part: a clicked head or a moved window redraws the grid and the map, the
# what-if inputs redraw the what-if.
@st.fragment
def heads_and_map(shown: list[int]) -> None:
    """The head grid (the shown layers × every head) and one head's map: the map first, then its metrics,
    then the grid (drawn above it)."""
    window = widgets.number(
        "Local window W (tokens)",
        "attention_window",
        32,
        1,
        4096,
        help="Keys with 0 ≤ i − j < W count as local (local mass; kind local when > 0.5).",
    )
    grid = st.container()  # above the map, filled after it
    # the grid's click of the last run (its charts are drawn below, after the map)
    clicked = pickers.clicked_head(*(st.session_state.get(key) for key in HEAD_GRID_KEYS))
    layer, head, metrics = head_map(window, clicked)
    geometry: dict = {}  # the block masks of this window, shared by every layer summarised in this run
    with metrics:
        head_metrics(layer, head, window, geometry)
    with grid:
        head_grid(window, shown, geometry)


def head_grid(window: int, shown: list[int], geometry: dict) -> None:
    """The head grid of the `shown` layers, summarised layer by layer with a progress bar."""
    st.subheader("Every head at a glance")
    todo = [layer for layer in shown if not att.has_statistics(layer, window)]
    if todo:
        bar = st.progress(0.0, text="Summarising the heads…")
        for i, layer in enumerate(todo):  # fills the capture's cache, layer by layer, with progress
            bar.progress(i / len(todo), text=f"Summarising the heads of layer {layer}…")
            att.token_statistics(layer, window, 0, geometry)
        bar.empty()
    heads = att.subset(shown).head_summary(window)
    if len(shown) < len(att.map_layers):
        st.caption(f"Layers {shown[0]}–{shown[-1]} of {len(att.map_layers)} with a map (choose above).")
    longest = int(att.lengths.max())  # the colour scales run to what a head can reach at this length
    columns = st.columns(2)
    for i, (metric, (_, _, explanation)) in enumerate(HEAD_METRICS.items()):
        with columns[i % 2]:
            exports.show_chart(
                head_metric_heatmap(heads, metric, num_tokens=longest), f"heads_{metric}", select=True
            )
            st.caption(explanation)
    if att.no_map:
        st.info(
            "Layers without a map (grey): "
            + "; ".join(f"layer {k}: {v}" for k, v in sorted(att.no_map.items())),
            icon=":material/info:",
        )
    exports.table_downloads(heads, "head_summary")


def head_map(window: int, clicked: tuple[int, int] | None) -> tuple[int, int, DeltaGenerator]:
    """One head's map: a window of rect cells, or (over RASTER_ABOVE cells: the whole sequence at scale)
    one image, drawn before any summary. → (layer, head, the container its metrics go in)."""
    st.subheader("One head's map", anchor="map")
    layer, head = pickers.pick_head(att.map_layers, att.layers[att.map_layers[0]].num_heads, clicked)
    sizes = WINDOW_SIZES + ([num_tokens] if num_tokens > WINDOW_SIZES[-1] else [])
    size = sizes[-1]
    if num_tokens > WINDOW_SIZES[0]:
        size = st.select_slider(
            "Window (tokens)",
            sizes,
            value=64,
            format_func=lambda n: f"all {n}" if n == num_tokens and n > WINDOW_SIZES[-1] else str(n),
            help="Query rows and key columns shown; computed on demand. Over "
            f"{RASTER_ABOVE:,} cells the map is drawn as an image (hover for the weights).",
        )
    r0, c0 = 0, 0
    if num_tokens > size:
        a, b = st.columns(2)
        r0 = a.slider("First query shown", 0, num_tokens - size, num_tokens - size, step=max(size // 4, 1))
        c0 = b.slider("First key shown", 0, num_tokens - size, r0, step=max(size // 4, 1))
    rows = range(*token_window(num_tokens, max_tokens=size, start=r0))
    cols = range(*token_window(num_tokens, max_tokens=size, start=c0))
    block = att.block(layer, head, seq, rows=list(rows), cols=list(cols))
    # log by default: over hundreds of keys the weights are ~1/T, one flat grey on a 0–1 scale
    shade = st.radio(
        "Colour", list(MAP_SCALES), format_func=MAP_SCALES.get, horizontal=True, key="attention_map_scale"
    )
    heading = f"Layer {layer}, head {head}"
    raster = use_raster(len(rows), len(cols))
    if raster:
        exports.show_chart(
            attention_map_raster(block, rows, cols, tokens, title=heading, scale=shade), "attention_map"
        )
    else:
        cells = attention_block_frame(block, rows, cols, tokens)
        exports.show_chart(attention_map_chart(cells, title=heading, scale=shade), "attention_map")
    st.caption(
        "Cell (i, j) = p_ij = softmax_j(scaling · q_i · k_j + mask), the share of query i's attention on "
        "key j, recomputed exactly from the captured queries and keys for this window only (never kept). "
        "Rows are normalised over all keys, so a window's row may sum to less than 1; future keys are 0."
    )
    metrics = st.container()  # filled once the head's layer is summarised, after the map is sent
    if not raster:
        exports.table_downloads(cells, f"attention_L{layer}_H{head}")
    share.reproduce(
        lambda: snippets.attention_view(
            share.snippet_input(source, text=text),
            layer,
            head,
            window=window,
            rows=rows,
            cols=cols,
            scale=shade,
            keep_last=st.session_state.get("whatif_window", min(256, max(num_tokens // 2, 1))),
            keep_first=st.session_state.get("whatif_global", 4),
            seq=seq,
        ),
        "the head grid, this head's map and the KV-cache what-if",
    )
    return layer, head, metrics


def head_metrics(layer: int, head: int, window: int, geometry: dict) -> None:
    """The mapped head's kind and mean statistics, from its own layer's summary (computed if not cached)."""
    att.token_statistics(layer, window, 0, geometry)
    picked = att.subset([layer]).head_summary(window)
    picked = picked[picked["head"] == head].iloc[0]
    m0, m1, m2, m3, m4 = st.columns(5)
    m0.metric(
        "Kind",
        picked["kind"],
        help="sink: mean sink mass > 0.5; local: mean local mass > 0.5 (window W); else global.",
    )
    m1.metric("Entropy", f"{picked['mean_entropy']:.2f} nats", help=HEAD_METRICS["mean_entropy"][2])
    m2.metric(
        "Mean distance", f"{picked['mean_mean_distance']:.1f}", help=HEAD_METRICS["mean_mean_distance"][2]
    )
    m3.metric("Sink mass", f"{picked['mean_sink_mass']:.0%}", help=HEAD_METRICS["mean_sink_mass"][2])
    m4.metric("Local mass", f"{picked['mean_local_mass']:.0%}", help=HEAD_METRICS["mean_local_mass"][2])


@st.fragment
def kv_cache(shown: list[int]) -> None:
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
        whatif = kv_cache_whatif(att.subset(shown), keep_last, keep_first)
    exports.show_chart(
        kv_whatif_heatmap(whatif, title=f"Attention mass lost with W = {keep_last}, G = {keep_first}"),
        "kv_whatif",
    )
    # one row per layer: the byte columns repeat on every head row of a layer (two layers may have equal
    # sizes, so never deduplicate the values themselves)
    sizes = whatif.groupby("layer")[["full_cache_bytes", "whatif_cache_bytes"]].first()
    full, kept = int(sizes["full_cache_bytes"].sum()), int(sizes["whatif_cache_bytes"].sum())
    where = "of every layer" if len(shown) == len(att.map_layers) else f"of layers {shown[0]}–{shown[-1]}"
    st.caption(
        "Lost mass of query i = Σ p_ij over the keys such a cache would have evicted (i − j ≥ W and j ≥ G): "
        f"what the head could no longer see. The cache {where} would hold {kept / 2**20:.2f} MiB instead of "
        f"{full / 2**20:.2f} MiB at the longest sequence (saves {1 - kept / full if full else 0:.0%}): per "
        "layer, at most W + G of the tokens it keeps now (all of them, or its own sliding window)."
    )
    exports.table_downloads(whatif, "kv_whatif")


SHOWN = grid_layers()  # outside the fragments: the grid and the KV what-if both follow it
heads_and_map(SHOWN)
kv_cache(SHOWN)
