"""Collapse verdicts: "healthy" / "warning" / "collapsed" per MoE layer and for the model, with reasons.

Indicators (docs/routing-metrics.md, "Collapse indicators"): max share → 1, dead fraction ↑,
normalised load entropy ↓, logit magnitude (z-loss) ↑, bias spread ↑. Thresholds live in
`CollapseThresholds`; load findings must also be significant against uniform routing of the same
effective number of tokens (docs/verdicts.md, moeviz.analysis.null), else the layer says "not significant"
or "not enough tokens to judge". `Verdict` is ordered so a CLI can gate with
`report.verdict >= Verdict.parse(arg)` (`--fail-on warning|collapsed`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from moeviz.analysis.balance import BalanceStats, balance_stats, load_balance_stats, load_layer_tokens
from moeviz.analysis.losses import BIAS_ABS_FLAG, BIAS_STD_FLAG, BiasStats, bias_stats, z_loss
from moeviz.analysis.null import (
    at_effective_tokens,
    dead_pvalue,
    effective_tokens,
    entropy_pvalue,
    max_count_pvalue,
    min_tokens_to_judge,
)
from moeviz.trace import LayerRouting, Trace

if TYPE_CHECKING:
    from moeviz.trace import ExpertLoad

NOT_ENOUGH_TOKENS = "not enough tokens to judge"  # the note (and status) of a layer too short to judge
# Routers whose scores are a softmax over the logits: the z-loss (the size of the softmax's log-partition) is
# theirs; sigmoid routers score each expert on its own and are not trained with one.
Z_LOSS_SCORE_FNS = ("softmax",)


def judges_z_loss(score_fn: str | None) -> bool:
    """Whether the z-loss rule applies to a router with this score function (`LayerRouting.score_fn`; None:
    not recorded, judged as softmax): softmax routers only — sigmoid and other per-expert scores have no
    partition function and are not trained with a z-loss, so no z-loss threshold is theirs."""
    return score_fn is None or score_fn in Z_LOSS_SCORE_FNS


LOAD_INDICATORS = 3  # dead fraction, max share, load entropy: the load tests per layer (Bonferroni)

# LayerVerdict.status
STATUS_JUDGED = "judged"
STATUS_TOO_FEW = "not enough tokens"
STATUS_NO_TOKENS = "no tokens"


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

    Sample size (docs/verdicts.md). A load rule below yields a finding only when its threshold fires AND
    the observed value is significant against uniform routing: p < alpha / (3 · layers), p = the chance that
    each of T_eff tokens picking k distinct experts uniformly at random (capacity ignored) gives a value at
    least as extreme (moeviz.analysis.null: dead count exact, max share by a union bound, entropy by
    Monte-Carlo). Bonferroni over 3 indicators × the model's MoE layers keeps the model verdict's false-alarm
    rate under uniform routing ≤ alpha = 0.01. T_eff is the effective number of independent tokens: tokens of
    one text pick alike experts (its topic, language, repeated words), so a sequence of T tokens counts as
    T / (1 + (T − 1) ρ) tokens (Kish design effect), ρ = `token_correlation` = 0.25 (the intra-text
    correlation of routing measured on the healthy sample's held-out slices: 0.24–0.26 for pieces of
    16–512 tokens, 0.19–0.22 on mixtral-unbalanced and deepseek-v3-bias). One text therefore counts as at
    most 1/ρ = 4 independent tokens; more texts add up. A fired threshold without significance becomes a
    "not significant: …" note. A layer is not judged on load ("not enough tokens to judge", NOT_ENOUGH_TOKENS)
    when it routed fewer than `min_slots_per_expert` · E / k tokens (5 fair-share slots per expert) or when
    T_eff is so small that even total collapse (every token on the same k experts) would not be significant.
    Measured (16–512-token pieces of every held-out slice, one text each): false "warning"/"collapsed"
    verdicts on mixtral-healthy ≤ 0.5% per length (0 from 128 tokens on), while mixtral-collapsed is
    "collapsed" on every piece from 32 tokens on; without the correlation (ρ = 0) the healthy sample's
    single-domain pieces are flagged 97–99.6% of the time — its routing is domain-specialised, so the load of
    one text is truly uneven: judge the model's balance on a corpus of several texts.
    Load rules:
    - max share f_max = max_e c_e / (kT). warning when f_max > warning_share_factor / E (2.5: one expert
      doing 2.5× its fair share, i.e. MaxVio > 1.5 — its expert-parallel device is 2.5× the average, while
      balanced routers stay well under MaxVio 1 on a sizable batch). collapsed when f_max >
      max(collapsed_max_share, warning_share_factor / E): one expert does more work than all others together
      (the max keeps "collapsed" above "warning" for small E). f_max is capped at 1/k, so this absolute rule
      can only fire for top-1 routers; a collapsing top-k router shows in the dead fraction and the entropy.
    - dead fraction (experts with no token): warning ≥ 0.25, collapsed ≥ 0.5 — a quarter / half of the
      layer's expert parameters doing nothing (the significance test says when that many can be empty by
      chance).
    - normalised load entropy H(f)/log E: warning < 0.85, collapsed < 0.6. In effective experts E^h:
      for E = 8, 0.85 ≈ 5.9 and 0.6 ≈ 3.5 of 8 experts used; for E = 64, ≈ 34 and ≈ 12.
    Router rules (always judged), warning only — they precede collapse rather than constitute it:
    - bias std > 1 or max |bias| > 5: Megatron-Core's flags for a balancing bias that is fighting the router.
    - softmax routers only: RMS log-partition above log E by more than `warning_logit_excess` = 8 nats,
      i.e. z-loss > (log E + 8)² (`z_loss_threshold`: 101.6 for E = 8, 183.5 for E = 256). The log-partition
      of E logits grows with log E by itself — uniform zero logits give exactly log E, so z-loss (log E)²,
      4.3 for E = 8 and 31 for E = 256 — so the rule judges the excess over log E, which is ≤ the largest
      logit (logsumexp ≤ max logit + log E): an excess over 8 puts the top logits at |logit| > 8, where bf16
      resolves steps of 1/16, enough to move near-tied probabilities by ~6% and flip top-k decisions (the
      instability ST-MoE's z-loss targets). For E = 8 this is the former fixed rule z-loss > 100. The
      trained samples measure an excess of 1–4 on their evaluation slices (z-loss 9–13 on mixtral-healthy,
      up to 33 on mixtral-collapsed). Sigmoid (and other per-expert) routers, e.g. DeepSeek-V3's, have no
      partition function and are not trained with a z-loss: the rule is not applied to them (their z-loss
      is still reported).
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
    warning_logit_excess: float = 8.0
    min_slots_per_expert: float = 5.0
    note_dropped_fraction: float = 0.1
    alpha: float = 0.01
    token_correlation: float = 0.25

    def z_loss_threshold(self, num_experts: int) -> float:
        """The z-loss above which a softmax router of `num_experts` experts is warned about:
        (log E + warning_logit_excess)², an RMS log-partition that many nats above uniform logits'."""
        return (math.log(max(num_experts, 1)) + self.warning_logit_excess) ** 2


