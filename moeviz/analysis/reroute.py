"""Re-route captured router logits under other settings (the routing playground), no model run.

From one layer's captured logits: scores = score_fn(logits / temperature); selection = scores + bias (for
selection only, like DeepSeek-V3's correction bias), within the token's best `topk_group` groups where the
router limits groups (and `group_limit`); the top-k of the selection are dispatched with weights = their
scores, renormalised over the k when `renormalise`, times `scale` (DeepSeek-V3's routed scaling factor).
Slots are ordered by weight, largest first. With a capacity factor CF every expert takes at most
C = ceil((T·k/E)·CF) slots per dispatch group = one sequence of T tokens (Megatron's get_capacity,
`moeviz.scoring.expert_capacity`); an over-full expert keeps its C largest weights (the ``probs`` drop
policy; ties → earlier token, then earlier slot) and the rest become dropped slots (expert -1, weight 0;
the kept weights are not renormalised).

Every number is then what `moeviz.analysis` says of the re-routed layer (`Rerouted.as_layer_routing`): load
= `expert_counts`, the aux loss in its dispatched form = `losses.aux_loss_dispatched` (Switch/GShard
E·Σ_e f_e P_e with f_e = tokens sent to e / T, not divided by k: balanced value k).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd

from moeviz.analysis.balance import balance_stats, expert_balance_rows, expert_counts
from moeviz.analysis.confidence import eligible_experts
from moeviz.analysis.losses import aux_loss_dispatched, router_probs, top_k_indices
from moeviz.errors import InputError
from moeviz.scoring import (
    SCORE_FUNCTIONS,
    BiasOn,
    ScoreFn,
    capacity_ranks,
    expert_capacity,
    scores_from_logits,
    selection_scores,
)
from moeviz.trace import LayerRouting, Trace


@dataclass(frozen=True, eq=False)
class RerouteSettings:
    """How to re-route one layer. `RerouteSettings.captured(routing)` reproduces the captured routing.

    k: experts per token (1..E); temperature: logits are divided by it before the score function (> 0);
    score_fn: one of `moeviz.scoring.SCORE_FUNCTIONS`; bias [E] | None: added to the scores (bias_on "scores")
    or the logits (bias_on "logits": Kolibri-1) for selection only;
    capacity_factor: None = no capacity (nothing dropped), else CF > 0 (Megatron capacity per sequence, probs
    drop policy); renormalise: weights = chosen scores / their sum (else the scores themselves); scale: the
    weights' multiplier (DeepSeek-V3's routed_scaling_factor; 1 elsewhere); group_limit: apply the captured
    router's group limit (`LayerRouting.n_group` / `topk_group`) where it has one."""

    k: int
    temperature: float = 1.0
    score_fn: ScoreFn = "softmax"
    bias: np.ndarray | None = None
    capacity_factor: float | None = None
    renormalise: bool = True
    scale: float = 1.0
    group_limit: bool = True
    bias_on: BiasOn = "scores"

    @classmethod
    def captured(cls, routing: LayerRouting) -> RerouteSettings:
        """The settings that reproduce `routing`: its k, score function and bias, temperature 1, no
        capacity, and the weight rule read off its weights (renormalised or not, and the scale)."""
        renormalise, scale = _weight_rule(routing)
        bias = None if routing.bias is None else np.asarray(routing.bias, dtype=np.float32).copy()
        return cls(
            k=routing.k,
            score_fn=routing.score_fn,
            bias=bias,
            renormalise=renormalise,
            scale=scale,
            bias_on=routing.bias_on,
        )

    def key(self) -> tuple:
        """A hashable value that identifies these settings (the bias by its values)."""
        bias = None if self.bias is None else tuple(float(b) for b in np.asarray(self.bias).reshape(-1))
        return (
            int(self.k),
            float(self.temperature),
            self.score_fn,
            bias,
            None if self.capacity_factor is None else float(self.capacity_factor),
            bool(self.renormalise),
            float(self.scale),
            self.bias_on,
            bool(self.group_limit),
        )


