"""Base vs fine-tuned views (`moeviz.analysis.finetune_diff.FinetuneDiff`): the experts whose load moved with
their bootstrap bands, the router-weight delta per layer, the balance before and after, and per domain the
experts that took it and the change in its specialisation score. (Router mismatch per layer is the engine
diff's view, `moeviz.charts.engines.layer_mismatch_chart` of `FinetuneDiff.routing.layers`.)

Each function draws the columns of one FinetuneDiff frame; nothing is computed beyond choosing, sorting and
labelling rows. No view has a mark per (layer, expert) of the whole model: the band charts show at most
`top` rows, so they stay legible at hundreds of experts.
"""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from moeviz.charts._common import FIT_WIDTH, INK, layer_labels, layered_chart

TOP = 20  # rows of a band chart
MOVED = "#d62728"  # a band that excludes 0
STILL = "#7f7f7f"  # a band that holds 0
ROW_HEIGHT = 16


def _band_chart(
    data: pd.DataFrame, flag: str, legend: dict[bool, str], *, x_title: str, title: str
) -> alt.LayerChart:
    """One row per `data.label`: a rule from shift_low to shift_high, a dot at shift coloured by `flag`, and
    a rule at 0; `data` keeps its order top to bottom."""
    data = data.assign(status=data[flag].map(legend))
    order = data["label"].tolist()
    y = alt.Y("label:N", sort=order, title=None, axis=alt.Axis(labelLimit=220))
    colour = alt.Color(
        "status:N",
        scale=alt.Scale(domain=[legend[True], legend[False]], range=[MOVED, STILL]),
        legend=alt.Legend(title=None, orient="bottom"),
    )
    tooltip = [
        alt.Tooltip("label:N", title="row"),
        alt.Tooltip("share_base:Q", format=".4f", title="share, base"),
        alt.Tooltip("share_tuned:Q", format=".4f", title="share, fine-tune"),
        alt.Tooltip("shift:Q", format="+.4f"),
        alt.Tooltip("shift_low:Q", format="+.4f", title="band low"),
        alt.Tooltip("shift_high:Q", format="+.4f", title="band high"),
    ]
    base = alt.Chart(data).encode(y=y, tooltip=tooltip)
    band = base.mark_rule(strokeWidth=2).encode(
        x=alt.X("shift_low:Q", title=x_title), x2=alt.X2("shift_high:Q"), color=colour
    )
    dot = base.mark_circle(size=60, opacity=1).encode(x="shift:Q", color=colour)
    zero = alt.Chart(pd.DataFrame({"zero": [0.0]})).mark_rule(color=INK, strokeDash=[3, 3]).encode(x="zero:Q")
    return layered_chart(
        zero, band, dot, title=title, height=max(ROW_HEIGHT * len(data), 60), autosize=FIT_WIDTH
    )


def _largest(frame: pd.DataFrame, flag: str, top: int) -> pd.DataFrame:
    """The rows flagged first, then by |shift|, at most `top`; rows without a band are left out."""
    rows = frame[frame["shift_low"].notna()]
    key = pd.DataFrame({"flag": rows[flag].astype(bool), "size": rows["shift"].abs()}, index=rows.index)
    order = key.sort_values(["flag", "size"], ascending=[False, False], kind="stable").index
    return rows.loc[order].head(top)


def load_shift_band_chart(load_shift: pd.DataFrame, *, top: int = TOP, level: float = 0.9) -> alt.LayerChart:
    """The experts whose load moved: the `top` (layer, expert) rows, those whose band excludes 0 first, then
    by |shift|; per row the shift f_tuned − f_base of its share of the layer's slots and its paired bootstrap
    band at `level`.

    Input: `FinetuneDiff.load_shift` (columns layer, site, expert, share_base, share_tuned, shift,
    shift_low, shift_high, moved)."""
    rows = _largest(load_shift, "moved", top)
    rows = rows.assign(
        label=[f"layer {lab} · expert {e}" for lab, e in zip(layer_labels(rows), rows["expert"], strict=True)]
    )
    legend = {True: f"moved ({level:.0%} band excludes 0)", False: "band holds 0"}
    return _band_chart(
        rows,
        "moved",
        legend,
        x_title="load shift (share of the layer's slots, fine-tune − base)",
        title="Experts whose load moved",
    )


