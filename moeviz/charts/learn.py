"""Views of the guided lesson (the app's Learn page): one token from logits to weights, the weights of
top-1 vs top-2, the per-expert terms of the auxiliary loss, load side by side across models, a biased vs
unbiased choice, routed vs shared experts, and held-out loss against the number of experts. Frames in,
`alt.Chart` out; sized to stay readable on a projector (1280 × 720)."""

from __future__ import annotations

from typing import Any, Literal

import altair as alt
import numpy as np
import pandas as pd

from moeviz.analysis.lesson import sweep_points
from moeviz.charts._common import FIT_WIDTH, INK, layered_chart
from moeviz.charts.routing import token_label

CHOSEN = "#f58518"  # the experts a token is sent to
OTHER = "#4c78a8"  # the rest
RULE = "#e4572e"  # fair share / balanced value
FONT = 13  # value labels, readable from the back of a room


def _value_labels(value: str, fmt: str, other, horizontal: bool = True) -> list[alt.Chart]:
    """Text marks at the end of each bar of `value` (bars along x when `horizontal`, else along y; `other`
    is the bars' category channel): past its end on either side of 0 (two marks, one per sign, so a label
    never sits on its own bar)."""
    channel = alt.X if horizontal else alt.Y
    marks = []
    for positive in (True, False):
        offset: dict[str, Any] = (
            {"dx": 4 if positive else -4} if horizontal else {"dy": -4 if positive else 4}
        )
        align: Literal["left", "right", "center"] = (
            ("left" if positive else "right") if horizontal else "center"
        )
        baseline: Literal["middle", "bottom", "top"] = (
            "middle" if horizontal else ("bottom" if positive else "top")
        )
        test = f"datum.{value} >= 0" if positive else f"datum.{value} < 0"
        marks.append(
            alt.Chart()
            .transform_filter(test)
            .mark_text(align=align, baseline=baseline, fontSize=FONT, color=INK, **offset)
            .encode(channel(f"{value}:Q"), other, text=alt.Text(f"{value}:Q", format=fmt))
        )
    return marks


def router_walkthrough_chart(
    walkthrough: pd.DataFrame, *, k: int, score_fn: str, title: str, row_height: int = 22
) -> alt.HConcatChart:
    """One token's way through the router, three panels side by side, one bar per expert with its number:
    ① the router logits, ② the scores p = score_fn(logits), ③ the weights after top-k, renormalised over
    the k chosen experts (0 for the others). Chosen experts in orange.

    Input: `moeviz.analysis.lesson.router_walkthrough(routing, row)` (columns expert, logit, score,
    chosen, weight)."""
    data = walkthrough[["expert", "logit", "score", "chosen", "weight"]].copy()
    data["status"] = np.where(data["chosen"], "chosen", "not chosen")
    y = alt.Y("expert:O", title="expert", axis=alt.Axis(labelFontSize=FONT, titleFontSize=FONT))
    colour = alt.Color(
        "status:N",
        scale=alt.Scale(domain=["chosen", "not chosen"], range=[CHOSEN, OTHER]),
        legend=alt.Legend(orient="bottom", title=None, labelFontSize=FONT),
    )
    panels = []
    lo, hi = min(float(data["logit"].min()), 0.0), max(float(data["logit"].max()), 0.0)
    pad = 0.35 * (hi - lo or 1.0)  # room for the value labels past the bars' ends, on both sides of 0
    steps = (
        ("logit", "① router logits", ".2f", [lo - pad if lo < 0 else 0.0, hi + pad]),
        ("score", f"② {score_fn} scores p", ".3f", [0, 1.3]),
        ("weight", f"③ top-{k}, renormalised w", ".3f", [0, 1.3]),
    )
    for field, heading, fmt, domain in steps:
        x = alt.X(
            f"{field}:Q",
            title=None,
            scale=alt.Scale(domain=domain, nice=False),
            axis=alt.Axis(labelFontSize=11, tickCount=4, labelFlush=True),
        )
        bars = (
            alt.Chart()
            .mark_bar()
            .encode(
                x=x,
                y=y,
                color=colour,
                tooltip=[
                    alt.Tooltip("expert:O"),
                    alt.Tooltip("logit:Q", format=".4f"),
                    alt.Tooltip("score:Q", format=".4f", title="score p"),
                    alt.Tooltip("weight:Q", format=".4f", title="weight w"),
                ],
            )
        )
        labels = _value_labels(field, fmt, y)
        panels.append(
            alt.layer(
                bars,
                *labels,
                data=data,
                title=alt.Title(heading, fontSize=14),
                width=175,
                height=row_height * len(data),
            )
        )
    return alt.hconcat(
        *panels,
        spacing=30,
        resolve=alt.Resolve(scale=alt.ScaleResolveMap(x="independent")),
        title=alt.Title(title, fontSize=15),
    )


