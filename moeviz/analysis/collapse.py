"""Collapse verdicts: "healthy" / "warning" / "collapsed" per MoE layer and for the model, with reasons.

Indicators (shared/docs/routing-metrics.md, "Collapse indicators"): max share → 1, dead fraction ↑,
normalised load entropy ↓, logit magnitude (z-loss) ↑, bias spread ↑. Thresholds live in
`CollapseThresholds`; `Verdict` is ordered so a CLI can gate with `report.verdict >= Verdict.parse(arg)`
(`--fail-on warning|collapsed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import pandas as pd

from moeviz.analysis.load import BalanceStats, balance_stats
from moeviz.analysis.losses import BIAS_ABS_FLAG, BIAS_STD_FLAG, BiasStats, bias_stats, z_loss
from moeviz.trace import LayerRouting, Trace


class Verdict(IntEnum):
    """Ordered severity: HEALTHY < WARNING < COLLAPSED; str() gives the lower-case name."""

    HEALTHY = 0
    WARNING = 1
    COLLAPSED = 2

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str | Verdict) -> Verdict:
        """'healthy' | 'warning' | 'collapsed' (any case) → Verdict; ValueError listing the choices."""
        if isinstance(text, Verdict):
            return text
        try:
            return cls[str(text).strip().upper()]
        except KeyError:
            choices = ", ".join(str(v) for v in cls)
            raise ValueError(f"unknown verdict {text!r}; expected one of: {choices}") from None

    @classmethod
    def choices(cls) -> list[str]:
        return [str(v) for v in cls]


@dataclass(frozen=True)
class CollapseThresholds:
    """When a layer is called "warning" or "collapsed". Change with `dataclasses.replace(t, field=...)`.

    Load rules (judged only when the layer saw at least `min_slots_per_expert` slots per expert, kT/E ≥ 5):
    - max share f_max = max_e c_e / (kT). warning when f_max > warning_share_factor / E (2.5: one expert
      doing 2.5× its fair share, i.e. MaxVio > 1.5 — its expert-parallel device is 2.5× the average, while
      balanced routers stay well under MaxVio 1 on a sizable batch). collapsed when f_max >
      max(collapsed_max_share, warning_share_factor / E): one expert does more work than all others together
      (the max keeps "collapsed" above "warning" for small E). f_max is capped at 1/k, so this absolute rule
      can only fire for top-1 routers; a collapsing top-k router shows in the dead fraction and the entropy.
    - dead fraction (experts with no token): warning ≥ 0.25, collapsed ≥ 0.5 — a quarter / half of the
      layer's expert parameters doing nothing. With ≥ 5 fair-share slots per expert, a fairly routed expert
      is empty by chance with probability ≈ e^-5 < 1%, so a quarter of them never is.
    - normalised load entropy H(f)/log E: warning < 0.85, collapsed < 0.6. In effective experts E^h:
      for E = 8, 0.85 ≈ 5.9 and 0.6 ≈ 3.5 of 8 experts used; for E = 64, ≈ 34 and ≈ 12. Finite-sample bias
      at 5 slots per expert lowers the entropy of truly uniform routing by only ≈ 0.05.
    Router rules (always judged), warning only — they precede collapse rather than constitute it:
    - bias std > 1 or max |bias| > 5: Megatron-Core's flags for a balancing bias that is fighting the router.
    - z-loss > 100, i.e. RMS log-partition > 10: at |logit| ≈ 8–16 bf16 resolves steps of 1/16, enough to
      move near-tied probabilities by ~6% and flip top-k decisions (the instability ST-MoE's z-loss targets).
      Uniform zero logits give (log E)², 4.3 for E = 8 and 31 for E = 256; the trained samples measure
      6–33 on their evaluation slices (mixtral-healthy 9–13, mixtral-collapsed up to 33).
    Notes (no verdict): more than `note_dropped_fraction` of the slots dropped by capacity — the load rules
    then see the load after dropping, which capacity has already flattened.
    """

    warning_share_factor: float = 2.5
    collapsed_max_share: float = 0.5
    warning_dead_fraction: float = 0.25
    collapsed_dead_fraction: float = 0.5
    warning_load_entropy: float = 0.85
    collapsed_load_entropy: float = 0.6
    warning_bias_std: float = BIAS_STD_FLAG
    warning_bias_abs: float = BIAS_ABS_FLAG
    warning_z_loss: float = 100.0
    min_slots_per_expert: float = 5.0
    note_dropped_fraction: float = 0.1


@dataclass(frozen=True)
class Finding:
    """One triggered rule: its level and the fact in words."""

    level: Verdict
    text: str


@dataclass(frozen=True)
class LayerVerdict:
    """Verdict of one MoE layer with the findings that led to it and notes (e.g. too few tokens to judge)."""

    layer: int
    site: str
    verdict: Verdict
    findings: tuple[Finding, ...]
    notes: tuple[str, ...]
    balance: BalanceStats
    z_loss: float
    bias: BiasStats | None

    @property
    def label(self) -> str:
        return f"layer {self.layer}" if self.site == "mlp" else f"{self.site} layer {self.layer}"

    @property
    def reasons(self) -> list[str]:
        return [f.text for f in self.findings]

    def describe(self) -> str:
        """E.g. 'layer 3: 5 of 8 experts received no token; one expert (e2) took 71% of the load (…)'."""
        facts = self.reasons or [str(Verdict.HEALTHY)]
        return f"{self.label}: " + "; ".join(facts + list(self.notes))


@dataclass(frozen=True)
class CollapseReport:
    """Model verdict = the worst layer verdict; `reasons` = one line per layer that is not healthy."""

    verdict: Verdict
    layers: list[LayerVerdict]
    thresholds: CollapseThresholds = field(default_factory=CollapseThresholds)

    @property
    def reasons(self) -> list[str]:
        return [lv.describe() for lv in self.layers if lv.verdict > Verdict.HEALTHY]

    @property
    def notes(self) -> list[str]:
        return [f"{lv.label}: {note}" for lv in self.layers for note in lv.notes]

    def fails(self, fail_on: Verdict | str) -> bool:
        """True when the verdict is at least `fail_on` (for `--fail-on warning|collapsed` exit codes)."""
        return self.verdict >= Verdict.parse(fail_on)

    def summary(self) -> str:
        lines = [f"verdict: {self.verdict} ({len(self.layers)} MoE layers)"]
        lines += [f"  {reason}" for reason in self.reasons]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def judge_layer(
    layer: int,
    site: str,
    balance: BalanceStats,
    z: float,
    bias: BiasStats | None,
    thresholds: CollapseThresholds | None = None,
) -> LayerVerdict:
    """Apply the thresholds to precomputed statistics of one layer (pure; `layer_verdict` computes them)."""
    t = thresholds or CollapseThresholds()
    findings: list[Finding] = []
    notes: list[str] = []
    e, k = balance.num_experts, balance.top_k
    slots_per_expert = balance.tokens * k / e if e else 0.0
    if balance.tokens == 0:
        notes.append("no tokens routed: load not judged")
    elif slots_per_expert < t.min_slots_per_expert:
        need = math.ceil(t.min_slots_per_expert * e / max(k, 1))
        notes.append(
            f"only {balance.tokens} tokens ({slots_per_expert:.1f} slots per expert): load not judged "
            f"(needs ≥ {need} tokens)"
        )
    else:
        findings += _load_findings(balance, t)
    if balance.dropped_fraction > t.note_dropped_fraction:  # NaN (no tokens) compares False
        notes.append(
            f"{balance.dropped_fraction:.0%} of slots dropped by capacity: the load shown is after dropping"
        )
    findings += _router_findings(z, bias, t)
    verdict = max((f.level for f in findings), default=Verdict.HEALTHY)
    return LayerVerdict(layer, site, verdict, tuple(findings), tuple(notes), balance, z, bias)


def _load_findings(b: BalanceStats, t: CollapseThresholds) -> list[Finding]:
    e, k = b.num_experts, b.top_k
    findings = []
    if b.dead_fraction >= t.warning_dead_fraction:
        level = Verdict.COLLAPSED if b.dead_fraction >= t.collapsed_dead_fraction else Verdict.WARNING
        findings.append(Finding(level, f"{b.dead_experts} of {e} experts received no token"))
    warn_share = t.warning_share_factor / e
    if b.max_share > warn_share:
        level = Verdict.COLLAPSED if b.max_share > max(t.collapsed_max_share, warn_share) else Verdict.WARNING
        top = int(np.argmax(b.counts))
        text = f"one expert (e{top}) took {b.max_share:.0%} of the load ({b.max_share * e:.1f}× fair share"
        if k > 1:  # with top-k the share is capped at 1/k: say how many tokens it served
            text += f", picked by {b.counts[top] / b.tokens:.0%} of tokens"
        findings.append(Finding(level, text + ")"))
    if b.load_entropy < t.warning_load_entropy:
        level = Verdict.COLLAPSED if b.load_entropy < t.collapsed_load_entropy else Verdict.WARNING
        findings.append(
            Finding(
                level,
                f"normalised load entropy {b.load_entropy:.2f} (≈{b.effective_experts:.1f} of {e} experts "
                "effectively used)",
            )
        )
    return findings


def _router_findings(z: float, bias: BiasStats | None, t: CollapseThresholds) -> list[Finding]:
    findings = []
    if bias is not None:
        if bias.std > t.warning_bias_std:
            text = f"balancing bias std {bias.std:.2f} > {t.warning_bias_std:g}"
            findings.append(Finding(Verdict.WARNING, text))
        if bias.max_abs > t.warning_bias_abs:
            text = f"balancing bias |b| up to {bias.max_abs:.2f} > {t.warning_bias_abs:g}"
            findings.append(Finding(Verdict.WARNING, text))
    if z > t.warning_z_loss:  # NaN (no tokens) compares False
        findings.append(
            Finding(
                Verdict.WARNING,
                f"router z-loss {z:.1f} > {t.warning_z_loss:g} "
                f"(RMS logsumexp {math.sqrt(z):.1f}: large logits)",
            )
        )
    return findings


def layer_verdict(routing: LayerRouting, thresholds: CollapseThresholds | None = None) -> LayerVerdict:
    """Verdict of one MoE layer."""
    return judge_layer(
        routing.layer,
        routing.site,
        balance_stats(routing),
        z_loss(routing.logits),
        bias_stats(routing.bias),
        thresholds,
    )


def collapse_report(trace: Trace, thresholds: CollapseThresholds | None = None) -> CollapseReport:
    """Verdict for every MoE layer and for the model (the worst layer; HEALTHY for a trace without layers)."""
    t = thresholds or CollapseThresholds()
    layers = [layer_verdict(routing, t) for routing in trace.layers]
    verdict = max((lv.verdict for lv in layers), default=Verdict.HEALTHY)
    return CollapseReport(verdict, layers, t)


COLLAPSE_COLUMNS = [
    "layer",
    "site",
    "verdict",
    "reasons",
    "notes",
    "max_share",
    "dead_fraction",
    "load_entropy",
    "z_loss",
    "bias_std",
    "bias_max_abs",
]


def collapse_frame(report: CollapseReport) -> pd.DataFrame:
    """One row per layer of a report: verdict (str), reasons and notes ("; "-joined) and the judged values."""
    rows = [
        {
            "layer": lv.layer,
            "site": lv.site,
            "verdict": str(lv.verdict),
            "reasons": "; ".join(lv.reasons),
            "notes": "; ".join(lv.notes),
            "max_share": lv.balance.max_share,
            "dead_fraction": lv.balance.dead_fraction,
            "load_entropy": lv.balance.load_entropy,
            "z_loss": lv.z_loss,
            "bias_std": np.nan if lv.bias is None else lv.bias.std,
            "bias_max_abs": np.nan if lv.bias is None else lv.bias.max_abs,
        }
        for lv in report.layers
    ]
    return pd.DataFrame(rows, columns=COLLAPSE_COLUMNS)
