"""Base vs fine-tuned on the same tokens: what a fine-tune (a LoRA adapter merged over its base, or a full
fine-tune) did to the routing, beyond the engine diff's mismatch (`engine_diff`: router mismatch per layer,
tokens that moved, by margin), which applies to the two traces as it is.

Definitions. A pair is one (token, MoE layer) both traces routed (tokens aligned as `engine_diff` aligns
them); M = pairs of a layer, k = slots per token, c_e = slots sent to expert e (a dropped slot, −1, to none):
- load shift of expert e = f^tuned_e − f^base_e with f_e = c_e / (k·M), the share `null.load_confidence`
  reports; its band is the percentile interval at `level` of the shift over `draws` paired bootstrap
  resamples of the M tokens (one resample draws the same tokens for both sides: `null.bootstrap_counts` over
  the two dispatches side by side); `moved` = the band excludes 0;
- balance: the collapse verdict of each layer before and after (`collapse.collapse_report` of each whole
  trace), `degraded` = the fine-tuned verdict is worse; the model's verdict is the worst layer's;
- router-weight delta of a layer: Δ = W^tuned − W^base of its router's [E, H] weight (float64 of the weights
  as loaded); norm = ‖Δ‖_F, relative = ‖Δ‖_F / ‖W^base‖_F, rank = #{σ_i(Δ) > tol} with tol = max(E, H) ·
  eps(dtype) · σ_max(W^base) — the rounding of the weights themselves, so a LoRA of rank r merged in fp32
  shows rank ≤ r and an unchanged router rank 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from moeviz.analysis.collapse import Verdict, collapse_report
from moeviz.analysis.compare import _matched_layers
from moeviz.analysis.engine_diff import EngineDiff, _pair_rows, align_traces, engine_diff
from moeviz.analysis.null import bootstrap_counts
from moeviz.errors import InputError
from moeviz.trace import Trace

DEFINITION = (
    "load shift = f_tuned − f_base per expert, f = slots/(k·pairs), band = paired bootstrap percentile "
    "interval; balance = collapse verdict before/after; router delta = ‖W_tuned − W_base‖_F of the router "
    "weight, rank = singular values above max(E, H)·eps·σ_max(W_base)"
)
LOAD_SHIFT_COLUMNS = [
    "layer",
    "site",
    "expert",
    "share_base",
    "share_tuned",
    "shift",
    "shift_low",
    "shift_high",
    "moved",
]
BALANCE_COLUMNS = [
    "layer",
    "site",
    "verdict_base",
    "verdict_tuned",
    "degraded",
    "max_share_base",
    "max_share_tuned",
    "load_entropy_base",
    "load_entropy_tuned",
    "dead_fraction_base",
    "dead_fraction_tuned",
    "reasons_tuned",
]
DELTA_COLUMNS = [
    "layer",
    "site",
    "module",
    "rows",
    "cols",
    "norm",
    "base_norm",
    "relative",
    "rank",
    "sigma_max",
]


@dataclass(frozen=True)
class RouterWeight:
    """One MoE layer's router weight, as loaded: module path, [E, H] in float64, and the machine epsilon of
    the dtype it was loaded at (the rounding the rank tolerance allows for)."""

    module: str
    weight: np.ndarray
    eps: float


def router_weights(loaded: Any) -> dict[tuple[str, int], RouterWeight]:
    """{(site, layer): RouterWeight} of a loaded model's MoE layers (`LoadedModel.sites`): the router's 2-D
    parameter with one row per expert (a `*TopKRouter`'s `weight`, or its inner Linear's). Copies: the
    model may be dropped afterwards. Layers whose router holds no such matrix are left out."""
    import torch

    weights = {}
    for site in loaded.sites:
        found = [
            (name, p)
            for name, p in site.router.named_parameters()
            if p.ndim == 2 and p.shape[0] == site.num_experts and not p.is_meta
        ]
        if not found:
            continue
        name, param = found[0]
        eps = float(torch.finfo(param.dtype).eps) if param.dtype.is_floating_point else 0.0
        array = param.detach().to("cpu", torch.float64).numpy().copy()
        weights[(site.site, site.layer)] = RouterWeight(f"{site.name}.{name}", array, eps)
    return weights


def router_delta_frame(
    base: dict[tuple[str, int], RouterWeight], tuned: dict[tuple[str, int], RouterWeight]
) -> pd.DataFrame:
    """Per MoE layer both sides have: the norm, relative norm and rank of the router-weight delta (module
    docstring); InputError when a layer's router has another shape on each side (not the same base)."""
    rows = []
    for key in sorted(set(base) & set(tuned), key=lambda k: (k[1], k[0])):
        w0, w1 = base[key].weight, tuned[key].weight
        if w0.shape != w1.shape:
            raise InputError(
                f"layer {key[1]} ({key[0]}): the router is {list(w0.shape)} in the base and {list(w1.shape)} "
                "in the fine-tune: not the same base"
            )
        delta = w1 - w0
        sigma = np.linalg.svd(delta, compute_uv=False)
        base_sigma = float(np.linalg.norm(w0, 2))
        tol = max(w0.shape) * max(base[key].eps, tuned[key].eps) * base_sigma
        norm, base_norm = float(np.linalg.norm(delta)), float(np.linalg.norm(w0))
        rows.append(
            {
                "layer": key[1],
                "site": key[0],
                "module": base[key].module,
                "rows": w0.shape[0],
                "cols": w0.shape[1],
                "norm": norm,
                "base_norm": base_norm,
                "relative": norm / base_norm if base_norm else np.nan,
                "rank": int((sigma > tol).sum()),
                "sigma_max": float(sigma[0]) if len(sigma) else 0.0,
            }
        )
    return pd.DataFrame(rows, columns=DELTA_COLUMNS)


