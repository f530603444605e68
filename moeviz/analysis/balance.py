"""Expert load and every balance indicator (definitions: docs/routing-metrics.md, "Load and balance").

One vocabulary across the library, the CLI, the store, the charts and the app. Notation: T tokens routed by
the layer, k slots per token, E experts, c_e = dispatched slots of expert e; slots dropped by capacity
(expert -1) count for no expert and are their own quantity (`dropped`, `dropped_fraction` = dropped / kT).
Shares are of all kT slots: f_e = c_e / (kT), so Σ_e f_e + dropped_fraction = 1 (uniform f_e = 1/E).

Conventions (other tools log some of these differently; the peer-comparable value is a column of its own):
- cv: population std(c) / mean(c) (ddof = 0). cv_unbiased: the sample std (ddof = 1), = cv · √(E/(E−1)),
  as NeMo, Megatron-Core and TensorRT-LLM log it.
- gini: the textbook Gini coefficient, in [0, (E−1)/E]. gini_megatron: gini − 1/E, as Megatron-Core's
  router diagnostics log it (−1/E for an even load).
- ep_balancedness: per layer mean_d L_d / max_d L_d (vLLM / SGLang EPLB, per layer);
  `ep_balancedness_over_layers`: Σ_layers mean_d L_d / Σ_layers max_d L_d, the one number vLLM's EPLB logs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pandas as pd

from moeviz.trace import LayerRouting, Trace

if TYPE_CHECKING:
    from moeviz.trace import ExpertLoad


class ExpertSlots(Protocol):
    """What `expert_counts` reads: a LayerRouting, or the what-if simulators' LayerRoutes."""

    @property
    def experts(self) -> np.ndarray: ...  # [N, k], -1 = a dropped slot

    @property
    def num_experts(self) -> int: ...


def expert_counts(routing: ExpertSlots) -> np.ndarray:
    """Tokens dispatched to each expert [E] (a token counts once per expert it was sent to; E counts a
    layer's zero-computation experts too, the last ids: balance counts them apart, `routed_counts`). Takes
    anything with `experts [N, k]` and `num_experts` (also the what-if simulators' LayerRoutes)."""
    experts = routing.experts[routing.experts >= 0]
    return np.bincount(experts, minlength=routing.num_experts).astype(np.int64)