def token_weights_chart(weights: pd.DataFrame, *, title: str, height: int = 170) -> alt.LayerChart:
    """Each token's combination weights stacked, one bar per token, one segment per chosen expert (the
    expert's id printed on it), 1st choice at the bottom.

    Input: one row per (token, slot): columns pos, token, rank (0 = largest weight), expert, weight."""
    data = weights[["pos", "token", "rank", "expert", "weight"]].copy()
    data["label"] = [token_label(int(p), t) for p, t in zip(data["pos"], data["token"], strict=True)]
    data["slot"] = [f"{_ordinal(int(r) + 1)} expert" for r in data["rank"]]
    order = list(dict.fromkeys(data.sort_values("pos")["label"]))
    slots = [f"{_ordinal(i)} expert" for i in range(1, int(data["rank"].max()) + 2)] if len(data) else []
    x = alt.X("label:N", title=None, sort=order, axis=alt.Axis(labelAngle=-50, labelFontSize=12))
    bars = (
        alt.Chart()
        .mark_bar(stroke="white", strokeWidth=1)
        .encode(
            x=x,
            y=alt.Y("weight:Q", title="combination weight", scale=alt.Scale(domain=[0, 1])),
            color=alt.Color(
                "slot:N",
                scale=alt.Scale(domain=slots, range=[CHOSEN, OTHER, "#54a24b", "#b279a2"][: len(slots)]),
                legend=None,
            ),
            order=alt.Order("rank:Q"),
            tooltip=[
                alt.Tooltip("label:N", title="token"),
                alt.Tooltip("slot:N"),
                alt.Tooltip("expert:O"),
                alt.Tooltip("weight:Q", format=".3f"),
            ],
        )
    )
    text = (
        alt.Chart()
        .mark_text(color="white", fontSize=12, fontWeight="bold")
        .encode(
            x=x,
            y=alt.Y("mid:Q"),
            text=alt.Text("expert:O"),
        )
        .transform_stack(stack="weight", groupby=["label"], as_=["lo", "hi"], sort=[{"field": "rank"}])
        .transform_calculate(mid="(datum.lo + datum.hi) / 2")
        .transform_filter("datum.weight >= 0.08")
    )
    return layered_chart(
        bars,
        text,
        data=data,
        title=alt.Title(
            title, subtitle="one segment per expert the token is sent to, its id printed on it; orange = 1st"
        ),
        height=height,
        autosize=FIT_WIDTH,
    )


def _ordinal(n: int) -> str:
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n if n < 20 else n % 10, 'th') }"