def domain_took_chart(domain_shift: pd.DataFrame, *, top: int = TOP, level: float = 0.9) -> alt.LayerChart:
    """Which experts took a domain: the `top` (layer, domain, expert) rows, those that took it first (band
    above 0), then by |shift|; per row the change of the expert's share of the domain's slots and its band.

    Input: `FinetuneDiff.domain_shift` (columns layer, site, domain, expert, tokens, share_base,
    share_tuned, shift, shift_low, shift_high, took, left)."""
    rows = _largest(domain_shift, "took", top)
    rows = rows.assign(
        label=[
            f"{d} · layer {lab} · expert {e}"
            for d, lab, e in zip(rows["domain"], layer_labels(rows), rows["expert"], strict=True)
        ]
    )
    legend = {True: f"took the domain ({level:.0%} band above 0)", False: "did not"}
    return _band_chart(
        rows,
        "took",
        legend,
        x_title="shift of the expert's share of the domain's slots (fine-tune − base)",
        title="Experts that took a domain",
    )


def router_delta_chart(router_delta: pd.DataFrame) -> alt.LayerChart:
    """Per MoE layer, the router-weight delta relative to the base router, ‖ΔW‖_F / ‖W_base‖_F, as a bar
    with its rank written above it (a LoRA of rank r shows at most r; 0 = the router did not change).

    Input: `FinetuneDiff.router_delta` (columns layer, site, module, rows, cols, norm, base_norm, relative,
    rank, sigma_max)."""
    data = router_delta.assign(
        layer_label=layer_labels(router_delta), rank_text=[f"r={r}" for r in router_delta["rank"]]
    )
    order = data["layer_label"].tolist()
    x = alt.X("layer_label:N", sort=order, title="MoE layer", axis=alt.Axis(labelAngle=0))
    y = alt.Y("relative:Q", title="‖ΔW‖ / ‖W_base‖ of the router", scale=alt.Scale(zero=True))
    tooltip = [
        alt.Tooltip("layer_label:N", title="layer"),
        alt.Tooltip("module:N"),
        alt.Tooltip("norm:Q", format=".4g", title="‖ΔW‖_F"),
        alt.Tooltip("relative:Q", format=".4g", title="relative"),
        alt.Tooltip("rank:Q", title="rank of ΔW"),
        alt.Tooltip("sigma_max:Q", format=".4g", title="largest singular value"),
    ]
    base = alt.Chart(data).encode(x=x, y=y, tooltip=tooltip)
    bars = base.mark_bar(color="#4c78a8")
    text = base.mark_text(dy=-6, color=INK, fontSize=11).encode(text=alt.Text("rank_text:N"))
    return layered_chart(bars, text, title="Router-weight delta per layer", height=200, autosize=FIT_WIDTH)


def balance_change_chart(balance: pd.DataFrame) -> alt.LayerChart:
    """Per MoE layer, the largest expert share before (hollow) and after (filled) the fine-tune, joined by a
    rule; red where the collapse verdict got worse. The verdicts and the other indicators are in the
    tooltip.

    Input: `FinetuneDiff.balance` (columns layer, site, verdict_base, verdict_tuned, degraded,
    max_share_base, max_share_tuned, load_entropy_*, dead_fraction_*, reasons_tuned)."""
    data = balance.assign(
        layer_label=layer_labels(balance),
        status=np.where(balance["degraded"].astype(bool), "verdict worse", "verdict not worse"),
    )
    order = data["layer_label"].tolist()
    y = alt.Y("layer_label:N", sort=order, title="MoE layer")
    colour = alt.Color(
        "status:N",
        scale=alt.Scale(domain=["verdict worse", "verdict not worse"], range=[MOVED, STILL]),
        legend=alt.Legend(title=None, orient="bottom"),
    )
    tooltip = [
        alt.Tooltip("layer_label:N", title="layer"),
        alt.Tooltip("verdict_base:N", title="verdict, base"),
        alt.Tooltip("verdict_tuned:N", title="verdict, fine-tune"),
        alt.Tooltip("max_share_base:Q", format=".3f", title="max share, base"),
        alt.Tooltip("max_share_tuned:Q", format=".3f", title="max share, fine-tune"),
        alt.Tooltip("load_entropy_base:Q", format=".3f", title="load entropy, base"),
        alt.Tooltip("load_entropy_tuned:Q", format=".3f", title="load entropy, fine-tune"),
    ]
    base = alt.Chart(data).encode(y=y, tooltip=tooltip)
    x_title = "largest expert share of the layer's slots (base ○ → fine-tune ●)"
    rule = base.mark_rule(strokeWidth=2).encode(
        x=alt.X("max_share_base:Q", title=x_title), x2=alt.X2("max_share_tuned:Q"), color=colour
    )
    before = base.mark_point(size=60, filled=False, color=INK).encode(x="max_share_base:Q")
    after = base.mark_circle(size=60, opacity=1).encode(x="max_share_tuned:Q", color=colour)
    return layered_chart(
        rule,
        before,
        after,
        title="Balance before and after",
        height=max(ROW_HEIGHT * len(data), 60),
        autosize=FIT_WIDTH,
    )


