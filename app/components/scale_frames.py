"""What the pages slice at hundreds of experts (E > 20), read from the trace per layer and per expert, never
as the N × E × L tables (`RoutingFrames` holds those for the 8-expert samples: at 256 experts × 61 layers ×
1k tokens they are 15 million rows). No Streamlit.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np
import pandas as pd

import moeviz
import moeviz.analysis


def one_layer(trace: moeviz.Trace, site: str, layer: int) -> moeviz.Trace:
    """The trace with only its (site, layer) MoE layer (for library functions that loop over layers)."""
    return dataclasses.replace(trace, layers=[trace.layer(layer, site)], attention=None)


def layer_scores(trace: moeviz.Trace, site: str, layer: int, experts: Sequence[int]) -> pd.DataFrame:
    """`Trace.scores_frame(layer, site)` restricted to `experts`: one row per (token of the layer, expert of
    `experts`), the same columns (row = token index within the layer). N × len(experts) rows, built from
    the layer's arrays without the N × E frame."""
    routing = trace.layer(layer, site)
    ids = np.asarray(list(experts), dtype=np.int64)
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


def expert_scores(trace: moeviz.Trace, site: str, expert: int) -> pd.DataFrame:
    """One expert's router score for every token at every MoE layer of `site`, stacked: columns site, layer,
    row, seq, pos, token, expert, score, dispatched (the rows of `stack_scores` of every layer for that
    expert, as `expert_timeline_chart` reads them). N × L rows."""
    parts = []
    for routing in trace.layers:
        if routing.site != site or expert >= routing.num_experts:
            continue
        tokens = trace.tokens.iloc[routing.token_rows]
        parts.append(
            pd.DataFrame(
                {
                    "site": site,
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
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def coactivation(trace: moeviz.Trace, site: str, layer: int, adjacent_only: bool = False) -> pd.DataFrame:
    """`coactivation_frame` of one layer (E² rows, not E² × L)."""
    return moeviz.analysis.coactivation_frame(one_layer(trace, site, layer), adjacent_only=adjacent_only)


def coactivation_counts(trace: moeviz.Trace, site: str, layer: int) -> np.ndarray:
    """The [E, E] co-activation pair counts of one layer (for `expert_order(by="coactivation")`)."""
    from moeviz.analysis.structure import coactivation_counts as counts

    return counts(trace.layer(layer, site))[0]


def coactivation_counts_all(trace: moeviz.Trace) -> np.ndarray:
    """Co-activation pair counts summed over every MoE layer (of the most common expert count)."""
    from moeviz.analysis.structure import coactivation_counts as counts

    sizes = [r.num_experts for r in trace.layers]
    e = max(set(sizes), key=sizes.count) if sizes else 0
    total = np.zeros((e, e))
    for routing in trace.layers:
        if routing.num_experts == e:
            total += counts(routing)[0]
    return total


def transitions(trace: moeviz.Trace, site: str, layer: int, top1: bool = False) -> pd.DataFrame:
    """`transition_frame` of one layer and the next MoE layer of its site (empty when it is the last)."""
    chain = [r for r in trace.layers if r.site == site]
    index = next((i for i, r in enumerate(chain) if r.layer == layer), None)
    if index is None or index + 1 >= len(chain):
        return pd.DataFrame()
    pair = dataclasses.replace(trace, layers=chain[index : index + 2], attention=None)
    return moeviz.analysis.transition_frame(pair, top1=top1)


def filter_experts(frame: pd.DataFrame, experts: Sequence[int], *columns: str) -> pd.DataFrame:
    """Rows of `frame` whose `columns` (default: expert) all hold one of `experts`."""
    keep = np.ones(len(frame), dtype=bool)
    for column in columns or ("expert",):
        keep &= frame[column].isin(list(experts)).to_numpy()
    return frame[keep]


class ScaleFrames:
    """The Routing page's frames at scale: per layer and expert load (`expert_balance_frame`, L × E rows)
    and the balance row of each layer, built once; each layer's routing rows built on first use and kept.
    Read-only for the pages; shared by sessions (thread-safe)."""

    def __init__(self, trace: moeviz.Trace) -> None:
        self.trace = trace
        self.load = moeviz.analysis.expert_balance_frame(trace)
        self.balance = moeviz.analysis.balance_frame(trace).set_index(["site", "layer"])
        self._load_by_layer = dict(list(self.load.groupby(["site", "layer"], sort=False)))
        self._routing: dict[tuple[str, int], pd.DataFrame] = {}
        self._orders: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def order(self, by: str) -> np.ndarray:
        """`expert_order` over all layers (load summed; co-activation pair counts summed), kept per `by`."""
        with self._lock:
            if by in self._orders:
                return self._orders[by]
        coactivation = coactivation_counts_all(self.trace) if by == "coactivation" else None
        order = moeviz.analysis.expert_order(self.load, by=by, coactivation=coactivation)
        with self._lock:
            return self._orders.setdefault(by, order)

    def layer_load(self, site: str, layer: int) -> pd.DataFrame:
        """The `expert_balance_frame` rows of one MoE layer."""
        return self._load_by_layer[(site, layer)]

    def layer_balance(self, site: str, layer: int) -> pd.Series:
        """The `balance_frame` row of one MoE layer."""
        return self.balance.loc[(site, layer)]

    def layer_routing(self, site: str, layer: int) -> pd.DataFrame:
        """The `Trace.routing_frame()` rows of one MoE layer (built on first use)."""
        key = (site, layer)
        with self._lock:
            if key in self._routing:
                return self._routing[key]
        frame = one_layer(self.trace, site, layer).routing_frame()
        with self._lock:
            return self._routing.setdefault(key, frame)
