"""The expert axis every per-expert view shares, at any number of experts: which experts a view lists, in
which order, and the chosen one; and `pick_expert`, the one expert picker.

Up to 20 experts (`scale.at_scale`) the axis is every expert by id and draws nothing. Above, one row of
controls: sort (by id, load or the first principal component of co-activation), a top-N filter by load and
the searchable expert picker; the views list the top-N (plus the chosen expert) in the order chosen. The
chosen expert survives page switches (`st.session_state["expert"]`).

A view that draws differently at scale is chosen here from the axis, so that pages draw one view at any
size: the layer × expert heatmap (labelled cells up to 20 experts, overview + brushed detail above:
`show_layer_expert_heatmap`) and one layer's load (bars, or a sorted curve: `load_chart`). `sort_axis` puts
a chart's expert axis in the axis order, every label kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import altair as alt
import numpy as np
import pandas as pd
import streamlit as st

from components import exports
from components.scale import at_scale
from components.widgets import kept, number
from moeviz.analysis import expert_options, expert_order
from moeviz.charts import (
    MAX_CATEGORICAL,
    expert_load_chart,
    expert_load_curve_chart,
    layer_expert_heatmap,
    load_heatmap,
    load_shift_heatmap,
)

TOP_N = 32  # experts the filtered views show by default
SORTS = {"id": "id", "load": "load (busiest first)", "coactivation": "co-activation (PC1)"}
ORDER_NAMES = {"coactivation": "co-activation PC1"}  # axis titles "experts by <name>" (else the key itself)
# Up to 20 experts, the layer × expert heatmap of each value is the library's labelled view of that value.
LABELLED_HEATMAPS = {"utilisation": load_heatmap, "load_change": load_shift_heatmap}


@dataclasses.dataclass(frozen=True)
class ExpertAxis:
    """order: every expert id in axis order; shown: the experts the per-expert views list (all of them up
    to 20 experts; above, the top-N by load in axis order, plus the chosen expert); expert: the chosen one
    (None up to 20 experts: there the axis has no picker); by: what the order is sorted by (a key of
    SORTS); num_experts: the experts of the model."""

    order: list[int]
    shown: list[int]
    expert: int | None
    by: str
    num_experts: int

    @classmethod
    def by_id(cls, num_experts: int) -> ExpertAxis:
        """Every expert by id, none chosen: the axis up to 20 experts."""
        ids = list(range(num_experts))
        return cls(order=ids, shown=ids, expert=None, by="id", num_experts=num_experts)

    def fitting(self, frame: pd.DataFrame) -> ExpertAxis:
        """This axis for a view of `frame`'s experts when they are the axis's, else every expert of `frame`
        by id (a second model with another number of experts)."""
        num_experts = int(frame["expert"].max()) + 1 if len(frame) else 0
        return self if num_experts == self.num_experts else ExpertAxis.by_id(num_experts)

    @property
    def at_scale(self) -> bool:
        """Whether the views at scale are drawn (more experts than a categorical legend lists)."""
        return at_scale(self.num_experts)

    @property
    def order_name(self) -> str:
        """What the axis is sorted by, for an axis title ("experts by <order_name>")."""
        return ORDER_NAMES.get(self.by, self.by)

    def shown_line(self, where: str = "") -> str:
        """The caption of a view that lists `shown`: "The N busiest of E experts<where> (top-N, and the
        chosen one), sorted by <order_name>" ("" up to 20 experts, where every expert is listed by id)."""
        if not self.at_scale:
            return ""
        return (
            f"The {len(self.shown)} busiest of {self.num_experts} experts{where} (top-N, and the chosen "
            f"one), sorted by {self.order_name}"
        )

    def shown_sentence(self, where: str = "", more: str = "") -> str:
        """`shown_line(where)` as a sentence, `more` before its full stop ("<line><more>. "); "" up to 20
        experts (every expert listed by id: nothing to say)."""
        line = self.shown_line(where)
        return f"{line}{more}. " if line else ""


def expert_axis(
    load: pd.DataFrame,
    coactivation: Callable[[], np.ndarray | pd.DataFrame] | None = None,
    label: str = "Expert",
) -> ExpertAxis:
    """The expert axis of the views of `load`'s experts: up to 20 experts, every expert by id (nothing
    drawn); above, sort, top-N and expert picker in one row. `load`: `expert_balance_frame` rows (one or
    several layers: summed); `coactivation()`: the co-activation matrix or frame, computed only when that
    order is chosen (without it, co-activation is not offered)."""
    num_experts = int(load["expert"].max()) + 1 if len(load) else 0
    if not at_scale(num_experts):
        return ExpertAxis.by_id(num_experts)
    a, b, c = st.columns([2, 1, 3])
    by, top_n, order = _sort_and_top_n(load, coactivation, a, b)
    with c:
        expert = pick_expert(load, order, label)
    return _axis(load, order, by, top_n, expert)