def _weight_rule(routing: LayerRouting) -> tuple[bool, float]:
    """(renormalise, scale) read off a captured routing: weights proportional to the chosen scores by one
    constant → not renormalised, scale = that constant; else renormalised, scale = the typical weight sum."""
    full = (routing.experts >= 0).all(axis=1)
    experts, weights = routing.experts[full], routing.weights[full].astype(np.float64)
    if not len(experts):
        return True, 1.0
    chosen = np.take_along_axis(routing.scores[full], experts, axis=1).astype(np.float64)
    ok = chosen > 0
    ratio = float(np.median(weights[ok] / chosen[ok])) if ok.any() else 1.0
    if np.allclose(weights, chosen * ratio, rtol=1e-3, atol=1e-6):
        renormalise, scale = False, ratio
    else:
        renormalise, scale = True, float(np.median(weights.sum(axis=1)))
    scale = float(f"{scale:.4g}")
    return renormalise, (1.0 if math.isclose(scale, 1.0, rel_tol=1e-3) else scale)


def _groups(routing: LayerRouting, settings: RerouteSettings) -> tuple[int, int] | None:
    """(n_group, topk_group) of the captured router's group limit where it binds and `group_limit` asks for
    it (the condition of `confidence.eligible_experts`), else None."""
    n_group, topk_group, e = routing.n_group, routing.topk_group, routing.num_experts
    if not settings.group_limit or not n_group or not topk_group:
        return None
    if n_group <= 1 or topk_group >= n_group or e % n_group:
        return None
    return int(n_group), int(topk_group)


