"""Small frames for the views at scale, read straight from a Trace without building its N × E tables.

At 256–384 experts, 60 layers and thousands of tokens `Trace.scores_frame` of every layer is tens of
millions of rows; these give what the scale views draw (`moeviz.charts.scale`) in L × E rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from moeviz.analysis.confidence import CONFIDENCE_COLUMNS, layer_confidence
from moeviz.trace import LayerRouting, Trace

TOKEN_SCORES_COLUMNS = [
    "site",
    "layer",
    "expert",
    "score",
    "selection_score",
    "logit",
    "weight",
    "dispatched",
]
MEAN_SCORE_COLUMNS = ["site", "layer", "expert", "score", "selection_score", "count"]


def _token_row(trace: Trace, seq: int, pos: int, stream: str) -> int:
    tokens = trace.tokens
    hit = np.flatnonzero(
        (tokens["seq"].to_numpy() == seq) & (tokens["pos"].to_numpy() == pos) & (tokens["stream"] == stream)
    )
    if len(hit) != 1:
        raise KeyError(f"no token seq={seq} pos={pos} in stream {stream!r}")
    return int(hit[0])


def _token_layers(trace: Trace, row: int):
    """(routing, index of the token in it) for every layer that routed token row `row`."""
    for routing in trace.layers:
        where = np.flatnonzero(routing.token_rows == row)
        if len(where):
            yield routing, int(where[0])


def token_scores_frame(trace: Trace, seq: int, pos: int, stream: str = "input") -> pd.DataFrame:
    """One token's router scores at every MoE layer that routed it: one row per (site, layer, expert),
    columns TOKEN_SCORES_COLUMNS (weight 0 and dispatched False where not dispatched). The same rows as
    `stack_scores` of every layer's `scores_frame` filtered to the token, without building those frames."""
    parts = []
    for routing, i in _token_layers(trace, _token_row(trace, seq, pos, stream)):
        e = routing.num_experts
        weight = np.zeros(e, np.float32)
        dispatched = np.zeros(e, bool)
        experts = routing.experts[i]
        valid = experts >= 0
        weight[experts[valid]] = routing.weights[i][valid]
        dispatched[experts[valid]] = True
        parts.append(
            pd.DataFrame(
                {
                    "site": routing.site,
                    "layer": routing.layer,
                    "expert": np.arange(e),
                    "score": routing.scores[i],
                    "selection_score": routing.selection_scores[i],
                    "logit": routing.logits[i],
                    "weight": weight,
                    "dispatched": dispatched,
                }
            )
        )
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=TOKEN_SCORES_COLUMNS)


def mean_score_frame(trace: Trace) -> pd.DataFrame:
    """Mean router score (and selection score) of every expert over the tokens of each layer, with the
    expert's dispatch count: one row per (site, layer, expert), columns MEAN_SCORE_COLUMNS. For
    `layer_expert_heatmap(frame, value="score")`."""
    parts = []
    for routing in trace.layers:
        e = routing.num_experts
        n = len(routing.token_rows)
        experts = routing.experts[routing.experts >= 0]
        parts.append(
            pd.DataFrame(
                {
                    "site": routing.site,
                    "layer": routing.layer,
                    "expert": np.arange(e),
                    "score": routing.scores.mean(axis=0) if n else np.full(e, np.nan),
                    "selection_score": routing.selection_scores.mean(axis=0) if n else np.full(e, np.nan),
                    "count": np.bincount(experts, minlength=e),
                }
            )
        )
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=MEAN_SCORE_COLUMNS)


def _one_token(routing: LayerRouting, i: int) -> LayerRouting:
    rows = slice(i, i + 1)
    arrays = ("token_rows", "logits", "experts", "weights")  # the scores derive from the logits
    return dataclasses.replace(routing, **{name: getattr(routing, name)[rows] for name in arrays})


def token_confidence_frame(trace: Trace, seq: int, pos: int, stream: str = "input") -> pd.DataFrame:
    """`confidence_frame(trace)` rows of one token (one per MoE layer that routed it, CONFIDENCE_COLUMNS),
    computed on that token alone: milliseconds instead of seconds at 4k tokens × 60 layers × 256 experts
    (every confidence measure is per token)."""
    row = _token_row(trace, seq, pos, stream)
    token = trace.tokens["token"].iloc[row]
    records = []
    for routing, i in _token_layers(trace, row):
        c = layer_confidence(_one_token(routing, i))
        records.append(
            {
                "seq": seq,
                "pos": pos,
                "token": token,
                "layer": routing.layer,
                "site": routing.site,
                **{f.name: getattr(c, f.name)[0] for f in dataclasses.fields(c)},
            }
        )
    return pd.DataFrame(records, columns=CONFIDENCE_COLUMNS)
