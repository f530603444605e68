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

Per domain, when the tokens are labelled (`seq_domains[i]` = the domain of sequence i, as
`specialisation.expert_domain_specialisation` and `domains.domain_top_experts` take them: the sample
evaluation corpus, a `--corpus`):
- domain share of expert e in domain D = c_{e,D} / Σ_e' c_{e',D}, with c_{e,D} = slots of D's paired tokens
  sent to e — `domain_top_experts`' share (dispatched / the domain's dispatched slots; a dropped slot counts
  for no expert and not in the sum); its shift tuned − base has the band of the load shift, a paired
  bootstrap over D's tokens of the layer only; "took the domain" = the band excludes 0 and the share rose,
  "left" = it excludes 0 and the share fell;
- specialisation score of D at a layer, before and after = `expert_domain_specialisation`'s summary of each
  whole trace: max_e DS(e, D), DS(e, D) = #{t ∈ D : e ∈ S_t} / #{t ∈ D} (OLMoE's domain specialisation),
  its top expert, lift = DS / (k/E) and the verdict against the routing-shuffle null.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from moeviz.analysis.collapse import Verdict, collapse_report
from moeviz.analysis.compare import _matched_layers
from moeviz.analysis.engine_diff import EngineDiff, _pair_rows, align_traces, engine_diff
from moeviz.analysis.null import bootstrap_counts
from moeviz.analysis.specialisation import _domain_codes, expert_domain_specialisation
from moeviz.errors import InputError
from moeviz.trace import Trace