def aux_terms_chart(terms: pd.DataFrame, *, k: int, title: str, height: int = 190) -> alt.LayerChart:
    """Bars of each expert's term E · f_e · P_e of the auxiliary loss (its value printed), and a dashed
    rule at k/E, every term when load and probability are even (the terms then sum to the balanced value k).

    Input: `moeviz.analysis.lesson.aux_loss_terms(routing)` (columns expert, f, P, term)."""
    data = terms[["expert", "f", "P", "term"]].astype({"f": float, "P": float, "term": float}).copy()
    num_experts = len(data)
    data["balanced"] = k / num_experts if num_experts else np.nan
    data["over"] = np.where(data["term"] > data["balanced"], "above the even value", "at or below it")
    x = alt.X("expert:O", axis=alt.Axis(labelAngle=0, labelFontSize=FONT, titleFontSize=FONT))
    bars = (
        alt.Chart()
        .mark_bar()
        .encode(
            x=x,
            y=alt.Y("term:Q", title="E · f · P", axis=alt.Axis(labelFontSize=12, titleFontSize=FONT)),
            color=alt.Color(
                "over:N",
                scale=alt.Scale(domain=["above the even value", "at or below it"], range=[CHOSEN, OTHER]),
                legend=None,
            ),
            tooltip=[
                alt.Tooltip("expert:O"),
                alt.Tooltip("f:Q", format=".3f", title="f (share of tokens with e in top-k)"),
                alt.Tooltip("P:Q", format=".3f", title="P (mean probability)"),
                alt.Tooltip("term:Q", format=".4f", title="E·f·P"),
            ],
        )
    )
    labels = _value_labels("term", ".3f", x, horizontal=False)
    rule = (
        alt.Chart()
        .mark_rule(color=RULE, strokeDash=[6, 4], strokeWidth=2)
        .encode(y="max(balanced):Q", tooltip=[alt.Tooltip("max(balanced):Q", format=".4f", title="k/E")])
    )
    return layered_chart(
        bars,
        *labels,
        rule,
        data=data,
        title=alt.Title(
            title,
            subtitle=f"dashed line: k/E = {k}/{num_experts}, each term under even load; orange = above it",
        ),
        height=height,
        autosize=FIT_WIDTH,
    )


def aux_terms_compare_chart(terms: pd.DataFrame, *, k: int, k_captured: int, title: str) -> alt.LayerChart:
    """Each expert's term E · f_e · P_e of the auxiliary loss for the captured and the re-routed routing side
    by side (grey and orange bars), and a dashed rule at each one's even value k/E. Over 20 experts every
    16th expert id is labelled.

    Input: `RerouteResult.aux_terms_frame()` (columns expert, term_captured, term)."""
    wide = terms[["expert", "term_captured", "term"]].astype({"term_captured": float, "term": float})
    data = wide.rename(columns={"term_captured": "captured", "term": "re-routed"}).melt(
        "expert", var_name="routing", value_name="term"
    )
    num_experts = len(wide)
    routings = ["captured", "re-routed"]
    data["even"] = np.where(data["routing"] == "captured", k_captured, k) / max(num_experts, 1)
    colour = alt.Color(
        "routing:N",
        scale=alt.Scale(domain=routings, range=["#9d9d9d", CHOSEN]),
        legend=alt.Legend(title=None),
    )
    # over 20 experts (256: bars a few pixels wide) a labelled tick every 16th expert, not 256 labels
    ticks = alt.Undefined if num_experts <= 20 else list(range(0, num_experts, 16))
    x = alt.X("expert:O", axis=alt.Axis(labelAngle=0, labelOverlap=False, labelFontSize=12, values=ticks))
    bars = (
        alt.Chart()
        .mark_bar()
        .encode(
            x=x,
            xOffset=alt.XOffset("routing:N", sort=routings),
            y=alt.Y("term:Q", title="E · f · P"),
            color=colour,
            tooltip=[
                alt.Tooltip("expert:O"),
                alt.Tooltip("routing:N"),
                alt.Tooltip("term:Q", format=".4f", title="E·f·P"),
            ],
        )
    )
    rules = (
        alt.Chart()
        .mark_rule(strokeDash=[6, 4], strokeWidth=1.5)
        .transform_aggregate(even="max(even)", groupby=["routing"])
        .encode(
            y="even:Q",
            color=colour,
            tooltip=[alt.Tooltip("routing:N"), alt.Tooltip("even:Q", format=".4f", title="k/E")],
        )
    )
    return layered_chart(
        bars,
        rules,
        data=data,
        title=alt.Title(
            title, subtitle=f"dashed: k/E, each term under even load (captured k = {k_captured})"
        ),
        height=220,
        autosize=FIT_WIDTH,
    )