@dataclass(frozen=True)
class Finding:
    """One triggered rule: its level and the fact in words."""

    level: Verdict
    text: str


@dataclass(frozen=True)
class LoadTest:
    """Significance of the load indicators against uniform routing of the same tokens (moeviz.analysis.null).

    p_dead = P(at least this many dead experts), p_max_share = P(some expert at least this loaded) (a union
    bound), p_entropy = P(load entropy this low): under uniform routing of `effective_tokens` tokens. NaN
    when the layer was not judged. `alpha` is the level each p-value is compared with (Bonferroni share of
    CollapseThresholds.alpha); `min_effective_tokens` the effective sample below which even total collapse
    is not significant, `min_tokens` the length of one text that reaches it (inf: no single text does).
    """

    status: str  # STATUS_JUDGED | STATUS_TOO_FEW | STATUS_NO_TOKENS
    alpha: float
    effective_tokens: float
    min_effective_tokens: float
    min_tokens: float
    p_dead: float = float("nan")
    p_max_share: float = float("nan")
    p_entropy: float = float("nan")

    @property
    def judged(self) -> bool:
        return self.status == STATUS_JUDGED


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
    load_test: LoadTest | None = None

    @property
    def label(self) -> str:
        return f"layer {self.layer}" if self.site == "mlp" else f"{self.site} layer {self.layer}"

    @property
    def status(self) -> str:
        """'judged', 'not enough tokens' or 'no tokens': whether the load rules could be applied."""
        return self.load_test.status if self.load_test is not None else STATUS_JUDGED

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

    @property
    def judged(self) -> bool:
        """True when at least one layer had enough tokens for the load rules."""
        return any(lv.status == STATUS_JUDGED for lv in self.layers)

    def fails(self, fail_on: Verdict | str) -> bool:
        """True when the verdict is at least `fail_on` (for `--fail-on warning|collapsed` exit codes)."""
        return self.verdict >= Verdict.parse(fail_on)

    def summary(self) -> str:
        head = f"verdict: {self.verdict} ({len(self.layers)} MoE layers)"
        if self.layers and not self.judged:
            head += f" — load {NOT_ENOUGH_TOKENS}"
        lines = [head]
        lines += [f"  {reason}" for reason in self.reasons]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def family_alpha(t: CollapseThresholds, layers: int) -> float:
    """Level of one load test: CollapseThresholds.alpha shared (Bonferroni) over the layers × indicators."""
    return t.alpha / (LOAD_INDICATORS * max(1, layers))


