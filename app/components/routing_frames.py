"""The frames the Routing page slices on every interaction, built once per (model, text). No Streamlit."""

from __future__ import annotations

import dataclasses

import pandas as pd

import moeviz
import moeviz.analysis
import moeviz.charts


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

    def layer_scores(self, site: str, layer: int) -> pd.DataFrame:
        """The scores rows of one MoE layer (a 32k-token input has a million score rows: split once)."""
        return self.by_layer["scores"][(site, layer)]

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