def ordered_axis(
    load: pd.DataFrame, expert: int, coactivation: Callable[[], np.ndarray | pd.DataFrame] | None = None
) -> ExpertAxis:
    """The expert axis at scale (over 20 experts) with its expert chosen apart (`pick_expert`, drawn before
    by the caller): sort and top-N in one row. A page can then draw these two and the views that list the
    experts in a fragment of their own, which a sort or a new top-N reruns alone, and the picker with the
    views that show the chosen expert outside it."""
    a, b, _ = st.columns([2, 1, 3])
    by, top_n, order = _sort_and_top_n(load, coactivation, a, b)
    return _axis(load, order, by, top_n, expert)


def _sort_and_top_n(load: pd.DataFrame, coactivation, a, b) -> tuple[str, int, np.ndarray]:
    """The sort picker in column `a`, the top-N in `b`; → (sort key, top-N, every expert in that order)."""
    num_experts = int(load["expert"].max()) + 1
    sorts = [s for s in SORTS if s != "coactivation" or coactivation is not None]
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
            num_experts,
            help="Experts the per-expert views list (the busiest N, in the order chosen).",
        )
    order = expert_order(load, by=by, coactivation=coactivation() if by == "coactivation" else None)
    return by, top_n, order


def _axis(load: pd.DataFrame, order: np.ndarray, by: str, top_n: int, expert: int) -> ExpertAxis:
    """The axis of `order` listing the `top_n` busiest experts and `expert`."""
    busiest = set(expert_order(load, by="load")[:top_n].tolist()) | {expert}
    shown = [int(e) for e in order if e in busiest]
    num_experts = int(load["expert"].max()) + 1
    return ExpertAxis(
        order=[int(e) for e in order], shown=shown, expert=expert, by=by, num_experts=num_experts
    )


def pick_expert(
    load: pd.DataFrame, order: np.ndarray | None = None, label: str = "Expert", widget_key: str | None = None
) -> int:
    """The expert picker, at any number of experts: searchable (type an id), labels "id · slots · load
    against the fair share", in `order` (default busiest first); starts on the busiest expert, and the
    choice is kept under `st.session_state["expert"]`. `load`: `expert_balance_frame` rows (one or several
    layers: summed). Pickers on one page need their own `widget_key`."""
    options = expert_options(load, order)
    ids = list(options.values())
    names = {e: name for name, e in options.items()}
    if st.session_state.get("expert") not in ids:
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


def caption_shown(axis: ExpertAxis, where: str = "", more: str = "") -> None:
    """Under a view of `axis.shown`, say which experts it lists (`ExpertAxis.shown_sentence`); nothing up to
    20 experts. Every page's per-expert view says it this one way."""
    sentence = axis.shown_sentence(where, more)
    if sentence:
        st.caption(sentence.strip())


def show_layer_expert_heatmap(
    frame: pd.DataFrame, value: str, axis: ExpertAxis, key: str, title: str | None = None
) -> None:
    """Show the layer × expert heatmap of `frame`'s `value` ("utilisation" of `expert_balance_frame` rows,
    or "load_change" of `expert_drift_frame` rows): up to 20 experts the library's labelled heatmap of that
    value; above, `layer_expert_heatmap` in `axis`'s order with its chosen expert outlined, on a canvas.
    `key` names the chart and its downloads."""
    if not axis.at_scale:
        exports.show_chart(LABELLED_HEATMAPS[value](frame, title=title), key)
        return
    heatmap = layer_expert_heatmap(
        frame, value, order=axis.order, highlight=axis.expert, order_name=axis.order_name, title=title
    )
    exports.show_chart(exports.many_marks(heatmap, len(frame)), key)


def load_chart(
    rows: pd.DataFrame,
    axis: ExpertAxis,
    *,
    title: str,
    bands: pd.DataFrame | None = None,
    dropped: int | None = None,
) -> alt.TopLevelMixin:
    """One layer's expert load (`expert_balance_frame` rows of the layer): up to 20 experts a bar per expert
    (and the `dropped` slots), above a curve of the experts sorted busiest first, the chosen expert marked;
    against the fair share, with the bootstrap `bands` when given."""
    if axis.at_scale:
        return expert_load_curve_chart(rows, highlight=axis.expert, title=title, bands=bands)
    return expert_load_chart(rows, dropped=dropped, title=title, bands=bands)


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