def judge_layer(
    layer: int,
    site: str,
    balance: BalanceStats,
    z: float,
    bias: BiasStats | None,
    thresholds: CollapseThresholds | None = None,
    *,
    layers: int = 1,
    sequence_lengths: Sequence[int] | None = None,
    score_fn: str | None = None,
) -> LayerVerdict:
    """Apply the thresholds to precomputed statistics of one layer (pure; `layer_verdict` computes them).

    `layers` = how many layers the model verdict combines: each load test runs at level
    alpha / (3 · layers), so that uniform routing raises a false alarm anywhere in the model with
    probability ≤ alpha. `sequence_lengths` = tokens of each sequence the layer routed: the load is compared
    with uniform routing of their effective sample size (CollapseThresholds.token_correlation); None treats
    the tokens as independent. `score_fn`: the router's score function (`LayerRouting.score_fn`); the
    z-loss rule applies to Z_LOSS_SCORE_FNS only (None, unknown: applied).
    """
    t = thresholds or CollapseThresholds()
    findings: list[Finding] = []
    notes: list[str] = []
    e, k, tokens = balance.num_experts, balance.top_k, balance.tokens
    alpha = family_alpha(t, layers)
    if sequence_lengths is None:
        t_eff, texts = float(tokens), None
    else:
        t_eff, texts = effective_tokens(sequence_lengths, t.token_correlation), len(sequence_lengths)
    need_eff = min_tokens_to_judge(k, e, alpha) if e else 1.0
    floor = math.ceil(t.min_slots_per_expert * e / max(k, 1)) if e else 0
    rho = t.token_correlation if sequence_lengths is not None else 0.0
    one_text = need_eff * (1 - rho) / (1 - need_eff * rho) if need_eff * rho < 1 else math.inf
    need = max(float(floor), math.ceil(one_text - 1e-9) if math.isfinite(one_text) else math.inf)

    def test(status: str, *p: float) -> LoadTest:
        return LoadTest(status, alpha, t_eff, need_eff, need, *p)

    if tokens == 0:
        notes.append("no tokens routed: load not judged")
        load_test = test(STATUS_NO_TOKENS)
    elif tokens < floor or t_eff < need_eff:
        where = f"{tokens} tokens" if texts is None else f"{tokens} tokens in {texts} sequence(s)"
        if texts is not None and rho > 0:
            where += f" ≈ {t_eff:.1f} independent tokens"
        if math.isfinite(need):
            want = f"needs ≥ {need:.0f} tokens" + (" in one sequence, or more sequences" if texts else "")
        else:
            want = f"needs ≥ {need_eff:.1f} independent tokens: more sequences"
        notes.append(f"{NOT_ENOUGH_TOKENS}: {where} ({want})")
        load_test = test(STATUS_TOO_FEW)
    else:
        load, insignificant, pvalues = _load_findings(balance, t, t_eff, alpha)
        findings += load
        notes += insignificant
        load_test = test(STATUS_JUDGED, *pvalues)
    if balance.dropped_fraction > t.note_dropped_fraction:  # NaN (no tokens) compares False
        notes.append(
            f"{balance.dropped_fraction:.0%} of slots dropped by capacity: the load shown is after dropping"
        )
    findings += _router_findings(z if judges_z_loss(score_fn) else float("nan"), bias, t, e)
    verdict = max((f.level for f in findings), default=Verdict.HEALTHY)
    return LayerVerdict(layer, site, verdict, tuple(findings), tuple(notes), balance, z, bias, load_test)


