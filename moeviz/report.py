"""The routing health report: per MoE layer, the collapse verdict and the numbers behind it.

`build_report` makes the `RoutingReport` that `moeviz report` prints (its screens: moeviz.cli.report).
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
from moeviz.analysis.collapse import CollapseReport, CollapseThresholds
from moeviz.trace import Trace

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


@dataclass(frozen=True)
class RoutingReport:
    model: str
    tokens: int
    collapse: CollapseReport
    layers: pd.DataFrame  # one row per MoE layer, LAYER_KEYS (+ ep_balancedness, specialised_domains)
    domains: pd.DataFrame | None  # per (layer, site, domain) specialisation summary, when domains are known
    ep_balancedness_over_layers: float | None = None  # vLLM's Σ mean / Σ max, with --devices

    @property
    def verdict(self) -> str:
        return str(self.collapse.verdict)


def build_report(
    trace: Trace,
    seq_domains: Sequence[str] | None = None,
    thresholds: CollapseThresholds | None = None,
    devices: int | None = None,
) -> RoutingReport:
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
        b, loss, verdict = balance.loc[key], losses.loc[key], verdicts[key]
        row = {
            "layer": routing.layer,
            "site": routing.site,
            "tokens": int(b["tokens"]),
            "verdict": str(verdict.verdict),
            "status": verdict.status,  # judged | not enough tokens | no tokens (analysis.collapse)
            "aux_loss_topk": loss["aux_loss_topk"],
            "aux_loss_megatron": loss["aux_loss_megatron"],
            "aux_loss_top1": loss["aux_loss_top1"],
            "seq_aux_loss": loss["seq_aux_loss"],
            "z_loss": loss["z_loss"],
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
            "bias_std": loss["bias_std"],
            "bias_max_abs": loss["bias_max_abs"],
            "reasons": verdict.reasons + list(verdict.notes),
        }
        if devices is not None:
            row["ep_balancedness"] = b["ep_balancedness"]
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
        trace.model.source, len(trace.tokens), collapse, pd.DataFrame(rows), domains, over_layers
    )