def routed_counts(routing: LayerRouting, counts: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """(loads of the experts that compute [..., E − Z], slots sent to the Z zero-computation experts) from
    `counts` [..., E] (default `expert_counts`): LongCat-Flash's identity experts and ZAYA's skip take
    slots but no compute, so loads, dead experts and balance leave them out."""
    counts = expert_counts(routing) if counts is None else counts
    routed = getattr(routing, "routed_experts", counts.shape[-1])
    return counts[..., :routed], int(counts[..., routed:].sum())


def load_entropy_nats(counts: np.ndarray) -> np.ndarray | float:
    """H(c / Σc) in nats of loads [..., E] → [...] (a float for one vector); 0 log 0 = 0, and 0 where Σc = 0.

    The one entropy of a load: `load_entropy` normalises it, the null model's deficiency statistic and
    the Lab's history use it."""
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum(axis=-1, keepdims=True)
    p = np.divide(c, total, out=np.zeros_like(c), where=total > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    nats = np.maximum(-terms.sum(axis=-1), 0.0)  # max: no "-0.00" for a single expert
    return float(nats) if nats.ndim == 0 else nats


def load_entropy(counts: np.ndarray) -> np.ndarray | float:
    """Normalised load entropy H(c/Σc) / log E of loads [..., E] → [...], in [0, 1] (1 = even). NaN where
    Σc = 0; 1 for E = 1 (one expert is trivially "uniform")."""
    c = np.asarray(counts, dtype=np.float64)
    e = c.shape[-1]
    nats = np.asarray(load_entropy_nats(c))
    normalised = np.minimum(nats / np.log(e), 1.0) if e > 1 else np.ones_like(nats)  # min: rounding
    out = np.where(c.sum(axis=-1) > 0, normalised, np.nan)
    return float(out) if out.ndim == 0 else out


# ---- Expert-parallel balancedness -------------------------------------------------------------------------
# One quantity, one function for every surface: `moeviz report --devices`, balance_frame and the EP what-if
# (which places experts by other rules too, and with replicas) all hand per-device loads to
# `ep_balancedness`.


def contiguous_device_load(counts: np.ndarray, devices: int) -> np.ndarray:
    """Per-device loads [..., D] of loads [..., E] placed contiguously, E/D experts per device (expert e on
    device e // (E/D): `whatif ep --placement contiguous`). Raises ValueError unless D divides E."""
    c = np.asarray(counts, dtype=np.float64)
    e = c.shape[-1]
    if devices < 1 or e % devices:
        raise ValueError(
            f"expert-parallel balancedness needs the {e} experts to split evenly over the devices; "
            f"got {devices} device(s) (E % D = {e % devices if devices >= 1 else 'n/a'})"
        )
    return c.reshape(*c.shape[:-1], devices, e // devices).sum(axis=-1)


def ep_balancedness(device_load: np.ndarray) -> np.ndarray | float:
    """Expert-parallel balancedness mean_d L_d / max_d L_d of per-device loads [..., D] → [...] (a float for
    one layer): 1 = every device equally busy, 1/D = one device does all the work; NaN where no device has
    load (vLLM / SGLang EPLB, per layer)."""
    load = np.asarray(device_load, dtype=np.float64)
    peak = load.max(axis=-1)
    out = np.divide(load.mean(axis=-1), peak, out=np.full(peak.shape, np.nan), where=peak > 0)
    return float(out) if out.ndim == 0 else out


def ep_balancedness_over_layers(device_load: np.ndarray) -> float:
    """Expert-parallel balancedness over layers from per-device loads [L, D], as vLLM's EPLB logs it:
    Σ_layers mean_d L_d / Σ_layers max_d L_d. Busy layers weigh more than in the mean of per-layer
    `ep_balancedness`. In (0, 1]; NaN when no device of any layer has load."""
    load = np.asarray(device_load, dtype=np.float64)
    peak = float(load.max(axis=-1).sum()) if load.size else 0.0
    return float(load.mean(axis=-1).sum() / peak) if peak > 0 else float("nan")


def trace_device_load(trace: Trace, devices: int) -> np.ndarray:
    """[L, D] loads of every MoE layer's experts placed contiguously over `devices` (`contiguous_device_load`
    of each layer's `expert_counts`); raises ValueError unless D divides every layer's E."""
    rows = [contiguous_device_load(expert_counts(r), devices) for r in trace.layers]
    return np.stack(rows) if rows else np.zeros((0, devices))


# ---- Balance: the full set of load indicators --------------------------------------------------------
# Definitions follow docs/routing-metrics.md exactly. f_e = c_e / (kT): the dropped slots stay in the
# denominator, so with drops the shares sum to 1 − dropped_fraction, not to 1.


@dataclass(frozen=True)
class BalanceStats:
    """Load and balance of one layer (or any count vector).

    counts [E] and utilisation [E] are per expert, the rest are scalars. Degenerate cases, without warnings:
    - no token routed (T = 0): every ratio is NaN, dead_experts = 0 and dead_fraction NaN (nothing was
      offered to any expert, so none can be called dead);
    - tokens routed but every slot dropped (Σc = 0): utilisation and max_share are 0, dead_experts = E,
      dead_fraction = 1, and the shape-of-the-distribution metrics (max_vio, cv, cv_unbiased, gini,
      gini_megatron, jain, load_entropy, effective_experts, ep_balancedness) are NaN;
    - E = 1: load_entropy is 1 and effective_experts 1 (one expert is trivially "uniform"); cv_unbiased is
      NaN (a sample std needs two experts).
    ep_balancedness is NaN when no device count was asked for.
    """

    tokens: int  # T
    top_k: int  # k
    counts: np.ndarray  # [E] c_e
    dropped: int  # slots dropped by capacity
    utilisation: np.ndarray  # [E] u_e = c_e / (kT/E); 1 = fair share, 0 = dead
    max_vio: float  # max c / mean c − 1
    cv: float  # population std(c) / mean(c) (ddof = 0)
    cv_unbiased: float  # sample std(c) / mean(c) (ddof = 1) = cv·√(E/(E−1)): NeMo / Megatron / TRT-LLM's CV
    gini: float  # textbook Gini coefficient of c, in [0, (E−1)/E]
    gini_megatron: float  # gini − 1/E, Megatron-Core's logged form, in [−1/E, (E−2)/E]
    jain: float  # (Σc)² / (E Σc²), in [1/E, 1]
    load_entropy: float  # H(c/Σc) / log E, in [0, 1]
    effective_experts: float  # exp(H(c/Σc)), in [1, E]
    max_share: float  # max_e f_e = max c / (kT), dropped slots in kT; uniform = 1/E, at most 1/k
    dead_experts: int  # #{e : c_e = 0}
    dead_fraction: float  # dead_experts / E
    devices: int | None = None  # D for ep_balancedness
    ep_balancedness: float = float("nan")  # mean_d L_d / max_d L_d, in (0, 1]
    skipped: int = 0  # slots sent to zero-computation experts (not in counts; in kT)

    @property
    def num_experts(self) -> int:
        return len(self.counts)

    @property
    def skipped_fraction(self) -> float:
        """The share of the kT slots the router sent to zero-computation experts: compute it skipped."""
        slots = self.tokens * self.top_k
        return self.skipped / slots if slots else float("nan")

    @property
    def dropped_fraction(self) -> float:
        slots = self.tokens * self.top_k
        return self.dropped / slots if slots else float("nan")


def gini(counts: np.ndarray) -> np.ndarray | float:
    """Gini coefficient of non-negative loads [..., E] → [...]: Σ_ij |c_i − c_j| / (2 E Σc), via the sorted
    form. 0 = perfectly even, (E−1)/E = everything on one expert; NaN where Σc = 0."""
    c = np.sort(np.asarray(counts, dtype=np.float64), axis=-1)
    e = c.shape[-1]
    total = c.sum(axis=-1)
    # Σ_ij |c_i − c_j| = 2 Σ_i (2i − E − 1) c_(i) for ascending c (1-based i)
    spread = ((2 * np.arange(1, e + 1) - e - 1) * c).sum(axis=-1)
    out = np.divide(spread, e * total, out=np.full(total.shape, np.nan), where=total > 0)
    return float(out) if out.ndim == 0 else out


def jain_index(counts: np.ndarray) -> np.ndarray | float:
    """Jain fairness (Σc)² / (E Σc²) of loads [..., E] → [...]: 1 = even, 1/E = one expert; NaN where
    Σc = 0."""
    c = np.asarray(counts, dtype=np.float64)
    squares = (c * c).sum(axis=-1)
    out = np.divide(
        c.sum(axis=-1) ** 2, c.shape[-1] * squares, out=np.full(squares.shape, np.nan), where=squares > 0
    )
    return float(out) if out.ndim == 0 else out


# The scalar indicators of `balance_indicators`, in BalanceStats' order.
INDICATOR_NAMES = (
    "max_vio",
    "cv",
    "cv_unbiased",
    "gini",
    "gini_megatron",
    "jain",
    "load_entropy",
    "effective_experts",
    "max_share",
    "dead_experts",
    "dead_fraction",
)


def balance_indicators(
    counts: np.ndarray, tokens: int, top_k: int, names: Sequence[str] = INDICATOR_NAMES
) -> dict[str, np.ndarray]:
    """The scalar balance indicators `names` (default all of INDICATOR_NAMES) of n load vectors [n, E] of
    `tokens` tokens routed to `top_k` slots each → name: [n]. The one implementation: `balance_from_counts`
    is its n = 1 case and the bootstrap bands (`moeviz.analysis.null`) run it over their resamples (asking
    only for what they band). Degenerate cases: `BalanceStats`."""
    unknown = set(names) - set(INDICATOR_NAMES)
    if unknown:
        raise ValueError(f"unknown balance indicators {sorted(unknown)}; known: {', '.join(INDICATOR_NAMES)}")
    c = np.atleast_2d(np.asarray(counts, dtype=np.float64))
    n, e = c.shape
    nan = np.full(n, np.nan)
    slots = tokens * top_k
    total = c.sum(axis=1)
    routed = total > 0
    mean = total / e if e else nan
    out: dict[str, np.ndarray] = {}
    with np.errstate(divide="ignore", invalid="ignore"):
        if "max_vio" in names:
            out["max_vio"] = np.where(routed, c.max(axis=1, initial=0.0) / mean - 1.0, np.nan)
        if "cv" in names:
            out["cv"] = np.where(routed, c.std(axis=1) / mean, np.nan)
        if "cv_unbiased" in names:
            out["cv_unbiased"] = np.where(routed, c.std(axis=1, ddof=1) / mean, np.nan) if e > 1 else nan
    if {"gini", "gini_megatron"} & set(names):
        gini_value = np.asarray(gini(c)) if e else nan
        out["gini"] = gini_value
        out["gini_megatron"] = gini_value - 1.0 / e if e else nan
    if "jain" in names:
        out["jain"] = np.asarray(jain_index(c)) if e else nan
    if {"load_entropy", "effective_experts"} & set(names):
        out["load_entropy"] = np.asarray(load_entropy(c)) if e else nan
        out["effective_experts"] = np.where(routed, np.exp(np.asarray(load_entropy_nats(c))), np.nan)
    if "max_share" in names:
        out["max_share"] = c.max(axis=1, initial=0.0) / slots if slots > 0 else nan
    if {"dead_experts", "dead_fraction"} & set(names):
        dead = (c == 0).sum(axis=1) if tokens > 0 else np.zeros(n, np.int64)
        out["dead_experts"] = dead.astype(np.int64)
        out["dead_fraction"] = dead / e if slots > 0 else nan
    return {name: out[name] for name in names}


def balance_from_counts(
    counts: np.ndarray, tokens: int, top_k: int, dropped: int = 0, devices: int | None = None
) -> BalanceStats:
    """All balance indicators from per-expert loads [E] of `tokens` tokens routed to `top_k` slots each (the
    n = 1 case of `balance_indicators`); `devices` = D adds ep_balancedness (contiguous placement)."""
    c = np.asarray(counts, dtype=np.int64)
    e = len(c)
    slots = tokens * top_k
    values = {name: v[0].item() for name, v in balance_indicators(c, tokens, top_k).items()}
    balancedness = float("nan")
    if devices is not None:  # raises on E % D != 0 even without load
        balancedness = float(ep_balancedness(contiguous_device_load(c, devices)))  # one layer: [D] → a float
    return BalanceStats(
        tokens=int(tokens),
        top_k=int(top_k),
        counts=c,
        dropped=int(dropped),
        utilisation=c / (slots / e) if tokens > 0 and slots > 0 else np.full(e, np.nan),
        devices=devices,
        ep_balancedness=balancedness,
        **values,
    )


def balance_stats(routing: LayerRouting, devices: int | None = None) -> BalanceStats:
    """Balance of one MoE layer; `devices` = D for expert-parallel balancedness (E % D must be 0)."""
    counts, skipped = routed_counts(routing)
    stats = balance_from_counts(
        counts,
        tokens=len(routing.token_rows),
        top_k=routing.k,
        dropped=int((routing.experts < 0).sum()),
        devices=devices,
    )
    return dataclasses.replace(stats, skipped=skipped) if skipped else stats


BALANCE_COLUMNS = [
    "layer",
    "site",
    "tokens",
    "experts",
    "top_k",
    "dropped",
    "dropped_fraction",
    "skipped_fraction",
    *INDICATOR_NAMES,
    "min_utilisation",
    "max_utilisation",
    "devices",
    "ep_balancedness",
]


def balance_record(layer: int, site: str, s: BalanceStats) -> dict[str, object]:
    """One row of `balance_frame` (keys BALANCE_COLUMNS) from precomputed stats of a layer."""
    empty = not np.isfinite(s.utilisation).any()
    return {
        "layer": layer,
        "site": site,
        "tokens": s.tokens,
        "experts": s.num_experts,
        "top_k": s.top_k,
        "dropped": s.dropped,
        "dropped_fraction": s.dropped_fraction,
        "skipped_fraction": s.skipped_fraction,
        **{name: getattr(s, name) for name in INDICATOR_NAMES},
        "min_utilisation": float("nan") if empty else float(s.utilisation.min()),
        "max_utilisation": float("nan") if empty else float(s.utilisation.max()),
        "devices": s.devices,
        "ep_balancedness": s.ep_balancedness,
    }


def balance_frame(trace: Trace, devices: int | None = None) -> pd.DataFrame:
    """One row per MoE layer (site, layer) with every balance indicator; columns BALANCE_COLUMNS.

    `devices` = D adds expert-parallel balancedness (experts placed contiguously, E/D per device); a layer
    whose E is not a multiple of D raises ValueError. See BalanceStats for the degenerate cases (NaN).
    """
    rows = [balance_record(r.layer, r.site, balance_stats(r, devices)) for r in trace.layers]
    return pd.DataFrame(rows, columns=BALANCE_COLUMNS)


EXPERT_BALANCE_COLUMNS = ["layer", "site", "expert", "count", "share", "utilisation", "dead", "device"]


def expert_balance_frame(trace: Trace, devices: int | None = None) -> pd.DataFrame:
    """One row per (site, layer, expert); columns EXPERT_BALANCE_COLUMNS: count c_e, share f_e = c_e / (kT),
    utilisation c_e / (kT/E) (1 = fair share), dead (c_e = 0 with T > 0) and device (e // (E/D), -1 without
    `devices`).

    Shares are of all kT slots, so a layer's shares sum to 1 − dropped_fraction (`balance_frame` has the
    layer's `dropped` slots and `dropped_fraction`; the load chart draws them as a bar of their own).
    """
    parts = [expert_balance_rows(r.layer, r.site, balance_stats(r, devices)) for r in trace.layers]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=EXPERT_BALANCE_COLUMNS)


def expert_balance_rows(layer: int, site: str, s: BalanceStats) -> pd.DataFrame:
    """The rows of `expert_balance_frame` (columns EXPERT_BALANCE_COLUMNS) for one layer's precomputed stats
    (device from s.devices)."""
    e = s.num_experts
    slots = s.tokens * s.top_k
    share = s.counts / slots if slots else np.full(e, np.nan)
    device = np.arange(e) // (e // s.devices) if s.devices else np.full(e, -1)
    return pd.DataFrame(
        {
            "layer": layer,
            "site": site,
            "expert": np.arange(e),
            "count": s.counts,
            "share": share,
            "utilisation": s.utilisation,
            "dead": (s.counts == 0) & (s.tokens > 0),
            "device": device,
        },
        columns=EXPERT_BALANCE_COLUMNS,
    )


# ---- Load tables: counts without tokens ------------------------------------------------------------------
# An `ExpertLoad` (moeviz.trace.load: an engine's expert counts [S, L, E], no token axis) gives every
# load indicator: the counts summed over its steps are c_e, each layer routed T = Σ_e c_e / k tokens (the
# sources count k slots per token and drop none), so f_e = c_e / (kT) = c_e / Σc.


def load_layer_tokens(counts: np.ndarray, top_k: int) -> np.ndarray:
    """Tokens each layer routed [L] from its counts [L, E]: Σ_e c_e / k, rounded to the nearest token (a
    source whose counts are approximate, such as SGLang's `stat_approx`, may not give a whole number)."""
    totals = np.asarray(counts, dtype=np.int64).sum(axis=-1)
    return np.rint(totals / max(top_k, 1)).astype(np.int64)


def load_balance_stats(load: ExpertLoad, devices: int | None = None) -> list[BalanceStats]:
    """BalanceStats of each MoE layer of an ExpertLoad (counts summed over its steps; nothing dropped);
    `devices` = D adds ep_balancedness (contiguous placement)."""
    counts = load.layer_counts()
    tokens = load_layer_tokens(counts, load.top_k)
    return [
        balance_from_counts(c, int(t), load.top_k, devices=devices)
        for c, t in zip(counts, tokens, strict=True)
    ]


def load_balance_frame(load: ExpertLoad, devices: int | None = None) -> pd.DataFrame:
    """`balance_frame` of an ExpertLoad: one row per MoE layer, columns BALANCE_COLUMNS (site "mlp")."""
    rows = [
        balance_record(layer, "mlp", s)
        for layer, s in zip(load.layers, load_balance_stats(load, devices), strict=True)
    ]
    return pd.DataFrame(rows, columns=BALANCE_COLUMNS)


def load_expert_balance_frame(load: ExpertLoad, devices: int | None = None) -> pd.DataFrame:
    """`expert_balance_frame` of an ExpertLoad: one row per (layer, expert), EXPERT_BALANCE_COLUMNS."""
    parts = [
        expert_balance_rows(layer, "mlp", s)
        for layer, s in zip(load.layers, load_balance_stats(load, devices), strict=True)
    ]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=EXPERT_BALANCE_COLUMNS)


def load_device_load(load: ExpertLoad, devices: int) -> np.ndarray:
    """[L, D] loads of an ExpertLoad's layers placed contiguously over `devices` (as `trace_device_load`)."""
    counts = load.layer_counts()
    return contiguous_device_load(counts, devices) if len(counts) else np.zeros((0, devices))
