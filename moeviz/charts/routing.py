"""Routing views of one MoE layer: the token × expert router-score heatmap and the per-expert load bars."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

DOT = "●"
# Fill the width a host gives the chart, but keep the height for the plot (axis labels add to it).
_FIT_WIDTH = alt.AutoSizeParams(type="fit-x", contains="padding")
_VISIBLE_WHITESPACE = str.maketrans({" ": "␣", "\n": "↵", "\t": "→", "\r": "␍"})


def token_label(pos: int, token: str, seq: int | None = None) -> str:
    """Axis label of one token: "pos:token" (or "seq/pos:token"), whitespace made visible (␣ ↵ →), so that
    repeated tokens stay distinct and a leading space can be seen."""
    text = f"{pos}:{str(token).translate(_VISIBLE_WHITESPACE)}"
    return text if seq is None else f"{seq}/{text}"


def token_window(num_tokens: int, *, max_tokens: int = 400, start: int = 0) -> tuple[int, int]:
    """The [start, stop) token rows a windowed view shows: at most `max_tokens`, clamped to the input."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    start = min(max(int(start), 0), max(num_tokens - max_tokens, 0))
    return start, min(start + max_tokens, num_tokens)


def router_score_heatmap(
    scores_frame: pd.DataFrame,
    *,
    max_tokens: int = 400,
    start: int = 0,
    title: str | None = None,
) -> alt.LayerChart:
    """Token × expert heatmap of router scores of one layer, dispatched experts marked with a dot.

    Input: `Trace.scores_frame(layer, site)`, one row per (token, expert), columns row (token index within
    the layer), expert, score, logit, weight (0 where not dispatched), dispatched (bool), seq, pos, token.

    Tokens run along x in input order, labelled by `token_label` ("pos:token"); experts along y. Colour is
    the router score, a ● marks each expert the token was dispatched to; the tooltip gives token, pos,
    expert, score, logit, weight and dispatched.

    Long inputs are windowed, never sent whole: only token rows [start, start + max_tokens) are kept (see
    `token_window`; `start` is clamped so a full window is shown), so a chart carries at most
    max_tokens × experts cells. The subtitle says which window is shown.
    """
    rows = scores_frame["row"].to_numpy()
    num_tokens = int(rows.max()) + 1 if len(rows) else 0
    lo, hi = token_window(num_tokens, max_tokens=max_tokens, start=start)
    cells = scores_frame[(rows >= lo) & (rows < hi)]
    multi_seq = cells["seq"].nunique() > 1
    labels = [
        token_label(p, t, s if multi_seq else None)
        for s, p, t in zip(cells["seq"], cells["pos"], cells["token"], strict=True)
    ]
    data = pd.DataFrame(
        {
            "row": cells["row"].to_numpy(),
            "label": labels,
            "token": cells["token"].astype(str).to_numpy(),
            "seq": cells["seq"].to_numpy(),
            "pos": cells["pos"].to_numpy(),
            "expert": cells["expert"].to_numpy(),
            "score": cells["score"].to_numpy(dtype=np.float64),
            "logit": cells["logit"].to_numpy(dtype=np.float64),
            "weight": cells["weight"].to_numpy(dtype=np.float64),
            "dispatched": cells["dispatched"].to_numpy(dtype=bool),
        }
    )
    num_experts = int(data["expert"].nunique()) if len(data) else 0
    windowed = (lo, hi) != (0, num_tokens)
    subtitle = f"tokens {lo}–{hi - 1} of {num_tokens}" if windowed else f"{num_tokens} tokens"
    tooltip = [
        alt.Tooltip("token:N"),
        alt.Tooltip("pos:Q"),
        alt.Tooltip("expert:O"),
        alt.Tooltip("score:Q", format=".4f"),
        alt.Tooltip("logit:Q", format=".3f"),
        alt.Tooltip("weight:Q", format=".4f"),
        alt.Tooltip("dispatched:N"),
    ]
    base = alt.Chart(data).encode(
        x=alt.X(
            "label:N",
            sort=alt.EncodingSortField(field="row", op="min"),
            axis=alt.Axis(title="token (pos:token)", labelAngle=-90, labelLimit=90, labelOverlap=True),
        ),
        y=alt.Y("expert:O", axis=alt.Axis(title="expert")),
        tooltip=tooltip,
    )
    cells_layer = base.mark_rect().encode(
        color=alt.Color(
            "score:Q", scale=alt.Scale(scheme="blues", zero=True), legend=alt.Legend(title="score")
        ),
    )
    dot_size = 11 if hi - lo <= 80 else 8 if hi - lo <= 200 else 6  # fewer, wider cells take a bigger dot
    dots = base.transform_filter("datum.dispatched").mark_text(text=DOT, color="#e4572e", fontSize=dot_size)
    return alt.layer(cells_layer, dots).properties(
        title=alt.Title(title or "Router scores", subtitle=subtitle),
        height=min(max(22 * num_experts, 120), 640),
        autosize=_FIT_WIDTH,
    )


def expert_load_chart(load_frame: pd.DataFrame, *, title: str | None = None) -> alt.LayerChart:
    """Bars of tokens dispatched to each expert of one layer, with a dashed rule at the fair share.

    Input: the rows of `moeviz.analysis.expert_load_frame(trace)` for one (layer, site), columns expert,
    count (tokens dispatched to it), share (of all dispatched slots) and utilisation (count / fair share).
    The fair share is the mean count (Σcount / experts), the count every expert would get if balanced.
    """
    data = load_frame[["expert", "count", "share", "utilisation"]].reset_index(drop=True)
    bars = (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X("expert:O", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("count:Q", title="tokens dispatched"),
            tooltip=[
                alt.Tooltip("expert:O"),
                alt.Tooltip("count:Q"),
                alt.Tooltip("share:Q", format=".1%"),
                alt.Tooltip("utilisation:Q", format=".2f", title="utilisation (1 = fair)"),
            ],
        )
    )
    fair = (
        alt.Chart(data)
        .mark_rule(color="#e4572e", strokeDash=[6, 4], strokeWidth=2)
        .encode(y="mean(count):Q", tooltip=[alt.Tooltip("mean(count):Q", format=".1f", title="fair share")])
    )
    return alt.layer(bars, fair).properties(title=title or "Expert load", height=220, autosize=_FIT_WIDTH)