def _load_findings(
    b: BalanceStats, t: CollapseThresholds, t_eff: float, alpha: float
) -> tuple[list[Finding], list[str], tuple[float, float, float]]:
    """Findings whose threshold fires and whose p-value under uniform routing of `t_eff` tokens is below
    `alpha`; a note for each threshold that fires without significance; the p-values (NaN: not fired)."""
    e, k = b.num_experts, b.top_k
    findings: list[Finding] = []
    quiet: list[str] = []
    p_dead = p_max = p_ent = float("nan")

    def keep(level: Verdict, text: str, p: float) -> None:
        if p < alpha:
            findings.append(Finding(level, text))
        else:
            quiet.append(
                f"not significant: {text} (p = {p:.2g} for uniform routing of ≈{t_eff:.0f} independent "
                f"tokens; needs p < {alpha:.2g})"
            )

    if b.dead_fraction >= t.warning_dead_fraction:
        level = Verdict.COLLAPSED if b.dead_fraction >= t.collapsed_dead_fraction else Verdict.WARNING
        p_dead = at_effective_tokens(lambda n: dead_pvalue(b.dead_experts, n, k, e), t_eff)
        keep(level, f"{b.dead_experts} of {e} experts received no token", p_dead)
    warn_share = t.warning_share_factor / e
    if b.max_share > warn_share:
        level = Verdict.COLLAPSED if b.max_share > max(t.collapsed_max_share, warn_share) else Verdict.WARNING
        top = int(np.argmax(b.counts))
        top_share = b.counts[top] / b.tokens  # of tokens: scaled to n tokens below
        p_max = at_effective_tokens(
            lambda n: max_count_pvalue(math.ceil(top_share * n - 1e-9), n, k, e), t_eff
        )
        text = f"one expert (e{top}) took {b.max_share:.0%} of the load ({b.max_share * e:.1f}× fair share"
        if k > 1:  # with top-k the share is capped at 1/k: say how many tokens it served
            text += f", picked by {top_share:.0%} of tokens"
        keep(level, text + ")", p_max)
    if b.load_entropy < t.warning_load_entropy:
        level = Verdict.COLLAPSED if b.load_entropy < t.collapsed_load_entropy else Verdict.WARNING
        p_ent = at_effective_tokens(lambda n: entropy_pvalue(b.load_entropy, n, k, e), t_eff)
        text = (
            f"normalised load entropy {b.load_entropy:.2f} (≈{b.effective_experts:.1f} of {e} experts "
            "effectively used)"
        )
        keep(level, text, p_ent)
    return findings, quiet, (p_dead, p_max, p_ent)


def _router_findings(
    z: float, bias: BiasStats | None, t: CollapseThresholds, num_experts: int
) -> list[Finding]:
    """The router rules: the balancing bias's spread, and the z-loss against `t.z_loss_threshold(E)` (NaN:
    not judged — no tokens, no logits, or not a softmax router)."""
    findings = []
    if bias is not None:
        if bias.std > t.warning_bias_std:
            text = f"balancing bias std {bias.std:.2f} > {t.warning_bias_std:g}"
            findings.append(Finding(Verdict.WARNING, text))
        if bias.max_abs > t.warning_bias_abs:
            text = f"balancing bias |b| up to {bias.max_abs:.2f} > {t.warning_bias_abs:g}"
            findings.append(Finding(Verdict.WARNING, text))
    limit = t.z_loss_threshold(num_experts)
    if z > limit:  # NaN compares False
        rms, uniform = math.sqrt(z), math.log(max(num_experts, 1))
        findings.append(
            Finding(
                Verdict.WARNING,
                f"router z-loss {z:.1f} > {limit:.1f} (RMS logsumexp {rms:.1f} = log E + {rms - uniform:.1f} "
                f"> log E + {t.warning_logit_excess:g}: large logits)",
            )
        )
    return findings