def load_shift_frame(
    base: Trace, tuned: Trace, *, level: float = 0.9, draws: int = 1000, seed: int = 0
) -> pd.DataFrame:
    """One row per (layer, site, expert) of the layers both traces routed: each side's share, the shift and
    its paired bootstrap band at `level`, and whether the band excludes 0 (module docstring)."""
    if not 0 < level < 1:
        raise InputError(f"level must be in (0, 1), got {level}")
    if draws < 1:
        raise InputError(f"draws must be >= 1, got {draws}")
    mapping = align_traces(base, tuned).mapping
    q = [(1 - level) / 2, 1 - (1 - level) / 2]
    parts = []
    for x, y in _common_layers(base, tuned):
        _, ia, ib = _pair_rows(x, y, mapping, len(tuned.tokens), identity=False)
        ea, eb = x.experts[ia], y.experts[ib]
        e, m = x.num_experts, len(ea)
        slots_a, slots_b = m * ea.shape[1], m * eb.shape[1]
        both = np.concatenate([ea, np.where(eb >= 0, eb + e, -1)], axis=1)  # [M, k_a + k_b] one id space
        counts = np.bincount(both[both >= 0], minlength=2 * e)
        boot = bootstrap_counts(both, 2 * e, draws, seed)  # [draws, 2E] the same tokens for both sides
        share_a = counts[:e] / slots_a if m else np.full(e, np.nan)
        share_b = counts[e:] / slots_b if m else np.full(e, np.nan)
        if m:
            spread = boot[:, e:] / slots_b - boot[:, :e] / slots_a
            low, high = np.quantile(spread, q, axis=0)
        else:
            low = high = np.full(e, np.nan)
        parts.append(
            pd.DataFrame(
                {
                    "layer": x.layer,
                    "site": x.site,
                    "expert": np.arange(e),
                    "share_base": share_a,
                    "share_tuned": share_b,
                    "shift": share_b - share_a,
                    "shift_low": low,
                    "shift_high": high,
                    "moved": (low > 0) | (high < 0),
                }
            )
        )
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    return frame.reindex(columns=LOAD_SHIFT_COLUMNS)


def _common_layers(base: Trace, tuned: Trace):
    try:
        return _matched_layers(base, tuned)
    except ValueError as exc:
        raise InputError(f"cannot diff these routings: {exc}") from None