DEFINITION = (
    "load shift = f_tuned − f_base per expert, f = slots/(k·pairs), band = paired bootstrap percentile "
    "interval; balance = collapse verdict before/after; router delta = ‖W_tuned − W_base‖_F of the router "
    "weight, rank = singular values above max(E, H)·eps·σ_max(W_base); domain share = slots of the "
    "domain's tokens to e / the domain's dispatched slots, took = its paired bootstrap band over the "
    "domain's tokens excludes 0 and the share rose; specialisation = max_e DS(e, D) before/after"
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
DOMAIN_SHIFT_COLUMNS = [
    "layer",
    "site",
    "domain",
    "expert",
    "tokens",
    "share_base",
    "share_tuned",
    "shift",
    "shift_low",
    "shift_high",
    "took",
    "left",
]
SPECIALISATION_COLUMNS = [
    "layer",
    "site",
    "domain",
    "tokens",
    "baseline",
    "top_expert_base",
    "ds_base",
    "lift_base",
    "verdict_base",
    "top_expert_tuned",
    "ds_tuned",
    "lift_tuned",
    "verdict_tuned",
    "ds_change",
    "took",
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
    _check_band(level, draws)
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


def _check_band(level: float, draws: int) -> None:
    if not 0 < level < 1:
        raise InputError(f"level must be in (0, 1), got {level}")
    if draws < 1:
        raise InputError(f"draws must be >= 1, got {draws}")


def _labels(trace: Trace, seq_domains: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(domain names [D], domain code of each token row of `trace` [T]); InputError for too few labels."""
    try:
        return _domain_codes(trace, seq_domains)
    except ValueError as exc:
        raise InputError(f"cannot label the tokens by domain: {exc}") from None


def domain_shift_frame(
    base: Trace,
    tuned: Trace,
    seq_domains: Sequence[str],
    *,
    level: float = 0.9,
    draws: int = 1000,
    seed: int = 0,
) -> pd.DataFrame:
    """One row per (layer, site, domain, expert) of the layers both traces routed: the expert's share of
    the domain's dispatched slots before and after, the shift, its paired bootstrap band over the domain's
    tokens at `level`, and whether the expert took (band > 0) or left (band < 0) the domain (module
    docstring). `seq_domains[i]` labels sequence i of `base`; a domain with no token at a layer gets NaN."""
    _check_band(level, draws)
    names, codes = _labels(base, seq_domains)
    mapping = align_traces(base, tuned).mapping
    q = [(1 - level) / 2, 1 - (1 - level) / 2]
    parts = []
    for x, y in _common_layers(base, tuned):
        rows, ia, ib = _pair_rows(x, y, mapping, len(tuned.tokens), identity=False)
        assert ia is not None and ib is not None  # identity=False always gives the row indices
        e, domain_of = x.num_experts, codes[rows]
        for d, name in enumerate(names):
            sel = domain_of == d
            ea, eb = x.experts[ia[sel]], y.experts[ib[sel]]
            both = np.concatenate([ea, np.where(eb >= 0, eb + e, -1)], axis=1)  # [M_D, k_a + k_b]
            counts = np.bincount(both[both >= 0], minlength=2 * e).astype(np.float64)
            share_a, share_b = _shares(counts[None, :e])[0], _shares(counts[None, e:])[0]
            low = high = np.full(e, np.nan)
            if len(both):
                boot = bootstrap_counts(both, 2 * e, draws, seed)  # [draws, 2E] the same tokens both sides
                low, high = np.quantile(_shares(boot[:, e:]) - _shares(boot[:, :e]), q, axis=0)
            parts.append(
                pd.DataFrame(
                    {
                        "layer": x.layer,
                        "site": x.site,
                        "domain": name,
                        "expert": np.arange(e),
                        "tokens": int(sel.sum()),
                        "share_base": share_a,
                        "share_tuned": share_b,
                        "shift": share_b - share_a,
                        "shift_low": low,
                        "shift_high": high,
                        "took": low > 0,
                        "left": high < 0,
                    }
                )
            )
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    return frame.reindex(columns=DOMAIN_SHIFT_COLUMNS)


def _shares(counts: np.ndarray) -> np.ndarray:
    """[N, E] each row's counts over its sum; NaN where a row has none (every slot dropped, or no token)."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, counts / np.where(total > 0, total, 1.0), np.nan)


def specialisation_change_frame(
    base: Trace,
    tuned: Trace,
    seq_domains: Sequence[str],
    *,
    shuffles: int = 100,
    seed: int = 0,
    domain_shift: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """One row per (layer, site, domain) both traces hold: the domain's specialisation score before and
    after (`expert_domain_specialisation(...).summary` of each trace: its top expert, ds = max_e DS(e, D),
    lift over k/E, the verdict against `shuffles` routing shuffles), ds_change = ds_tuned − ds_base, and —
    given `domain_shift_frame`'s frame — took, the number of experts that took the domain there."""
    _labels(base, seq_domains)
    before = expert_domain_specialisation(base, seq_domains, shuffles=shuffles, seed=seed).summary
    after = expert_domain_specialisation(tuned, seq_domains, shuffles=shuffles, seed=seed).summary
    if before.empty or after.empty:
        return pd.DataFrame(columns=SPECIALISATION_COLUMNS)
    keep = ["layer", "site", "domain", "top_expert", "ds", "lift", "verdict"]
    frame = before[[*keep, "tokens", "baseline"]].merge(
        after[keep], on=["layer", "site", "domain"], suffixes=("_base", "_tuned")
    )
    frame["ds_change"] = frame["ds_tuned"] - frame["ds_base"]
    if domain_shift is not None and len(domain_shift):
        took = domain_shift.groupby(["layer", "site", "domain"], as_index=False)["took"].sum()
        frame = frame.drop(columns="took", errors="ignore").merge(
            took, on=["layer", "site", "domain"], how="left"
        )
        frame["took"] = frame["took"].fillna(0).astype(np.int64)
    else:
        frame["took"] = pd.NA
    return frame.reindex(columns=SPECIALISATION_COLUMNS)


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
    - domain_shift: per (layer, site, domain, expert), `domain_shift_frame`; specialisation: per (layer,
      site, domain), `specialisation_change_frame` (both None without domain labels)
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
    domain_shift: pd.DataFrame | None = None
    specialisation: pd.DataFrame | None = None

    @property
    def degraded(self) -> bool:
        """The fine-tune's model verdict is worse than the base's."""
        return self.verdict_tuned > self.verdict_base

    def moved_experts(self) -> pd.DataFrame:
        """The experts whose load shift band excludes 0, largest |shift| first."""
        moved = self.load_shift[self.load_shift["moved"]]
        return moved.reindex(moved["shift"].abs().sort_values(ascending=False).index)

    def took_domains(self) -> pd.DataFrame:
        """The (layer, domain, expert) rows whose expert took the domain, largest shift first (empty without
        domain labels)."""
        if self.domain_shift is None:
            return pd.DataFrame(columns=DOMAIN_SHIFT_COLUMNS)
        took = self.domain_shift[self.domain_shift["took"]]
        return took.sort_values("shift", ascending=False, kind="stable")

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
            "domain_shift": None if self.domain_shift is None else self.domain_shift.to_dict("records"),
            "specialisation": (
                None if self.specialisation is None else self.specialisation.to_dict("records")
            ),
            "definition": self.definition,
        }


def finetune_diff(
    base: Trace,
    tuned: Trace,
    *,
    base_weights: dict[tuple[str, int], RouterWeight] | None = None,
    tuned_weights: dict[tuple[str, int], RouterWeight] | None = None,
    seq_domains: Sequence[str] | None = None,
    level: float = 0.9,
    draws: int = 1000,
    seed: int = 0,
    shuffles: int = 100,
) -> FinetuneDiff:
    """Diff the routing of a fine-tune (`tuned`) against its base (`base`) on the same tokens; with both
    models' `router_weights`, the router-weight delta per layer too; with `seq_domains` (the domain of each
    sequence of `base`), the domain shift and the specialisation change (`shuffles`: the routing shuffles
    of the specialisation verdicts). InputError when the traces hold different tokens or no common MoE
    layer, or `seq_domains` labels fewer sequences than `base` has."""
    routing = engine_diff(base, tuned)
    shift = load_shift_frame(base, tuned, level=level, draws=draws, seed=seed)
    balance, before, after = balance_change_frame(base, tuned)
    delta = None
    if base_weights is not None and tuned_weights is not None:
        delta = router_delta_frame(base_weights, tuned_weights)
    domain_shift = specialisation = None
    if seq_domains is not None:
        domain_shift = domain_shift_frame(base, tuned, seq_domains, level=level, draws=draws, seed=seed)
        specialisation = specialisation_change_frame(
            base, tuned, seq_domains, shuffles=shuffles, seed=seed, domain_shift=domain_shift
        )
    return FinetuneDiff(
        routing,
        shift,
        balance,
        before,
        after,
        delta,
        level,
        draws,
        domain_shift=domain_shift,
        specialisation=specialisation,
    )


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