def layer_verdict(
    routing: LayerRouting,
    thresholds: CollapseThresholds | None = None,
    *,
    layers: int = 1,
    sequence_lengths: Sequence[int] | None = None,
) -> LayerVerdict:
    """Verdict of one MoE layer (`layers`, `sequence_lengths`: see judge_layer)."""
    # Imported routing without logits (`has_logits` False): no z-loss, rather than a NaN computed over an
    # [N, E] copy of the all-NaN view.
    z = z_loss(routing.logits) if routing.has_logits else float("nan")
    return judge_layer(
        routing.layer,
        routing.site,
        balance_stats(routing),
        z,
        bias_stats(routing.bias),
        thresholds,
        layers=layers,
        sequence_lengths=sequence_lengths,
        score_fn=routing.score_fn,
    )


def collapse_report(trace: Trace, thresholds: CollapseThresholds | None = None) -> CollapseReport:
    """Verdict for every MoE layer and for the model (the worst layer; HEALTHY for a trace without layers).

    The load tests share CollapseThresholds.alpha over all layers, so the model verdict of uniformly routed
    tokens is a false alarm with probability ≤ alpha."""
    t = thresholds or CollapseThresholds()
    n = len(trace.layers)
    seq = trace.tokens["seq"].to_numpy() if "seq" in trace.tokens else None
    layers = [
        layer_verdict(routing, t, layers=n, sequence_lengths=_sequence_lengths(routing, seq))
        for routing in trace.layers
    ]
    verdict = max((lv.verdict for lv in layers), default=Verdict.HEALTHY)
    return CollapseReport(verdict, layers, t)


def load_collapse_report(
    load: ExpertLoad, thresholds: CollapseThresholds | None = None, *, steps_are_sequences: bool = False
) -> CollapseReport:
    """Verdicts of an ExpertLoad (counts without tokens): the load rules on each layer's counts summed over
    the steps, with the same significance tests and family level as `collapse_report`; no router rule
    fires (z-loss NaN, no bias: a load table has no router scores).

    The tokens count as independent unless `steps_are_sequences` (each step one sequence, as MoE-Infinity's
    per-sequence matrices): then each step's Σ_e c_e / k tokens is one sequence's length, and the
    token-correlation rule of CollapseThresholds applies as it does to a trace."""
    t = thresholds or CollapseThresholds()
    n = len(load.layers)
    stats = load_balance_stats(load)
    per_step = load_layer_tokens(load.counts, load.top_k)  # [S, L] tokens of each step at each layer
    layers = []
    for i, (layer, balance) in enumerate(zip(load.layers, stats, strict=True)):
        lengths = [int(v) for v in per_step[:, i] if v > 0] if steps_are_sequences else None
        layers.append(
            judge_layer(
                layer, "mlp", balance, float("nan"), None, t, layers=n, sequence_lengths=lengths or None
            )
        )
    verdict = max((lv.verdict for lv in layers), default=Verdict.HEALTHY)
    return CollapseReport(verdict, layers, t)


def _sequence_lengths(routing: LayerRouting, seq: np.ndarray | None) -> list[int] | None:
    """Tokens per sequence among the tokens this layer routed."""
    if seq is None or len(routing.token_rows) == 0:
        return None
    counts = np.unique(seq[routing.token_rows], return_counts=True)[1]
    return [int(c) for c in counts]


# ---- a report in a few lines: what the app shows before the per-layer reasons ---------------------------
NOTE_NOT_SIGNIFICANT = "not significant"  # the prefix of `_load_findings`' notes
NOTE_DROPPED = "dropped by capacity"
NOTE_NO_TOKENS = "no tokens routed"
NOTE_KINDS = (NOTE_NOT_SIGNIFICANT, NOT_ENOUGH_TOKENS, NOTE_DROPPED, NOTE_NO_TOKENS, "other")


def note_kind(note: str) -> str:
    """Which of NOTE_KINDS a layer's note is (from the words `judge_layer` writes)."""
    if note.startswith(NOTE_NOT_SIGNIFICANT):
        return NOTE_NOT_SIGNIFICANT
    if note.startswith(NOT_ENOUGH_TOKENS):
        return NOT_ENOUGH_TOKENS
    if note.startswith(NOTE_NO_TOKENS):
        return NOTE_NO_TOKENS
    if NOTE_DROPPED in note:
        return NOTE_DROPPED
    return "other"