def load_side_by_side_chart(
    load: pd.DataFrame, *, title: str, width: int = 210, height: int = 150
) -> alt.FacetChart:
    """Small multiples: one panel per model (in the frame's order), bars of each expert's share of the
    layer's kT slots, and a dashed rule at the fair share 1/E.

    Input: one row per (model, expert): columns model, expert, share, count (e.g. the rows of
    `moeviz.analysis.expert_balance_frame` for one layer of each model, with a model column)."""
    data = load[["model", "expert", "share", "count"]].astype({"share": float}).copy()
    per_model = data.groupby("model", sort=False)["expert"].transform("count")
    data["fair"] = 1.0 / per_model
    models = list(dict.fromkeys(data["model"]))
    x = alt.X("expert:O", axis=alt.Axis(labelAngle=0, labelFontSize=12))
    bars = (
        alt.Chart()
        .mark_bar(color=OTHER)
        .encode(
            x=x,
            y=alt.Y(
                "share:Q",
                title="share of slots",
                axis=alt.Axis(format="%", labelFontSize=12, titleFontSize=FONT),
            ),
            tooltip=[
                alt.Tooltip("model:N"),
                alt.Tooltip("expert:O"),
                alt.Tooltip("count:Q", title="slots"),
                alt.Tooltip("share:Q", format=".1%"),
            ],
        )
    )
    rule = (
        alt.Chart()
        .mark_rule(color=RULE, strokeDash=[6, 4], strokeWidth=2)
        .encode(y="max(fair):Q", tooltip=[alt.Tooltip("max(fair):Q", format=".1%", title="fair share 1/E")])
    )
    return (
        alt.layer(bars, rule, data=data, width=width, height=height)
        .facet(
            column=alt.Column(
                "model:N",
                sort=models,
                title=None,
                header=alt.Header(labelFontSize=14, labelFontWeight="bold"),
            )
        )
        .properties(title=alt.Title(title, subtitle="dashed line: the fair share 1/E"))
    )


def choice_load_chart(load: pd.DataFrame, *, title: str, height: int = 190) -> alt.LayerChart:
    """Grouped bars of each expert's load under two routings (e.g. with and without a balancing bias), and
    a dashed rule at the fair share kT/E.

    Input: one row per (routing, expert): columns routing (two labels, the first drawn in orange), expert,
    count, fair (kT/E)."""
    data = load[["routing", "expert", "count", "fair"]].copy()
    routings = list(dict.fromkeys(data["routing"]))
    x = alt.X("expert:O", axis=alt.Axis(labelAngle=0, labelFontSize=12, titleFontSize=FONT))
    bars = (
        alt.Chart()
        .mark_bar()
        .encode(
            x=x,
            xOffset=alt.XOffset("routing:N", sort=routings),
            y=alt.Y(
                "count:Q", title="tokens dispatched", axis=alt.Axis(labelFontSize=12, titleFontSize=FONT)
            ),
            color=alt.Color(
                "routing:N",
                scale=alt.Scale(domain=routings, range=[CHOSEN, OTHER]),
                legend=alt.Legend(orient="top", title=None, labelFontSize=FONT),
            ),
            tooltip=[alt.Tooltip("routing:N"), alt.Tooltip("expert:O"), alt.Tooltip("count:Q")],
        )
    )
    rule = (
        alt.Chart()
        .mark_rule(color=RULE, strokeDash=[6, 4], strokeWidth=2)
        .encode(y="max(fair):Q", tooltip=[alt.Tooltip("max(fair):Q", format=".1f", title="fair share kT/E")])
    )
    return layered_chart(
        bars,
        rule,
        data=data,
        title=alt.Title(title, subtitle="dashed line: the fair share kT/E"),
        height=height,
        autosize=FIT_WIDTH,
    )