def max_k(routing: LayerRouting, group_limit: bool = True) -> int:
    """The largest k a re-routing of `routing` can take: E, or the experts of the `topk_group` groups a
    group-limited router lets a token choose from."""
    groups = _groups(routing, RerouteSettings(k=1, group_limit=group_limit))
    e = routing.num_experts
    return e if groups is None else groups[1] * (e // groups[0])


def check_settings(routing: LayerRouting, settings: RerouteSettings) -> None:
    """Raise InputError (saying what to change) for settings that cannot re-route `routing`."""
    e = routing.num_experts
    if settings.score_fn not in SCORE_FUNCTIONS:
        raise InputError(f"score function {settings.score_fn!r}: choose one of {', '.join(SCORE_FUNCTIONS)}")
    top = max_k(routing, settings.group_limit)
    if not 1 <= int(settings.k) <= top:
        where = "" if top == e else f" (the group limit leaves {top} of the {e} experts to choose from)"
        raise InputError(f"k = {settings.k}: choose 1 to {top} experts per token{where}")
    if not (math.isfinite(settings.temperature) and settings.temperature > 0):
        raise InputError(f"temperature {settings.temperature}: it must be a positive number")
    if settings.bias is not None:
        bias = np.asarray(settings.bias)
        if bias.shape != (e,):
            raise InputError(f"bias: expected {e} numbers (one per expert), got shape {list(bias.shape)}")
        parse_bias(bias.tolist(), e)
    cf = settings.capacity_factor
    if cf is not None and not (math.isfinite(cf) and cf > 0):
        raise InputError(f"capacity factor {cf}: it must be a positive number (or none, for no capacity)")
    if not (math.isfinite(settings.scale) and settings.scale > 0):
        raise InputError(f"weight scale {settings.scale}: it must be a positive number")


def parse_bias(values: Sequence[object], num_experts: int) -> list[float]:
    """One balancing bias per expert from the values as given (numbers, or text a table cell holds; None for
    an empty cell), as floats. InputError naming the first expert whose value is not a finite number, and
    that value."""
    if len(values) != num_experts:
        raise InputError(f"bias: expected one number per expert ({num_experts}), got {len(values)}")
    parsed = []
    for expert, value in enumerate(values):
        number = _finite_number(value)
        if number is None:
            if value is None or (isinstance(value, str) and not value.strip()):
                raise InputError(f"bias of expert {expert} is empty: give a finite number (0 for none)")
            shown = repr(value) if isinstance(value, str) else str(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "…"
            raise InputError(f"bias of expert {expert}: {shown} is not a finite number")
        parsed.append(number)
    return parsed


def _finite_number(value: object) -> float | None:
    """`value` as a finite float (a real number, or text that spells one); None otherwise."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return None
    elif isinstance(value, (int, float, np.integer, np.floating)):
        number = float(value)
    else:
        return None
    return number if math.isfinite(number) else None


def _capacity_drops(
    experts: np.ndarray, weights: np.ndarray, seqs: np.ndarray, num_experts: int, cf: float
) -> tuple[np.ndarray, np.ndarray]:
    """([N, k] bool: slot dropped, [G] capacity per sequence) under the probs policy: per (sequence, expert)
    the C largest weights stay, ties → earlier token, then earlier slot (`moeviz.scoring.capacity_ranks`)."""
    n, k = experts.shape
    _, group_of_token = np.unique(seqs, return_inverse=True)
    group_of_token = group_of_token.reshape(-1)
    caps = expert_capacity(np.bincount(group_of_token), k, num_experts, cf)
    group = np.repeat(group_of_token, k)
    rank = capacity_ranks(group * num_experts + experts.reshape(-1), weights.reshape(-1))
    return (rank >= caps[group]).reshape(n, k), caps


def reroute(routing: LayerRouting, settings: RerouteSettings, seqs: np.ndarray | None = None) -> Rerouted:
    """Re-route one captured layer under `settings` (module docstring). `seqs` [N]: the sequence of each
    routed token, the capacity's dispatch groups (None: one sequence); `reroute_layer` takes it from a
    trace. Raises InputError for settings that do not fit the layer (`check_settings`)."""
    check_settings(routing, settings)
    n, k = len(routing.token_rows), int(settings.k)
    logits = np.asarray(routing.logits, dtype=np.float32)
    if settings.temperature != 1.0:
        logits = logits / np.float32(settings.temperature)
    scores = scores_from_logits(logits, settings.score_fn)
    bias = None if settings.bias is None else np.asarray(settings.bias, dtype=np.float32)
    biased = logits if settings.bias_on == "logits" and bias is not None else scores
    selection = selection_scores(biased, bias)
    groups = _groups(routing, settings)
    choose_on = selection
    if groups is not None:
        probe = dataclasses.replace(
            routing, logits=logits, score_fn=settings.score_fn, bias=bias, bias_on=settings.bias_on
        )
        eligible = eligible_experts(probe)
        assert eligible is not None  # `_groups` found the group limit binding, as eligible_experts checks it
        choose_on = np.where(eligible, selection, np.float32(-np.inf))
    experts = top_k_indices(choose_on, k) if n else np.zeros((0, k), dtype=np.int64)
    weights = np.take_along_axis(scores, experts, axis=1)
    if settings.renormalise:
        weights = weights / (weights.sum(axis=1, keepdims=True) + np.float32(1e-20))
    if settings.scale != 1.0:
        weights = weights * np.float32(settings.scale)
    order = np.argsort(-weights, axis=1, kind="stable")  # slots by weight, largest first
    experts = np.take_along_axis(experts, order, axis=1).astype(np.int64)
    weights = np.take_along_axis(weights, order, axis=1).astype(np.float32)
    seqs = np.zeros(n, dtype=np.int64) if seqs is None else np.asarray(seqs).reshape(-1)
    if len(seqs) != n:
        raise InputError(f"seqs: expected the sequence of each of the {n} routed tokens, got {len(seqs)}")
    capacity = None
    if settings.capacity_factor is not None and n:
        dropped, caps = _capacity_drops(experts, weights, seqs, routing.num_experts, settings.capacity_factor)
        experts = np.where(dropped, -1, experts)
        weights = np.where(dropped, np.float32(0), weights)
        capacity = int(caps.max())
    return Rerouted(
        routing=routing,
        settings=settings,
        logits=logits,
        scores=scores,
        selection_scores=selection,
        experts=experts,
        weights=weights,
        seqs=seqs,
        capacity=capacity,
        groups=groups,
    )


def reroute_layer(trace: Trace, layer: int, settings: RerouteSettings, site: str | None = None) -> Rerouted:
    """`reroute` of one layer of `trace`, each token's sequence (the capacity's dispatch group) from the
    trace's token table."""
    routing = trace.layer(layer, site)
    return reroute(routing, settings, trace.tokens["seq"].to_numpy()[routing.token_rows])


AUX_TERM_COLUMNS = ["expert", "f", "P", "term"]


def aux_terms(routing: LayerRouting) -> pd.DataFrame:
    """The per-expert terms of the Switch/GShard aux loss of a layer's dispatched experts, columns
    AUX_TERM_COLUMNS: f = tokens dispatched to the expert / T (not divided by k), P = mean router probability
    (`losses.router_probs`), term = E·f·P; the terms sum to `losses.aux_loss_dispatched(probs, experts)`."""
    n, e = len(routing.token_rows), routing.num_experts
    f = expert_counts(routing) / n if n else np.full(e, np.nan)
    p = router_probs(routing).sum(axis=0, dtype=np.float64) / n if n else np.full(e, np.nan)
    return pd.DataFrame({"expert": np.arange(e), "f": f, "P": p, "term": e * f * p}, columns=AUX_TERM_COLUMNS)


def layer_aux_loss_dispatched(routing: LayerRouting) -> float:
    """`losses.aux_loss_dispatched` of a layer's dispatched experts (`LossStats.aux_loss_dispatched`)."""
    return aux_loss_dispatched(router_probs(routing), routing.experts)


def _expert_sets(experts: np.ndarray) -> list[str]:
    """Per token, its dispatched experts (id ≥ 0), ascending, as a label like '1,5' ('' when none)."""
    return [",".join(str(int(x)) for x in sorted(row[row >= 0])) for row in experts]


def _same_sets(a: np.ndarray, b: np.ndarray, num_experts: int) -> np.ndarray:
    """[N] bool: tokens whose dispatched expert sets (ids ≥ 0) of a [N, k] and b [N, k'] are equal."""

    def members(x: np.ndarray) -> np.ndarray:
        out = np.zeros((len(x), num_experts + 1), dtype=bool)
        out[np.arange(len(x))[:, None], np.where(x >= 0, x, num_experts)] = True
        return out[:, :num_experts]

    return (members(a) == members(b)).all(axis=1)


def _bias_or_zeros(bias: np.ndarray | None, num_experts: int) -> np.ndarray:
    """A selection bias [E] as float32, all zeros for None (no bias)."""
    if bias is None:
        return np.zeros(num_experts, dtype=np.float32)
    return np.asarray(bias, dtype=np.float32).reshape(-1)


@dataclass(eq=False)
class Rerouted:
    """One layer re-routed (`reroute`). N tokens, E experts, k = settings.k.

    experts [N, k] (-1 = dropped by capacity), weights [N, k] (0 where dropped), slots by weight (largest
    first); logits [N, E] (the captured logits / temperature), scores [N, E] = score_fn(logits),
    selection_scores [N, E] = scores + bias; seqs [N]: each token's sequence; capacity: the largest
    per-sequence capacity C (None without a capacity factor); groups: (n_group, topk_group) of the group limit
    applied, or None. `routing` is the captured layer."""

    routing: LayerRouting
    settings: RerouteSettings
    logits: np.ndarray
    scores: np.ndarray
    selection_scores: np.ndarray
    experts: np.ndarray
    weights: np.ndarray
    seqs: np.ndarray
    capacity: int | None = None
    groups: tuple[int, int] | None = None

    @cached_property
    def _layer(self) -> LayerRouting:
        grouped = self.groups is not None
        return dataclasses.replace(
            self.routing,
            logits=self.logits,  # scores and selection scores derive from these as `reroute` computed them
            experts=self.experts,
            weights=self.weights,
            score_fn=self.settings.score_fn,
            bias=None if self.settings.bias is None else np.asarray(self.settings.bias, dtype=np.float32),
            decision_source="recomputed",
            top_k=int(self.settings.k),
            capacity=self.capacity,
            n_group=self.routing.n_group if grouped else None,
            topk_group=self.routing.topk_group if grouped else None,
            group_score=self.routing.group_score if grouped else None,
        )

    def as_layer_routing(self) -> LayerRouting:
        """The re-routed layer as a LayerRouting (decision_source "recomputed"), for any moeviz.analysis
        function."""
        return self._layer

    def as_trace(self, trace: Trace) -> Trace:
        """`trace` (the one this layer was captured in) with only this re-routed layer: for the functions and
        charts that take a Trace (`Trace.scores_frame`, `expert_balance_frame`)."""
        return dataclasses.replace(trace, layers=[self._layer], attention=None)

    # ---- load ----------------------------------------------------------------------------------------
    @property
    def load(self) -> np.ndarray:
        """Slots dispatched to each expert [E] (`balance.expert_counts`)."""
        return expert_counts(self._layer)

    @property
    def captured_load(self) -> np.ndarray:
        """The captured routing's slots per expert [E]."""
        return expert_counts(self.routing)

    def load_rows(self, captured: bool = False) -> pd.DataFrame:
        """`expert_balance_frame`'s rows (expert, count, share, utilisation, …) of the re-routed layer, or
        of the captured one: what `moeviz.charts.expert_load_chart` draws."""
        routing = self.routing if captured else self._layer
        return expert_balance_rows(routing.layer, routing.site, balance_stats(routing))

    def load_frame(self) -> pd.DataFrame:
        """One row per expert: captured and rerouted slot counts."""
        return pd.DataFrame(
            {
                "expert": np.arange(self.routing.num_experts),
                "captured": self.captured_load,
                "rerouted": self.load,
            }
        )

    @property
    def dropped_slots(self) -> int:
        """Slots dropped by the capacity (expert -1)."""
        return int((self.experts < 0).sum())

    # ---- aux loss ------------------------------------------------------------------------------------
    @property
    def aux_loss_dispatched(self) -> float:
        """The dispatched form of the aux loss, E·Σ_e f_e P_e of the re-routed dispatch (balanced value: k;
        `losses.AUX_LOSS_FORMS`)."""
        return layer_aux_loss_dispatched(self._layer)

    @property
    def captured_aux_loss_dispatched(self) -> float:
        """The same loss of the captured routing (balanced value: its k)."""
        return layer_aux_loss_dispatched(self.routing)

    @property
    def per_expert_aux_terms(self) -> pd.DataFrame:
        """`aux_terms` of the re-routed layer: expert, f, P, term (= E·f·P; they sum to
        `aux_loss_dispatched`)."""
        return aux_terms(self._layer)

    @property
    def captured_aux_terms(self) -> pd.DataFrame:
        """`aux_terms` of the captured routing."""
        return aux_terms(self.routing)

    def aux_terms_frame(self) -> pd.DataFrame:
        """One row per expert: f, P and term of the captured routing (`*_captured`) and of the re-routed."""
        captured = self.captured_aux_terms.drop(columns="expert").add_suffix("_captured")
        return pd.concat([self.per_expert_aux_terms, captured], axis=1)

    # ---- the aux loss's paradoxes (what the playground explains) --------------------------------------
    @property
    def dispatched_per_token(self) -> float:
        """Σ_e f_e = dispatched slots / T = k − dropped/T: the aux loss's value under even load and even P
        (k without drops; a dropped slot leaves f, so drops lower it)."""
        n = len(self.routing.token_rows)
        return float((self.experts >= 0).sum() / n) if n else math.nan

    @property
    def drops_lower_aux_loss(self) -> bool:
        """The capacity dropped slots and the aux loss is below its balanced value k: f counts only the
        dispatched slots (Σ_e f_e = `dispatched_per_token` < k), so drops lower the loss, balanced or not."""
        return self.dropped_slots > 0 and self.aux_loss_dispatched < int(self.settings.k)

    @property
    def bias_changed(self) -> bool:
        """The selection bias differs from the captured one (None counts as all zeros)."""
        e = self.routing.num_experts
        return not np.array_equal(_bias_or_zeros(self.settings.bias, e), _bias_or_zeros(self.routing.bias, e))

    @property
    def bias_lowers_aux_loss_not_load(self) -> bool:
        """Only the bias moved tokens (the captured k, P and group limit, nothing dropped), the aux loss fell
        below the captured one and the busiest expert got busier: the bias changes f but not P (P is the mean
        of the scores, the bias only picks), so sending tokens to experts of small P lowers E·Σ f_e·P_e while
        the load gets worse."""
        captured_groups = _groups(self.routing, RerouteSettings.captured(self.routing))
        same_p = np.array_equal(self.per_expert_aux_terms["P"], self.captured_aux_terms["P"])
        return (
            self.bias_changed
            and int(self.settings.k) == self.routing.k
            and same_p
            and self.groups == captured_groups
            and self.dropped_slots == 0
            and self.aux_loss_dispatched < self.captured_aux_loss_dispatched
            and int(self.load.max(initial=0)) > int(self.captured_load.max(initial=0))
        )

    @cached_property
    def at_temperature_one(self) -> Rerouted:
        """The same re-routing at temperature 1 (this one where the temperature is 1)."""
        if self.settings.temperature == 1.0:
            return self
        return reroute(self.routing, dataclasses.replace(self.settings, temperature=1.0), self.seqs)

    @property
    def temperature_changed_tokens(self) -> int:
        """Tokens whose dispatched experts differ from the same re-routing at temperature 1. Zero without a
        bias, group limit or capacity: score_fn(logits / τ) keeps each token's order of experts for any
        τ > 0 (both score functions increase with the logit), so the top-k stay; the weights and P change."""
        if self.at_temperature_one is self:
            return 0
        other = self.at_temperature_one.experts
        return int((~_same_sets(self.experts, other, self.routing.num_experts)).sum())

    @property
    def temperature_keeps_choice(self) -> bool:
        """The temperature is not 1 and moved no token's experts (`temperature_changed_tokens`)."""
        return self.settings.temperature != 1.0 and self.temperature_changed_tokens == 0

    # ---- tokens --------------------------------------------------------------------------------------
    @property
    def changed(self) -> np.ndarray:
        """[N] bool: the token's set of dispatched experts differs from the captured one."""
        return ~_same_sets(self.experts, self.routing.experts, self.routing.num_experts)

    @property
    def changed_tokens(self) -> int:
        """Tokens whose set of dispatched experts differs from the captured routing's."""
        return int(self.changed.sum())

    def token_frame(self, trace: Trace) -> pd.DataFrame:
        """One row per routed token (`trace`: the one it was captured in): seq, pos, token, experts_before,
        experts_after (dispatched sets, '1,5'), dropped (slots dropped by the capacity), changed."""
        tokens = trace.tokens.iloc[self.routing.token_rows]
        return pd.DataFrame(
            {
                "seq": tokens["seq"].to_numpy(),
                "pos": tokens["pos"].to_numpy(),
                "token": tokens["token"].to_numpy(),
                "experts_before": _expert_sets(self.routing.experts),
                "experts_after": _expert_sets(self.experts),
                "dropped": (self.experts < 0).sum(axis=1),
                "changed": self.changed,
            }
        )

    # ---- the re-run ----------------------------------------------------------------------------------
    def forced(self, slots: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(experts [N, slots], weights [N, slots]) to force on the model (`moeviz.interventions.ForceRouting`
        at this layer), rows in token-table order (as a forward of one sequence sees them). `slots`: the slots
        the model's experts module takes (default: the captured routing's k); each token's dispatched
        experts fill its first slots, the rest are -1 with weight 0 (which ForceRouting turns into weight 0).
        InputError where a token has more dispatched experts than `slots`."""
        slots = self.routing.k if slots is None else int(slots)
        live = self.experts >= 0
        most = int(live.sum(axis=1).max()) if len(live) else 0
        if most > slots:
            raise InputError(
                f"the model's experts take {slots} slots per token at layer {self.routing.layer}; this "
                f"routing sends a token to {most} experts: choose k ≤ {slots} (or a capacity that drops the "
                "extra slots) to re-run the model with it"
            )
        # live slots first, in their order (weight descending), then the dropped/empty ones
        order = np.argsort(~live, axis=1, kind="stable")
        experts = np.take_along_axis(self.experts, order, axis=1)
        weights = np.take_along_axis(self.weights, order, axis=1)
        n, k = experts.shape
        out_e = np.full((n, slots), -1, dtype=np.int64)
        out_w = np.zeros((n, slots), dtype=np.float32)
        width = min(k, slots)
        out_e[:, :width], out_w[:, :width] = experts[:, :width], weights[:, :width]
        rows = np.argsort(self.routing.token_rows, kind="stable")
        return out_e[rows], out_w[rows]