def specialisation_change_heatmap(specialisation: pd.DataFrame) -> alt.LayerChart:
    """Layer × domain heatmap of the change in each domain's specialisation score, ds_tuned − ds_base (ds =
    max_e DS(e, D), the share of the domain's tokens its top expert receives): red = more specialised after
    the fine-tune, blue = less, white = unchanged; each cell says how many experts took the domain there.

    Input: `FinetuneDiff.specialisation` (columns layer, site, domain, tokens, baseline, top_expert_base,
    ds_base, lift_base, verdict_base, top_expert_tuned, ds_tuned, lift_tuned, verdict_tuned, ds_change,
    took)."""
    data = specialisation.assign(
        layer_label=layer_labels(specialisation),
        took_text=[("" if pd.isna(t) or t == 0 else f"{int(t)}") for t in specialisation["took"]],
    )
    peak = float(np.nanmax(np.abs(data["ds_change"].to_numpy(dtype=np.float64)))) if len(data) else 0.0
    peak = max(peak, 0.01)
    order = data.drop_duplicates(["layer", "site"])["layer_label"].tolist()
    x = alt.X("domain:N", title="domain", axis=alt.Axis(labelAngle=0))
    y = alt.Y("layer_label:N", sort=order, title="MoE layer")
    tooltip = [
        alt.Tooltip("layer_label:N", title="layer"),
        alt.Tooltip("domain:N"),
        alt.Tooltip("tokens:Q", format=","),
        alt.Tooltip("top_expert_base:Q", title="top expert, base"),
        alt.Tooltip("ds_base:Q", format=".3f", title="ds, base"),
        alt.Tooltip("verdict_base:N", title="verdict, base"),
        alt.Tooltip("top_expert_tuned:Q", title="top expert, fine-tune"),
        alt.Tooltip("ds_tuned:Q", format=".3f", title="ds, fine-tune"),
        alt.Tooltip("verdict_tuned:N", title="verdict, fine-tune"),
        alt.Tooltip("ds_change:Q", format="+.3f", title="change"),
        alt.Tooltip("took:Q", title="experts that took it"),
    ]
    base = alt.Chart(data).encode(x=x, y=y, tooltip=tooltip)
    cells = base.mark_rect().encode(
        color=alt.Color(
            "ds_change:Q",
            scale=alt.Scale(scheme="redblue", reverse=True, domain=[-peak, peak], domainMid=0),
            legend=alt.Legend(title="Δ specialisation", format="+.2f"),
        )
    )
    text = base.mark_text(color="black", fontSize=11).encode(text=alt.Text("took_text:N"))
    return layered_chart(
        cells,
        text,
        title="Specialisation change per domain (number = experts that took it)",
        height=max(22 * len(order), 80),
        autosize=FIT_WIDTH,
    )


__all__ = [
    "balance_change_chart",
    "domain_took_chart",
    "load_shift_band_chart",
    "router_delta_chart",
    "specialisation_change_heatmap",
]