def shared_experts_chart(shares: pd.DataFrame, *, k: int, title: str, height: int = 190) -> alt.LayerChart:
    """Bars of the share of a layer's tokens each expert processes: the shared expert(s) at 100%, each
    routed expert at c_e / T; a dashed rule at k/E, a routed expert's share when the load is even.

    Input: `moeviz.analysis.lesson.expert_token_share(routing)` (columns expert, kind, tokens, share)."""
    data = shares[["expert", "kind", "tokens", "share"]].astype({"share": float}).copy()
    routed = int((data["kind"] == "routed").sum())
    data["even"] = k / routed if routed else np.nan
    order = list(data["expert"])
    x = alt.X("expert:N", sort=order, axis=alt.Axis(labelAngle=0, labelFontSize=12, titleFontSize=FONT))
    bars = (
        alt.Chart()
        .mark_bar()
        .encode(
            x=x,
            y=alt.Y(
                "share:Q",
                title="share of the tokens",
                scale=alt.Scale(domain=[0, 1]),
                axis=alt.Axis(format="%", labelFontSize=12, titleFontSize=FONT),
            ),
            color=alt.Color(
                "kind:N",
                scale=alt.Scale(domain=["shared", "routed"], range=[CHOSEN, OTHER]),
                legend=None,
            ),
            tooltip=[
                alt.Tooltip("expert:N"),
                alt.Tooltip("kind:N"),
                alt.Tooltip("tokens:Q"),
                alt.Tooltip("share:Q", format=".1%"),
            ],
        )
    )
    rule = (
        alt.Chart()
        .mark_rule(color=RULE, strokeDash=[6, 4], strokeWidth=2)
        .encode(y="max(even):Q", tooltip=[alt.Tooltip("max(even):Q", format=".1%", title="k/E")])
    )
    return layered_chart(
        bars,
        rule,
        data=data,
        title=alt.Title(
            title,
            subtitle=f"orange: shared; dashed line: k/E = {k}/{routed}, a routed expert's share when even",
        ),
        height=height,
        autosize=FIT_WIDTH,
    )


def experts_sweep_chart(
    sweep: pd.DataFrame, *, title: str = "Held-out loss vs number of experts", height: int = 260
) -> alt.LayerChart:
    """Held-out loss against the number of experts (log₂ axis), one line per k through the mean over seeds,
    a vertical bar from the lowest to the highest seed at each point (the noise the lesson's notice judges
    the curves against), and a red ring round each point where a run collapsed (tooltip: which seed, at
    which step).

    Input: the experts sweep table (columns experts, k, heldout_loss; optionally seed and collapse_step;
    other columns are ignored), summarised by `moeviz.analysis.lesson.sweep_points` (one row per (k,
    experts), the one dataset of the chart)."""
    data = sweep_points(sweep).assign(k=lambda d: "k = " + d["k"].astype(str))
    data["collapsed"] = data["collapses"] != ""
    experts = sorted(data["experts"].unique().tolist())
    x = alt.X(
        "experts:Q",
        title="experts (log₂ scale)",
        scale=alt.Scale(type="log", base=2),
        axis=alt.Axis(values=experts, format="d", labelFontSize=12, titleFontSize=FONT),
    )
    y = alt.Y(
        "heldout_loss:Q",
        title="held-out loss (nats/token)",
        scale=alt.Scale(zero=False),
        axis=alt.Axis(labelFontSize=12, titleFontSize=FONT),
    )
    colour = alt.Color("k:N", legend=alt.Legend(orient="top", title=None, labelFontSize=FONT))
    tooltip = [
        alt.Tooltip("experts:Q"),
        alt.Tooltip("k:N"),
        alt.Tooltip("heldout_loss:Q", format=".3f", title="mean held-out loss"),
        alt.Tooltip("lowest:Q", format=".3f", title="lowest seed"),
        alt.Tooltip("highest:Q", format=".3f", title="highest seed"),
        alt.Tooltip("seeds:Q"),
        alt.Tooltip("collapses:N", title="collapsed"),
    ]
    base = alt.Chart().encode(x=x, y=y, color=colour, tooltip=tooltip)
    spread = (
        alt.Chart()
        .transform_filter("datum.seeds > 1")
        .mark_rule(strokeWidth=2, opacity=0.45)
        .encode(x=x, y=alt.Y("lowest:Q"), y2=alt.Y2("highest:Q"), color=colour, tooltip=tooltip)
    )
    rings = (
        alt.Chart()
        .transform_filter("datum.collapsed")
        .mark_point(shape="circle", size=420, strokeWidth=2.5, color=RULE, filled=False)
        .encode(x=x, y=y, tooltip=tooltip)
    )
    return layered_chart(
        base.mark_line(strokeWidth=2),
        spread,
        base.mark_point(filled=True, size=70),
        rings,
        data=data,
        title=alt.Title(
            title,
            subtitle="lines: mean over seeds; bars: lowest to highest seed; red ring: a run collapsed there",
        ),
        height=height,
        autosize=FIT_WIDTH,
    )
