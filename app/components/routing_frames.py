"""The frames the Routing page slices on every interaction, built once per (model, text) and shared by the
sessions: `RoutingFrames` (every layer's tables, built at once) up to 20 experts, `ScaleFrames` (per layer,
on first use) above; `frames_for` picks. Both answer the same per-layer questions. No Streamlit.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence

import numpy as np
import pandas as pd

import moeviz
import moeviz.analysis
import moeviz.charts
from components.scale import trace_at_scale
from moeviz.analysis import coactivation_pair_counts, filter_experts, layer_scores_frame, layer_trace


@dataclasses.dataclass(frozen=True)
class RoutingFrames:
    """routing: `Trace.routing_frame()`; scores: every layer's `scores_frame` stacked (with site, layer);
    confidence: `confidence_frame`; load: `expert_balance_frame` (per layer and expert); balance:
    `balance_frame` indexed by (site, layer)."""

    routing: pd.DataFrame
    scores: pd.DataFrame
    confidence: pd.DataFrame
    load: pd.DataFrame
    balance: pd.DataFrame
    by_layer: dict[str, dict[tuple[str, int], pd.DataFrame]]  # "scores"/"routing" split per (site, layer)

    def layer_scores(self, site: str, layer: int, experts: Sequence[int] | None = None) -> pd.DataFrame:
        """The scores rows of one MoE layer (a 32k-token input has a million score rows: split once), of
        `experts` only when they are not all of them."""
        frame = self.by_layer["scores"][(site, layer)]
        if experts is None or len(set(experts)) == frame["expert"].nunique():
            return frame
        return filter_experts(frame, experts)

    def layer_routing(self, site: str, layer: int) -> pd.DataFrame:
        """The routing rows of one MoE layer."""
        return self.by_layer["routing"][(site, layer)]

    def layer_load(self, site: str, layer: int) -> pd.DataFrame:
        """The `expert_balance_frame` rows of one MoE layer."""
        return self.load[(self.load["layer"] == layer) & (self.load["site"] == site)]

    def layer_balance(self, site: str, layer: int) -> pd.Series:
        """The `balance_frame` row of one MoE layer."""
        return self.balance.loc[(site, layer)]


def build_routing_frames(trace: moeviz.Trace) -> RoutingFrames:
    """`RoutingFrames` of a trace."""
    routing = trace.routing_frame()
    scores = moeviz.charts.stack_scores({key: trace.scores_frame(key[1], key[0]) for key in trace.layer_keys})
    return RoutingFrames(
        routing=routing,
        scores=scores,
        confidence=moeviz.analysis.confidence_frame(trace),
        load=moeviz.analysis.expert_balance_frame(trace),
        balance=moeviz.analysis.balance_frame(trace).set_index(["site", "layer"]),
        by_layer={
            name: dict(list(frame.groupby(["site", "layer"], sort=False)))
            for name, frame in (("scores", scores), ("routing", routing))
        },
    )


SCORES_KEPT = 16  # (layer, experts) score tables a ScaleFrames keeps (~30k rows each at 1k tokens × 32)


class ScaleFrames:
    """The Routing page's frames at scale (over 20 experts: the N × E × L tables of `RoutingFrames` would be
    15 million rows at 256 experts × 61 layers × 1k tokens): per layer and expert load
    (`expert_balance_frame`, L × E rows) and the balance row of each layer, built at once; each layer's
    routing rows built on first use and kept; expert orders kept per sort. Read-only for the pages; shared
    by sessions (thread-safe)."""

    routing = None  # the whole routing table is not built at scale (its downloads build it on request)

    def __init__(self, trace: moeviz.Trace) -> None:
        self.trace = trace
        self.load = moeviz.analysis.expert_balance_frame(trace)
        self.balance = moeviz.analysis.balance_frame(trace).set_index(["site", "layer"])
        self._load_by_layer = dict(list(self.load.groupby(["site", "layer"], sort=False)))
        self._routing: dict[tuple[str, int], pd.DataFrame] = {}
        self._orders: dict[str, np.ndarray] = {}
        self._scores: collections.OrderedDict[tuple, pd.DataFrame] = collections.OrderedDict()
        self._lock = threading.Lock()

    def order(self, by: str) -> np.ndarray:
        """`expert_order` over all layers (load summed; co-activation pair counts summed), kept per `by`."""
        with self._lock:
            if by in self._orders:
                return self._orders[by]
        coactivation = coactivation_pair_counts(self.trace) if by == "coactivation" else None
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
        frame = layer_trace(self.trace, layer, site).routing_frame()
        with self._lock:
            return self._routing.setdefault(key, frame)

    def layer_scores(self, site: str, layer: int, experts: Sequence[int] | None = None) -> pd.DataFrame:
        """The `Trace.scores_frame` rows of one MoE layer for `experts`, kept for the SCORES_KEPT latest
        (layer, experts): a token click or a sort redraws a layer whose rows were built already."""
        key = (site, layer, None if experts is None else tuple(int(e) for e in experts))
        with self._lock:
            if key in self._scores:
                self._scores.move_to_end(key)
                return self._scores[key]
        frame = layer_scores_frame(self.trace, layer, site, experts)
        with self._lock:
            self._scores[key] = frame
            while len(self._scores) > SCORES_KEPT:
                self._scores.popitem(last=False)
        return frame


def frames_for(trace: moeviz.Trace) -> RoutingFrames | ScaleFrames:
    """The Routing page's frames of a trace: `ScaleFrames` when a layer has over 20 experts, else
    `RoutingFrames`."""
    return ScaleFrames(trace) if trace_at_scale(trace) else build_routing_frames(trace)


def layer_line(layer: int, balance: pd.Series) -> str:
    """One line about a MoE layer from its `balance_frame` row: experts, top-k and, where capacity dropped
    any, the dropped slots."""
    line = f"Layer {layer}: {int(balance['experts'])} experts, top-{int(balance['top_k'])}"
    dropped = int(balance["dropped"])
    if dropped:
        slots = int(balance["tokens"]) * int(balance["top_k"])
        fraction = balance["dropped_fraction"]
        line += f" · {dropped:,} of {slots:,} slots dropped by expert capacity ({fraction:.1%})"
    return line


def band_text(spread: dict[str, tuple[float, float, float]], name: str, fmt: str) -> str:
    """The text ". 90% bootstrap band: value (low–high)" of one indicator ("" without a band)."""
    if name not in spread:
        return ""
    value, low, high = spread[name]
    return f". 90% bootstrap band: {fmt.format(value)} ({fmt.format(low)}–{fmt.format(high)})"


CHARTS_KEPT = 24  # built charts a `ChartMemo` keeps (a few layers × sorts × chosen experts; small frames)


class ChartMemo:
    """The per-layer charts at scale already built, by everything they are built from: a sort back, a
    layer seen again or an interaction that leaves a chart's inputs alone (a sort and the token strip)
    reuses the chart instead of building it again. Least recently used dropped past `kept`. A chart is
    shown as it is (`exports.show_chart` only re-dresses it for the page), so reusing it is exact."""

    def __init__(self, kept: int = CHARTS_KEPT) -> None:
        self.kept = kept
        self.charts: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self.built = 0  # charts built (not reused), for the tests

    def get(self, key: tuple, build):
        """The chart of `key` (hashable: every input of the chart), `build()` on first use."""
        if key in self.charts:
            self.charts.move_to_end(key)
            return self.charts[key]
        chart = self.charts[key] = build()
        self.built += 1
        while len(self.charts) > self.kept:
            self.charts.popitem(last=False)
        return chart