@dataclass(frozen=True)
class VerdictSummary:
    """A report counted: layers per verdict, the layers with reasons (not healthy), and per note kind the
    layers that have one — so that a model of 58 layers reads in a line before its ~hundreds of notes."""

    layers: int
    by_verdict: dict[str, int]  # str(Verdict) -> layers, every verdict present (0 when none)
    flagged: tuple[LayerVerdict, ...]  # the layers with at least one reason, worst first
    noted: dict[str, tuple[LayerVerdict, ...]]  # note kind -> the layers with such a note (kinds present)

    def headline(self) -> str:
        """E.g. '58 MoE layers: 2 warning, 56 healthy.'"""
        counts = [f"{n} {name}" for name, n in reversed(self.by_verdict.items()) if n]
        return f"{self.layers} MoE layers: " + (", ".join(counts) or "none") + "."

    def notes_line(self) -> str:
        """E.g. 'Notes: 47 layers not significant; 11 layers not enough tokens to judge.' ('': none)."""
        parts = [
            f"{len(lvs)} {'layer' if len(lvs) == 1 else 'layers'} {kind}" for kind, lvs in self.noted.items()
        ]
        return ("Notes: " + "; ".join(parts) + ".") if parts else ""


def summarise_report(report: CollapseReport) -> VerdictSummary:
    """Count a report's layers by verdict and by kind of note (see VerdictSummary)."""
    by_verdict = {str(v): sum(lv.verdict is v for lv in report.layers) for v in Verdict}
    flagged = sorted((lv for lv in report.layers if lv.findings), key=lambda lv: -int(lv.verdict))
    noted: dict[str, list[LayerVerdict]] = {}
    for lv in report.layers:
        for kind in dict.fromkeys(note_kind(note) for note in lv.notes):
            noted.setdefault(kind, []).append(lv)
    ordered = {kind: tuple(noted[kind]) for kind in NOTE_KINDS if kind in noted}
    return VerdictSummary(len(report.layers), by_verdict, tuple(flagged), ordered)


COLLAPSE_COLUMNS = [
    "layer",
    "site",
    "verdict",
    "status",
    "reasons",
    "notes",
    "tokens",
    "effective_tokens",
    "min_tokens",
    "max_share",
    "dead_fraction",
    "load_entropy",
    "z_loss",
    "bias_std",
    "bias_max_abs",
    "p_dead",
    "p_max_share",
    "p_entropy",
    "alpha",
]


def _test_columns(test: LoadTest | None) -> dict[str, float]:
    if test is None:
        return {"p_dead": np.nan, "p_max_share": np.nan, "p_entropy": np.nan, "alpha": np.nan}
    return {
        "p_dead": test.p_dead,
        "p_max_share": test.p_max_share,
        "p_entropy": test.p_entropy,
        "alpha": test.alpha,
    }


def collapse_frame(report: CollapseReport) -> pd.DataFrame:
    """One row per layer of a report: verdict (str), status ('judged' | 'not enough tokens' | 'no tokens'),
    reasons and notes ("; "-joined), tokens and the fewest tokens needed to judge, the judged values, and
    the p-values of the load rules that fired (NaN for the others) with the level they were held to."""
    rows = [
        {
            "layer": lv.layer,
            "site": lv.site,
            "verdict": str(lv.verdict),
            "status": lv.status,
            "reasons": "; ".join(lv.reasons),
            "notes": "; ".join(lv.notes),
            "tokens": lv.balance.tokens,
            "effective_tokens": np.nan if lv.load_test is None else lv.load_test.effective_tokens,
            "min_tokens": np.nan if lv.load_test is None else lv.load_test.min_tokens,
            "max_share": lv.balance.max_share,
            "dead_fraction": lv.balance.dead_fraction,
            "load_entropy": lv.balance.load_entropy,
            "z_loss": lv.z_loss,
            "bias_std": np.nan if lv.bias is None else lv.bias.std,
            "bias_max_abs": np.nan if lv.bias is None else lv.bias.max_abs,
            **_test_columns(lv.load_test),
        }
        for lv in report.layers
    ]
    return pd.DataFrame(rows, columns=COLLAPSE_COLUMNS)
