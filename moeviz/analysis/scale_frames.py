"""Small frames for the views at scale, read straight from a Trace without building its N × E × L tables.

At 256–384 experts, 60 layers and thousands of tokens `Trace.scores_frame` of every layer is tens of
millions of rows; these give what the scale views draw (`moeviz.charts.scale`) per token (L × E rows), per
layer (N × the experts shown, or E² rows) or per expert (N × L rows):

- one token: `token_scores_frame`, `token_confidence_frame`; every expert's mean score: `mean_score_frame`;
- one layer: `layer_trace`, `layer_scores_frame` (of chosen experts), `layer_coactivation_frame`,
  `next_layer_transition_frame` (the layer → the next MoE layer of its site);
- one expert: `expert_scores_frame` (its score for every token at every layer);
- `coactivation_pair_counts` (one layer or summed over layers, for `expert_order(by="coactivation")`) and
  `filter_experts` (the rows of a per-expert frame for the experts an axis shows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pandas as pd

from moeviz.analysis.confidence import CONFIDENCE_COLUMNS, layer_confidence
from moeviz.analysis.structure import coactivation_counts, coactivation_frame, transition_frame
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
    columns: dict[str, list] = {name: [] for name in TOKEN_SCORES_COLUMNS}
    for routing, i in _token_layers(trace, _token_row(trace, seq, pos, stream)):
        token = _one_token(routing, i)  # its scores from its own logits: not the layer's [N, E] derived
        e = routing.num_experts
        weight = np.zeros(e, np.float32)
        dispatched = np.zeros(e, bool)
        experts = routing.experts[i]
        valid = experts >= 0
        weight[experts[valid]] = routing.weights[i][valid]
        dispatched[experts[valid]] = True
        for name, values in (
            ("site", np.full(e, routing.site, dtype=object)),
            ("layer", np.full(e, routing.layer, dtype=np.int64)),
            ("expert", np.arange(e)),
            ("score", token.scores[0]),
            ("selection_score", token.selection_scores[0]),
            ("logit", routing.logits[i]),
            ("weight", weight),
            ("dispatched", dispatched),
        ):
            columns[name].append(values)
    if not columns["site"]:
        return pd.DataFrame(columns=TOKEN_SCORES_COLUMNS)
    # one frame from whole columns: a frame per layer and their concatenation took 3× as long
    return pd.DataFrame({name: np.concatenate(parts) for name, parts in columns.items()})


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


# ---- one layer -------------------------------------------------------------------------------------------
def layer_trace(trace: Trace, layer: int, site: str | None = None) -> Trace:
    """The trace with only its MoE layer `layer` (of `site`), for the functions that loop over every layer;
    attention left out."""
    return dataclasses.replace(trace, layers=[trace.layer(layer, site)], attention=None)


def layer_scores_frame(
    trace: Trace, layer: int, site: str | None = None, experts: Sequence[int] | None = None
) -> pd.DataFrame:
    """`Trace.scores_frame(layer, site)` restricted to `experts` (all when None), in that order per token:
    one row per (token of the layer, expert), the same columns. N × len(experts) rows, built from the
    layer's arrays without the N × E frame."""
    routing = trace.layer(layer, site)
    ids = np.arange(routing.num_experts) if experts is None else np.asarray(list(experts), dtype=np.int64)
    n, m = len(routing.token_rows), len(ids)
    tokens = trace.tokens.iloc[routing.token_rows].reset_index(drop=True)
    dispatched = np.zeros((n, routing.num_experts), dtype=bool)
    weight = np.zeros((n, routing.num_experts), dtype=np.float32)
    rows, slots = np.nonzero(routing.experts >= 0)
    dispatched[rows, routing.experts[rows, slots]] = True
    weight[rows, routing.experts[rows, slots]] = routing.weights[rows, slots]
    row = np.repeat(np.arange(n), m)
    frame = pd.DataFrame(
        {
            "row": row,
            "expert": np.tile(ids, n),
            "score": routing.scores[:, ids].reshape(-1),
            "logit": routing.logits[:, ids].reshape(-1),
            "selection_score": routing.selection_scores[:, ids].reshape(-1),
            "dispatched": dispatched[:, ids].reshape(-1),
            "weight": weight[:, ids].reshape(-1),
        }
    )
    for column in ("seq", "pos", "token_id", "token"):
        frame[column] = tokens[column].to_numpy()[row]
    return frame


