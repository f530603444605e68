"""The expert axis at scale (more than 20 experts): sort it (by id, load or the first principal component of
co-activation), filter it (top-N by load) and pick an expert by typing its id (a searchable picker); the
chosen expert survives page switches (`st.session_state["expert"]`, as `pickers.pick_expert`). Up to 20
experts the pages keep their 8-expert views and show none of this."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import altair as alt
import numpy as np
import pandas as pd
import streamlit as st

import moeviz
from components import exports
from components.widgets import kept, number
from moeviz.analysis import expert_options, expert_order
from moeviz.charts import MAX_CATEGORICAL, layer_expert_heatmap

TOP_N = 32  # experts the filtered views show by default
SORTS = {"id": "id", "load": "load (busiest first)", "coactivation": "co-activation (PC1)"}
ORDER_NAMES = {"coactivation": "co-activation PC1"}  # axis titles "experts by <name>" (else the key itself)


def at_scale(num_experts: int) -> bool:
    """Whether a model's expert axis needs the views at scale (more experts than a categorical legend)."""
    return num_experts > MAX_CATEGORICAL


def trace_at_scale(trace: moeviz.Trace) -> bool:
    """Whether any MoE layer of the trace has more than 20 experts."""
    return any(at_scale(routing.num_experts) for routing in trace.layers)


@dataclasses.dataclass(frozen=True)
class ExpertAxis:
    """order: every expert id in axis order; shown: the top-N by load in axis order, plus the chosen expert;
    expert: the chosen one; by: what the order is sorted by (a key of SORTS)."""

    order: list[int]
    shown: list[int]
    expert: int
    by: str

    @property
    def order_name(self) -> str:
        """What the axis is sorted by, for an axis title ("experts by <order_name>")."""
        return ORDER_NAMES.get(self.by, self.by)


def expert_axis(
    load: pd.DataFrame,
    coactivation: Callable[[], np.ndarray | pd.DataFrame] | None = None,
    label: str = "Expert",
) -> ExpertAxis:
    """Sort, top-N and expert picker in one row; → the axis. `load`: `expert_balance_frame` rows (one or
    several layers: summed); `coactivation()`: the co-activation matrix or frame, computed only when that
    order is chosen (without it, co-activation is not offered)."""
    sorts = [s for s in SORTS if s != "coactivation" or coactivation is not None]
    num_experts = int(load["expert"].max()) + 1 if len(load) else 0
    a, b, c = st.columns([2, 1, 3])
    with a:
        by = kept(
            "expert_sort",
            sorts,
            st.selectbox,
            "Sort experts by",
            sorts,
            format_func=SORTS.get,
            help="Co-activation: the first principal component of the co-activation matrix, so that "
            "experts chosen together sit side by side.",
        )
    with b:
        top_n = number(
            "Top-N by load",
            "expert_top_n",
            min(TOP_N, num_experts),
            1,
            max(num_experts, 1),
            help="Experts the per-expert views list (the busiest N, in the order chosen).",
        )
    order = expert_order(load, by=by, coactivation=coactivation() if by == "coactivation" else None)
    with c:
        expert = pick_expert(load, order, label)
    busiest = set(expert_order(load, by="load")[:top_n].tolist()) | {expert}
    shown = [int(e) for e in order if e in busiest]
    return ExpertAxis(order=[int(e) for e in order], shown=shown, expert=expert, by=by)


def pick_expert(
    load: pd.DataFrame, order: np.ndarray | None = None, label: str = "Expert", widget_key: str | None = None
) -> int:
    """A searchable expert picker (type an id): labels "id · slots · load against the fair share", in
    `order` (default busiest first); the choice is kept under `st.session_state["expert"]`. Pickers on one
    page need their own `widget_key`."""
    options = expert_options(load, order)
    ids = list(options.values())
    names = {e: name for name, e in options.items()}
    if st.session_state.get("expert") not in ids:  # start on the busiest expert
        st.session_state["expert"] = int(expert_order(load, by="load")[0]) if ids else None
    return int(
        kept(
            "expert",
            ids,
            st.selectbox,
            label,
            ids,
            widget_key=widget_key,
            format_func=names.get,
            help="Type an id to find it: id · slots dispatched · load against the fair share.",
        )
    )


def show_heatmap(
    frame: pd.DataFrame, value: str, axis: ExpertAxis | None, key: str, title: str | None = None
) -> None:
    """Show `layer_expert_heatmap` of `frame`'s `value` in `axis`'s order with its chosen expert highlighted
    (None: by id, nothing highlighted), on a canvas when large; `key` names the chart and its downloads."""
    heatmap = layer_expert_heatmap(
        frame,
        value,
        order=axis.order if axis else None,
        highlight=axis.expert if axis else None,
        order_name=axis.order_name if axis else "id",
        title=title,
    )
    exports.show_chart(exports.many_marks(heatmap, len(frame)), key)


def sort_axis(chart: alt.TopLevelMixin, ids: Sequence[int], *channels: str) -> alt.TopLevelMixin:
    """Put the experts of `chart`'s `channels` (default y) in the order `ids` (an ordinal expert axis of a
    chart that sorts by id), every label kept (no overlap removal). A chart, a layered chart (every layer
    with that channel) or a faceted one; changed in place and returned."""
    spec = chart.spec if isinstance(chart, alt.FacetChart) else chart
    views = list(spec.layer) if isinstance(spec, alt.LayerChart) else [spec]
    for view in views:
        for channel in channels or ("y",):
            has = view.encoding is not alt.Undefined
            encoding = getattr(view.encoding, channel, alt.Undefined) if has else alt.Undefined
            if encoding is alt.Undefined:
                continue
            # item access: a channel's attributes are altair's chained setters (`alt.Y(...).axis(...)`)
            encoding["sort"] = [int(e) for e in ids]
            axis = encoding._kwds.get("axis", alt.Undefined)
            if axis is alt.Undefined:
                axis = encoding["axis"] = alt.Axis()
            if axis is not None:
                axis["labelOverlap"] = False
                if channel == "x" and len(ids) > MAX_CATEGORICAL:  # ids side by side: upright, never touching
                    axis["labelAngle"] = -90
    return chart


def margin_caption(routing) -> str:
    """How the token's top-k margin is taken for this layer's router (`LayerRouting`)."""
    grouped = bool(routing.n_group and routing.n_group > 1 and routing.topk_group)
    on = "p + b (the selection scores)" if routing.bias is not None else "p"
    text = (
        "Top-k margin m = (min_{e∈S} s − max_{e∉S} s) / min_{e∈S} s: how far the weakest chosen expert beat "
        "the best rejected one (0 = a tie decided it)"
    )
    if grouped:
        return (
            f"{text}; group-limited router ({routing.n_group} groups of "
            f"{routing.num_experts // routing.n_group}, the best {routing.topk_group} chosen per token): "
            f"margin over the eligible experts of the chosen groups, on {on}."
        )
    return f"{text}; over all {routing.num_experts} experts, on {on}."