def balance_change_frame(base: Trace, tuned: Trace) -> tuple[pd.DataFrame, Verdict, Verdict]:
    """Per MoE layer both traces hold: the collapse verdict and the load indicators before and after, and
    whether the verdict got worse; with the two model verdicts (the worst layer's)."""
    before, after = collapse_report(base), collapse_report(tuned)
    tuned_layers = {(lv.site, lv.layer): lv for lv in after.layers}
    rows = []
    for lv in before.layers:
        lt = tuned_layers.get((lv.site, lv.layer))
        if lt is None:
            continue
        rows.append(
            {
                "layer": lv.layer,
                "site": lv.site,
                "verdict_base": str(lv.verdict),
                "verdict_tuned": str(lt.verdict),
                "degraded": lt.verdict > lv.verdict,
                "max_share_base": lv.balance.max_share,
                "max_share_tuned": lt.balance.max_share,
                "load_entropy_base": lv.balance.load_entropy,
                "load_entropy_tuned": lt.balance.load_entropy,
                "dead_fraction_base": lv.balance.dead_fraction,
                "dead_fraction_tuned": lt.balance.dead_fraction,
                "reasons_tuned": "; ".join(lt.reasons),
            }
        )
    return pd.DataFrame(rows, columns=BALANCE_COLUMNS), before.verdict, after.verdict


@dataclass
class FinetuneDiff:
    """Base vs fine-tuned on the same tokens (the module docstring defines every column).

    - routing: the engine diff of the two traces (router mismatch per layer, tokens that moved, by margin)
    - load_shift: per (layer, site, expert), `load_shift_frame`
    - balance: per layer, `balance_change_frame`; verdict_base, verdict_tuned: the model's
    - router_delta: per layer, `router_delta_frame` (None without the two models' router weights)
    """

    routing: EngineDiff
    load_shift: pd.DataFrame
    balance: pd.DataFrame
    verdict_base: Verdict
    verdict_tuned: Verdict
    router_delta: pd.DataFrame | None
    level: float
    draws: int
    definition: str = DEFINITION

    @property
    def degraded(self) -> bool:
        """The fine-tune's model verdict is worse than the base's."""
        return self.verdict_tuned > self.verdict_base

    def moved_experts(self) -> pd.DataFrame:
        """The experts whose load shift band excludes 0, largest |shift| first."""
        moved = self.load_shift[self.load_shift["moved"]]
        return moved.reindex(moved["shift"].abs().sort_values(ascending=False).index)

    def to_json(self) -> dict[str, Any]:
        """Everything as plain JSON types (NaN → null left to the caller's encoder)."""
        delta = None if self.router_delta is None else self.router_delta.to_dict("records")
        return {
            "routing": self.routing.to_json(None),
            "verdict_base": str(self.verdict_base),
            "verdict_tuned": str(self.verdict_tuned),
            "degraded": self.degraded,
            "balance": self.balance.to_dict("records"),
            "load_shift": self.load_shift.to_dict("records"),
            "level": self.level,
            "draws": self.draws,
            "router_delta": delta,
            "definition": self.definition,
        }


def finetune_diff(
    base: Trace,
    tuned: Trace,
    *,
    base_weights: dict[tuple[str, int], RouterWeight] | None = None,
    tuned_weights: dict[tuple[str, int], RouterWeight] | None = None,
    level: float = 0.9,
    draws: int = 1000,
    seed: int = 0,
) -> FinetuneDiff:
    """Diff the routing of a fine-tune (`tuned`) against its base (`base`) on the same tokens; with both
    models' `router_weights`, the router-weight delta per layer too. InputError when the traces hold
    different tokens or no common MoE layer."""
    routing = engine_diff(base, tuned)
    shift = load_shift_frame(base, tuned, level=level, draws=draws, seed=seed)
    balance, before, after = balance_change_frame(base, tuned)
    delta = None
    if base_weights is not None and tuned_weights is not None:
        delta = router_delta_frame(base_weights, tuned_weights)
    return FinetuneDiff(routing, shift, balance, before, after, delta, level, draws)


def adapter_summary(trace: Trace) -> str:
    """'LoRA r=8, alpha=16 on …' from a trace's `ModelInfo.adapter` ("" for a base without adapter)."""
    text = trace.model.adapter
    if not text:
        return ""
    try:
        raw = json.loads(text)
        targets = [*raw.get("target_modules", []), *raw.get("target_parameters", [])]
        return f"LoRA r={raw['rank']}, alpha={raw['alpha']:g} on {', '.join(targets)} ({raw['path']})"
    except (ValueError, KeyError, TypeError):
        return "an adapter (its record is not readable)"
