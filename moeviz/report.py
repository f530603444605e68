"""The routing health report: per MoE layer, the collapse verdict and the numbers behind it.

`build_report` makes the `RoutingReport` that `moeviz report` prints (its screens: moeviz.cli.report), from a
Trace (captured, or imported from an engine) or from an engine's expert counts (an `ExpertLoad`): one report
shape for all three, with the numbers a source cannot give (no router scores, no tokens) null and named in
its notes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from moeviz.analysis import (
    balance_frame,
    collapse_report,
    ep_balancedness_over_layers,
    expert_domain_specialisation,
    loss_frame,
    trace_device_load,
)
from moeviz.analysis.balance import load_balance_frame, load_device_load, routed_counts
from moeviz.analysis.collapse import CollapseReport, CollapseThresholds, LayerVerdict, load_collapse_report
from moeviz.trace import ExpertLoad, Trace

# Per-layer keys, in output order. The balance keys are `balance_frame`'s columns, with its names and
# definitions (docs/routing-metrics.md): shares f = c/(kT) with dropped slots in kT, dropped slots their own
# quantity; cv (population std) and gini textbook; cv_unbiased (ddof 1) as NeMo, Megatron-Core and
# TensorRT-LLM log CV, gini_megatron (gini − 1/E) as Megatron-Core logs Gini.
# Each auxiliary loss is named by its form (moeviz.analysis.AUX_LOSS_FORMS), unscaled (α = 1):
# aux_loss_topk as transformers' load_balancing_loss_func computes it (k when perfectly balanced),
# aux_loss_megatron = aux_loss_topk / k as Megatron-Core logs it and aux_loss_top1 (1 when balanced),
# seq_aux_loss DeepSeek-V3's sequence-wise form, mean over sequences (1 when balanced).
LAYER_KEYS = [
    "layer",
    "site",
    "tokens",
    "verdict",
    "status",
    "aux_loss_topk",
    "aux_loss_megatron",
    "aux_loss_top1",
    "seq_aux_loss",
    "z_loss",
    "load_entropy",
    "effective_experts",
    "max_share",
    "min_utilisation",
    "max_utilisation",
    "dead_fraction",
    "dropped",
    "dropped_fraction",
    "max_vio",
    "cv",
    "cv_unbiased",
    "gini",
    "gini_megatron",
    "jain",
    "bias_std",
    "bias_max_abs",
    "reasons",
]


# The keys computed from router scores (logits) or the router's bias: null where the routing has none — an
# engine's routing imported without logits (`LayerRouting.has_logits` False), or a load table.
SCORE_KEYS = ["aux_loss_topk", "aux_loss_megatron", "aux_loss_top1", "seq_aux_loss", "z_loss"]
BIAS_KEYS = ["bias_std", "bias_max_abs"]
# Load tables whose steps are sequences (the verdicts then count each step's tokens as one sequence's).
STEPS_ARE_SEQUENCES = frozenset({"moe-infinity"})


@dataclass(frozen=True)
class RoutingReport:
    """The report of one routing: a Trace (captured, or imported by `moeviz import`) or an ExpertLoad (an
    engine's counts). `notes` say which numbers the routing cannot give (no router scores, no tokens)."""

    model: str
    tokens: int
    collapse: CollapseReport
    layers: pd.DataFrame  # one row per MoE layer, LAYER_KEYS (+ ep_balancedness, specialised_domains)
    domains: pd.DataFrame | None  # per (layer, site, domain) specialisation summary, when domains are known
    ep_balancedness_over_layers: float | None = None  # vLLM's Σ mean / Σ max, with --devices
    notes: tuple[str, ...] = ()

    @property
    def verdict(self) -> str:
        return str(self.collapse.verdict)


def build_report(
    trace: Trace | ExpertLoad,
    seq_domains: Sequence[str] | None = None,
    thresholds: CollapseThresholds | None = None,
    devices: int | None = None,
) -> RoutingReport:
    """The report of a Trace, or of an ExpertLoad (`build_load_report`; it has no sequences, so no
    `seq_domains`). `devices` = D adds expert-parallel balancedness (ValueError unless D divides E)."""
    if isinstance(trace, ExpertLoad):
        if seq_domains is not None:
            raise ValueError("a load table has no sequences to give domains to")
        return build_load_report(trace, thresholds, devices)
    collapse = collapse_report(trace, thresholds)
    balance = balance_frame(trace, devices).set_index(["site", "layer"])
    losses = loss_frame(trace).set_index(["site", "layer"])
    verdicts = {(lv.site, lv.layer): lv for lv in collapse.layers}
    domains = None
    if seq_domains is not None:
        domains = expert_domain_specialisation(trace, seq_domains).summary
    rows = []
    for routing in trace.layers:
        key = routing.key
        row = _layer_row(
            routing.layer, routing.site, balance.loc[key], losses.loc[key], verdicts[key], devices
        )
        if domains is not None:
            mine = domains[(domains.layer == routing.layer) & (domains.site == routing.site)]
            row["specialised_domains"] = [
                f"{r.domain}→e{int(r.top_expert)} (DS {r.ds:.2f} vs {r.baseline:.2f})"
                for r in mine.itertuples()
                if r.verdict == "specialised"
            ]
        rows.append(row)
    over_layers = None if devices is None else ep_balancedness_over_layers(trace_device_load(trace, devices))
    return RoutingReport(
        trace.model.source,
        len(trace.tokens),
        collapse,
        pd.DataFrame(rows),
        domains,
        over_layers,
        _trace_notes(trace),
    )


def build_load_report(
    load: ExpertLoad, thresholds: CollapseThresholds | None = None, devices: int | None = None
) -> RoutingReport:
    """The report of an ExpertLoad: the same RoutingReport (LAYER_KEYS per layer) from each layer's counts
    summed over the steps; SCORE_KEYS and BIAS_KEYS are NaN (null in JSON) and `notes` say why. `tokens` is
    the most tokens any layer routed (Σ_e c_e / k)."""
    sequences = load.source in STEPS_ARE_SEQUENCES
    collapse = load_collapse_report(load, thresholds, steps_are_sequences=sequences)
    balance = load_balance_frame(load, devices).set_index(["site", "layer"])
    nan = float("nan")
    no_losses = pd.Series({key: nan for key in SCORE_KEYS + BIAS_KEYS})
    rows = [
        _layer_row(lv.layer, lv.site, balance.loc[(lv.site, lv.layer)], no_losses, lv, devices)
        for lv in collapse.layers
    ]
    over_layers = None if devices is None else ep_balancedness_over_layers(load_device_load(load, devices))
    tokens = int(balance["tokens"].max()) if len(balance) else 0
    steps = load.counts.shape[0]
    notes = [
        f"a load table of {load.source} ({steps} step(s), expert counts without tokens): each layer's tokens "
        f"= Σ counts / k; {', '.join(SCORE_KEYS + BIAS_KEYS)} need router scores and are null, and the "
        "z-loss and bias rules of the verdict are not applied",
        "each step is one sequence: the verdicts count a sequence's tokens as correlated, as for a trace"
        if sequences
        else "the load table does not say which tokens share a sequence: the verdicts take its tokens as "
        "independent, which can call one text's uneven routing significant",
    ]
    return RoutingReport(
        load.model.source, tokens, collapse, pd.DataFrame(rows), None, over_layers, tuple(notes)
    )


def _layer_row(
    layer: int, site: str, b: pd.Series, loss: pd.Series, verdict: LayerVerdict, devices: int | None
) -> dict[str, object]:
    """One row of RoutingReport.layers (LAYER_KEYS, + ep_balancedness with `devices`)."""
    row = {
        "layer": layer,
        "site": site,
        "tokens": int(b["tokens"]),
        "verdict": str(verdict.verdict),
        "status": verdict.status,  # judged | not enough tokens | no tokens (analysis.collapse)
        **{key: loss[key] for key in SCORE_KEYS},
        "load_entropy": b["load_entropy"],
        "effective_experts": b["effective_experts"],
        "max_share": b["max_share"],
        "min_utilisation": b["min_utilisation"],
        "max_utilisation": b["max_utilisation"],
        "dead_fraction": b["dead_fraction"],
        "dropped": int(b["dropped"]),
        "dropped_fraction": b["dropped_fraction"],
        "max_vio": b["max_vio"],
        "cv": b["cv"],
        "cv_unbiased": b["cv_unbiased"],
        "gini": b["gini"],
        "gini_megatron": b["gini_megatron"],
        "jain": b["jain"],
        **{key: loss[key] for key in BIAS_KEYS},
        "reasons": verdict.reasons + list(verdict.notes),
    }
    row = {key: row[key] for key in LAYER_KEYS}
    if devices is not None:
        row["ep_balancedness"] = b["ep_balancedness"]
    return row


def _trace_notes(trace: Trace) -> tuple[str, ...]:
    """What the routing's source and the family's rules mean for the numbers: router logits absent (an
    engine import), the captured sub-model of a composite, hash-routed layers, zero-computation experts."""
    notes = []
    if trace.model.language_model:
        notes.append(f"text model captured: {trace.model.language_model}")
    missing = [r for r in trace.layers if not r.has_logits]
    if missing:
        sources = ", ".join(dict.fromkeys(r.decision_source for r in missing))
        which = "every MoE layer" if len(missing) == len(trace.layers) else f"{len(missing)} MoE layer(s)"
        notes.append(
            f"router logits absent in {which} (routing from {sources}): {', '.join(SCORE_KEYS)} need router "
            "scores and are null there, and the verdict's z-loss rule is not applied; the verdict judges the "
            "load"
        )
    hashed = [r.layer for r in trace.layers if r.hash_routed]
    if hashed:
        notes.append(
            f"layer(s) {', '.join(map(str, hashed))} choose experts by a fixed token-id table (hash "
            "routing): their router scores only weight the chosen experts; margins do not explain the choice"
        )
    zero = [r for r in trace.layers if r.zero_experts]
    if zero:
        slots = sum(r.experts.size for r in zero)
        skipped = sum(routed_counts(r)[1] for r in zero)
        notes.append(
            f"{zero[0].zero_experts} zero-computation expert(s) per layer: {skipped / slots:.1%} of the "
            "slots went there (compute skipped); loads, dead experts and balance count the routed experts"
        )
    return tuple(notes)