def layer_coactivation_frame(
    trace: Trace, layer: int, site: str | None = None, adjacent_only: bool = False
) -> pd.DataFrame:
    """The `coactivation_frame` rows of one MoE layer (E² rows, not E² × L)."""
    return coactivation_frame(layer_trace(trace, layer, site), adjacent_only=adjacent_only)


def next_layer_transition_frame(
    trace: Trace, layer: int, site: str | None = None, top1: bool = False
) -> pd.DataFrame:
    """The `transition_frame` rows from MoE layer `layer` to the next MoE layer of its site (E × E rows, not
    E² × L); empty when it is the site's last MoE layer."""
    site = trace.layer(layer, site).site
    chain = sorted((r for r in trace.layers if r.site == site), key=lambda r: r.layer)
    index = next(i for i, r in enumerate(chain) if r.layer == layer)
    if index + 1 >= len(chain):
        return pd.DataFrame()
    pair = dataclasses.replace(trace, layers=chain[index : index + 2], attention=None)
    return transition_frame(pair, top1=top1)


def coactivation_pair_counts(trace: Trace, layer: int | None = None, site: str | None = None) -> np.ndarray:
    """Co-activation pair counts [E, E], #{t : i, j ∈ S_t} (`structure.coactivation_counts`), of MoE layer
    `layer`, or (None) summed over every MoE layer with the most common expert count: the matrix
    `expert_order(by="coactivation")` sorts an expert axis by."""
    if layer is not None:
        return coactivation_counts(trace.layer(layer, site))[0]
    sizes = [r.num_experts for r in trace.layers]
    e = max(set(sizes), key=sizes.count) if sizes else 0
    total = np.zeros((e, e))
    for routing in trace.layers:
        if routing.num_experts == e:
            total += coactivation_counts(routing)[0]
    return total


# ---- one expert ------------------------------------------------------------------------------------------
EXPERT_SCORES_COLUMNS = ["site", "layer", "row", "seq", "pos", "token", "expert", "score", "dispatched"]


def expert_scores_frame(trace: Trace, expert: int, site: str | None = None) -> pd.DataFrame:
    """One expert's router score for every token at every MoE layer (of `site`, or of every site): the rows
    of `expert` in every layer's `scores_frame`, stacked as `moeviz.charts.stack_scores` stacks them (what
    `expert_timeline_chart` reads), columns EXPERT_SCORES_COLUMNS. N × L rows."""
    parts = []
    for routing in trace.layers:
        if (site is not None and routing.site != site) or expert >= routing.num_experts:
            continue
        tokens = trace.tokens.iloc[routing.token_rows]
        parts.append(
            pd.DataFrame(
                {
                    "site": routing.site,
                    "layer": routing.layer,
                    "row": np.arange(len(routing.token_rows)),
                    "seq": tokens["seq"].to_numpy(),
                    "pos": tokens["pos"].to_numpy(),
                    "token": tokens["token"].to_numpy(),
                    "expert": expert,
                    "score": routing.scores[:, expert],
                    "dispatched": (routing.experts == expert).any(axis=1),
                }
            )
        )
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=EXPERT_SCORES_COLUMNS)


def filter_experts(frame: pd.DataFrame, experts: Sequence[int], *columns: str) -> pd.DataFrame:
    """The rows of `frame` whose `columns` (default: expert) all hold one of `experts` (e.g. both experts of
    a co-activation pair)."""
    keep = np.ones(len(frame), dtype=bool)
    for column in columns or ("expert",):
        keep &= frame[column].isin(list(experts)).to_numpy()
    return frame[keep]
