"""What if the routing had been different? Run a prompt with interventions and compare before/after.

Everything runs through hooks installed for the one call (`moeviz.interventions.hooks`); the model is
never edited and other sessions sharing it are unaffected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import nn

from moeviz.capture.forward import capture, token_batch
from moeviz.capture.layer_progress import layer_progress
from moeviz.errors import InputError, NoEffectError
from moeviz.hooks import active_on_thread, shared_hooks
from moeviz.interventions.hooks import Probe, probing
from moeviz.interventions.specs import (
    DisableExpert,
    ForceExpert,
    Intervention,
    _DisablePerSequence,
    _positions,
    apply,
    resolve,
)
from moeviz.models.loading import LoadedModel
from moeviz.models.sites import MoESite
from moeviz.trace import LayerRouting, Trace

Progress = Callable[[float, str], None]  # (fraction done, what is running)


def sequence_ids(loaded: LoadedModel, text: str | None, token_ids: Sequence[int] | None) -> list[int]:
    """One sequence of token ids from `text` or `token_ids` (validated like `capture`)."""
    if loaded.is_encoder_decoder:
        raise InputError("attribution and counterfactual routing cover decoder-only models")
    loaded.refuse_token_classifier("attribution and counterfactual routing")
    if token_ids is not None and len(token_ids) and not isinstance(token_ids[0], (int, np.integer)):
        raise InputError("give one sequence of token ids (a flat list of ints)")
    return token_batch(loaded, text, None if token_ids is None else [list(token_ids)])[0]


@contextmanager
def intervening(loaded: LoadedModel, interventions: Sequence[Intervention], seq_len: int) -> Iterator[Probe]:
    """Apply `interventions` to every forward this thread runs on `loaded` inside the block.

    `seq_len` is the length S of the [B, S] input, mapping a call's flattened rows to positions."""
    plan = resolve(loaded.sites, interventions)
    sites = loaded.sites

    def rewrite(site_index, index, weights, logits):
        shape = index.shape
        idx, w = index.reshape(-1, shape[-1]), weights.reshape(-1, shape[-1])
        for spec in plan[site_index]:
            idx, w = apply(spec, sites[site_index], idx, w, logits, seq_len)
        return idx, w

    probe = Probe()
    if plan:
        probe.rewrite, probe.rewrite_sites = rewrite, set(plan)
    with probing(loaded.model, sites, probe):
        yield probe


_kept = threading.local()  # .logits: this thread's list of kept [B, S, V] logits, or None


@contextmanager
def _keeping_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Keep the logits of every forward of `model` this thread runs in the block, so one capture gives the
    routing and the next-token log-probabilities (a forward instead of two)."""

    def keep(_module: nn.Module, _args: object, output: object) -> None:
        store = getattr(_kept, "logits", None)
        logits = getattr(output, "logits", None)
        if store is not None and logits is not None:
            store.append(logits)

    kept: list[torch.Tensor] = []
    install = lambda: [model.register_forward_hook(keep)]  # noqa: E731
    with shared_hooks(model, "counterfactual-logits", install), active_on_thread(_kept, "logits", kept):
        yield kept


def _capture_with_logprobs(loaded: LoadedModel, ids: list[int]) -> tuple[Trace, torch.Tensor]:
    """One forward of one sequence: its routing and its [S, V] next-token log-probabilities (fp32)."""
    with _keeping_logits(loaded.model) as kept:
        trace = capture(loaded, token_ids=[ids])
    if len(kept) != 1:
        raise RuntimeError(f"expected the logits of one forward, saw {len(kept)}")
    return trace, torch.log_softmax(kept[0][0].float(), dim=-1).cpu()


def _dispatched_mask(routing: LayerRouting) -> np.ndarray:
    """[N, k] bool: the slot sends the token to its expert (id ≥ 0 and a weight that is not 0; every kept
    slot where the source records no weights)."""
    kept = routing.experts >= 0
    return kept & (routing.weights != 0) if routing.has_weights else kept


def _describe_rows(positions: tuple[int, ...] | None) -> str:
    if positions is None:
        return "any token"
    if len(positions) == 1:
        return f"the token at position {positions[0]}"
    return f"any of the tokens at positions {', '.join(map(str, positions))}"


def _no_effect_one(trace: Trace, spec: Intervention) -> str | None:
    """Why `spec` alone changes nothing on the input `trace` routed, or None where it may change something
    (or this cannot be told from the trace)."""
    if not isinstance(spec, (DisableExpert, ForceExpert)):
        return None  # next-best always replaces an expert; a forced routing is checked by its caller
    targets = [
        r
        for r in trace.layers
        if (spec.layer is None or r.layer == spec.layer) and spec.site in (None, r.site)
    ]
    if not targets or any(r.loop_pass or r.decision_source == "recomputed" for r in targets):
        return None  # a looped block or a routing the model did not report: the trace cannot tell
    positions = _positions(spec.positions)
    pos_of_row = trace.tokens["pos"].to_numpy()
    for routing in targets:
        rows = np.ones(len(routing.token_rows), bool)
        if positions is not None:
            rows = np.isin(pos_of_row[routing.token_rows], positions)
        if isinstance(spec, DisableExpert):
            if (_dispatched_mask(routing)[rows] & (routing.experts[rows] == spec.expert)).any():
                return None
            continue
        if not routing.ranked or spec.rank >= routing.experts.shape[1]:
            return None
        experts, weights = routing.experts[rows], routing.weights[rows]
        at_rank = experts[:, spec.rank] == spec.expert
        # a tie with another slot's weight: the model may rank the slots the other way round
        tied = (np.isclose(weights, weights[:, spec.rank : spec.rank + 1], rtol=0, atol=0)).sum(axis=1) > 1
        if not at_rank.all() or tied.any() or not routing.has_weights:
            return None
    where = f"layer {spec.layer}" if spec.layer is not None else "any MoE layer"
    who = _describe_rows(positions)
    if isinstance(spec, DisableExpert):
        return (
            f"expert {spec.expert} is not dispatched by {who} at {where}: disabling it cannot change anything"
        )
    return (
        f"{who[0].upper()}{who[1:]} already sends its rank-{spec.rank} slot to expert {spec.expert} at "
        f"{where}: forcing it there cannot change anything"
    )


def no_effect_reason(trace: Trace, interventions: Sequence[Intervention]) -> str | None:
    """One line saying why `interventions` cannot change the model's output on the input `trace` routed
    (every one is a no-op there: a disabled expert no targeted token is dispatched to, a forced expert
    every targeted token already has in that slot), or None where they may. Read from the trace alone: no
    forward. A no-op at every layer leaves every later layer's input, and so the output, unchanged."""
    found = [_no_effect_one(trace, spec) for spec in interventions]
    reasons = [reason for reason in found if reason is not None]
    if not reasons or len(reasons) != len(found):
        return None
    return "; ".join(dict.fromkeys(reasons))


def next_token_logprobs(loaded: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """[B, S] ids -> [B, S, V] next-token log-probabilities (fp32) of one plain forward."""
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits
    return torch.log_softmax(logits.float(), dim=-1)


@dataclass
class Counterfactual:
    """Before/after of one prompt under interventions. T = tokens in the prompt.

    - token_ids [T], tokens [T]: the prompt
    - logprob_before / logprob_after [T-1]: log p(token[i+1] | tokens ≤ i) without / with the interventions
    - next_id: the model's own argmax after the last token (before); next_logprob_before/after its log-prob;
      next_id_after: the argmax with the interventions
    - before / after: the routing traces (after = what the experts actually received)
    """

    interventions: tuple[Intervention, ...]
    token_ids: np.ndarray
    tokens: list[str]
    logprob_before: np.ndarray
    logprob_after: np.ndarray
    next_id: int
    next_token: str
    next_logprob_before: float
    next_logprob_after: float
    next_id_after: int
    next_token_after: str
    before: Trace
    after: Trace

    def __post_init__(self) -> None:
        t = len(self.token_ids)
        if len(self.tokens) != t:
            raise ValueError(f"tokens: expected {t} strings, got {len(self.tokens)}")
        for name in ("logprob_before", "logprob_after"):
            arr = getattr(self, name)
            if arr.shape != (max(t - 1, 0),):
                raise ValueError(f"{name}: expected shape [{t - 1}] (T-1 next tokens), got {list(arr.shape)}")

    @property
    def next_logprob_change(self) -> float:
        return self.next_logprob_after - self.next_logprob_before

    @property
    def intervened_positions(self) -> tuple[int, ...] | None:
        """Positions the interventions act at (sorted), or None where one acts at every position."""
        found: set[int] = set()
        for spec in self.interventions:
            positions = getattr(spec, "positions", None)
            if positions is None:
                return None
            single = isinstance(positions, (int, np.integer))
            found.update([int(positions)] if single else map(int, positions))
        return tuple(sorted(found))

    @property
    def first_intervened(self) -> int:
        """The earliest position an intervention acts at (0 where one acts at every position)."""
        positions = self.intervened_positions
        return 0 if positions is None else min(positions, default=0)

    def position_frame(self) -> pd.DataFrame:
        """One row per position t < T-1: Δ log-prob of the prompt's actual next token,
        delta = log p_after(x_{t+1} | x_≤t) − log p_before(x_{t+1} | x_≤t).

        Columns pos, token (x_t), next_token (x_{t+1}), logprob_before, logprob_after, delta,
        intervened (an intervention acts at t), after (t ≥ `first_intervened`: a prediction the
        intervention can reach; earlier ones are 0 exactly in a causal model) and routing_changed (the
        dispatched experts of x_t changed at some MoE layer, `routing_changes`)."""
        t = len(self.token_ids)
        pos = np.arange(max(t - 1, 0))
        changes = self.routing_changes()
        changed = set(changes.loc[changes["changed"], "pos"].astype(int))
        positions = self.intervened_positions
        return pd.DataFrame(
            {
                "pos": pos,
                "token": self.tokens[:-1],
                "next_token": self.tokens[1:],
                "logprob_before": self.logprob_before,
                "logprob_after": self.logprob_after,
                "delta": self.logprob_after - self.logprob_before,
                "intervened": [positions is None or int(p) in positions for p in pos],
                "after": pos >= self.first_intervened,
                "routing_changed": [int(p) in changed for p in pos],
            }
        )

    @property
    def deltas_after(self) -> np.ndarray:
        """Δ log-prob of the actual next token at the positions from `first_intervened` on."""
        return (self.logprob_after - self.logprob_before)[self.first_intervened :]

    @property
    def mean_delta_after(self) -> float:
        """Mean Δ log-prob of the actual next token over the positions from the first intervened one on
        (`position_frame`'s rows with `after`); NaN where there are none (an intervention at the last
        token: see `next_logprob_change`)."""
        delta = self.deltas_after
        return float(delta.mean()) if len(delta) else float("nan")

    @property
    def max_abs_delta_after(self) -> float:
        """Largest |Δ log-prob| over the same positions as `mean_delta_after` (NaN where none)."""
        delta = self.deltas_after
        return float(np.abs(delta).max()) if len(delta) else float("nan")

    def token_frame(self) -> pd.DataFrame:
        """One row per position: the log-prob of the *next* prompt token before/after and its change."""
        t = len(self.token_ids)
        return pd.DataFrame(
            {
                "pos": np.arange(t - 1),
                "token": self.tokens[:-1],
                "next_token": self.tokens[1:],
                "logprob_before": self.logprob_before,
                "logprob_after": self.logprob_after,
                "change": self.logprob_after - self.logprob_before,
            }
        )

    def routing_changes(self) -> pd.DataFrame:
        """One row per (pos, MoE layer): dispatched experts before/after (weight > 0), whether the set
        changed, and the L1 change of the router scores (0 where the router saw the same input)."""
        frames = []
        pos_of_row = self.before.tokens["pos"].to_numpy()
        for b in self.before.layers:
            a = self.after.layer(b.layer, b.site)
            eb, ea = _dispatched(b.experts, b.weights), _dispatched(a.experts, a.weights)
            frames.append(
                pd.DataFrame(
                    {
                        "pos": pos_of_row[b.token_rows],
                        "token": np.asarray(self.tokens, dtype=object)[pos_of_row[b.token_rows]],
                        "layer": b.layer,
                        "site": b.site,
                        "experts_before": eb,
                        "experts_after": ea,
                        "changed": [x != y for x, y in zip(eb, ea, strict=True)],
                        "score_change": np.abs(a.scores - b.scores).sum(axis=1),
                    }
                )
            )
        return pd.concat(frames, ignore_index=True)

    def layer_summary(self) -> pd.DataFrame:
        """Per MoE layer: tokens whose dispatched experts changed, and the mean router-score change."""
        frame = self.routing_changes()
        return (
            frame.groupby(["layer", "site"], sort=True)
            .agg(
                tokens_changed=("changed", "sum"),
                fraction_changed=("changed", "mean"),
                mean_score_change=("score_change", "mean"),
            )
            .reset_index()
        )


def _dispatched(experts: np.ndarray, weights: np.ndarray) -> list[str]:
    """Per token, the experts that contributed (id ≥ 0 and weight ≠ 0), sorted, as a label like '1,5'."""
    out = []
    for e, w in zip(experts, weights, strict=True):
        out.append(",".join(str(int(x)) for x in sorted(e[(e >= 0) & (w != 0)])))
    return out


def counterfactual(
    loaded: LoadedModel,
    text: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    interventions: Sequence[Intervention],
    trace: Trace | None = None,
    progress: Progress | None = None,
) -> Counterfactual:
    """Run one prompt with and without `interventions` (two forwards, each giving the routing and the
    next-token log-probabilities); see `Counterfactual` for what is compared.

    Interventions that cannot change anything on this input (`no_effect_reason`) raise NoEffectError:
    before any forward when `trace` (the routing of this very input, e.g. the one already on screen) is
    given, else after the first. `progress(fraction, message)` is called before every decoder layer, so an
    exception it raises (a cancel) ends the run within one layer."""
    ids = sequence_ids(loaded, text, token_ids)
    seq = len(ids)
    resolve(loaded.sites, interventions)  # fail early on a bad spec, before any forward
    if trace is not None:
        _refuse_no_effect(trace, interventions)
    with layer_progress(loaded.model, progress, forwards=2, what="what-if") as ticker:
        before, lp_before = _capture_with_logprobs(loaded, ids)
        _refuse_no_effect(before, interventions)
        if ticker is not None:
            ticker.what = "what-if, with the intervention"
        with intervening(loaded, interventions, seq):
            after, lp_after = _capture_with_logprobs(loaded, ids)
    target = torch.tensor(ids[1:])
    gather = lambda lp: lp[:-1].gather(1, target[:, None])[:, 0].numpy()  # noqa: E731
    next_id = int(lp_before[-1].argmax())
    next_after = int(lp_after[-1].argmax())
    texts = loaded.token_texts([*ids, next_id, next_after])
    return Counterfactual(
        interventions=tuple(interventions),
        token_ids=np.asarray(ids),
        tokens=texts[:seq],
        logprob_before=gather(lp_before),
        logprob_after=gather(lp_after),
        next_id=next_id,
        next_token=texts[seq],
        next_logprob_before=float(lp_before[-1, next_id]),
        next_logprob_after=float(lp_after[-1, next_id]),
        next_id_after=next_after,
        next_token_after=texts[seq + 1],
        before=before,
        after=after,
    )


def _refuse_no_effect(trace: Trace, interventions: Sequence[Intervention]) -> None:
    reason = no_effect_reason(trace, interventions)
    if reason is not None:
        raise NoEffectError(reason)


@dataclass(frozen=True)
class ImportancePlan:
    """What an importance sweep disables at one MoE site: `experts` (the chosen ones, in order), of which
    `measured` are dispatched on the input and need a forward; the others cannot change the loss (Δ = 0
    exactly, no forward)."""

    site: MoESite
    experts: tuple[int, ...]
    measured: tuple[int, ...]


def _moe_layers(sites: Sequence[MoESite]) -> list[int]:
    return sorted({s.layer for s in sites})


def importance_plan(
    sites: Sequence[MoESite],
    trace: Trace,
    *,
    layers: Sequence[int] | None = None,
    experts: Sequence[int] | Mapping[int, Sequence[int]] | None = None,
) -> list[ImportancePlan]:
    """The sweep `expert_importance` runs over the input `trace` routed: per chosen MoE site, the chosen
    experts and those among them the input dispatches. `layers`: MoE layers (None: all); `experts`: the
    same ids in every chosen layer, or {layer: ids} (None: all). Raises InputError naming a layer that is
    not an MoE layer, an expert out of range, or an empty choice."""
    moe_layers = _moe_layers(sites)
    if layers is not None:
        wanted_layers = [int(x) for x in layers]
        unknown = sorted(set(wanted_layers) - set(moe_layers))
        if unknown or not wanted_layers:
            raise InputError(f"no MoE layer {unknown or '(none chosen)'} (MoE layers: {moe_layers})")
    else:
        wanted_layers = moe_layers
    if isinstance(experts, Mapping):
        per_layer = {int(k): v for k, v in experts.items()}
        extra = sorted(set(per_layer) - set(wanted_layers))
        if extra:
            raise InputError(
                f"experts given for layers {extra}, which are not among the chosen {wanted_layers}"
            )
    plans = []
    for site in sites:
        if site.layer not in wanted_layers:
            continue
        chosen = experts.get(site.layer) if isinstance(experts, Mapping) else experts
        if isinstance(experts, Mapping) and chosen is None:
            continue  # a mapping names the experts of the layers it keeps
        ids = list(range(site.num_experts)) if chosen is None else list(dict.fromkeys(int(e) for e in chosen))
        if not ids:
            raise InputError(f"no expert chosen at layer {site.layer}")
        bad = [e for e in ids if not 0 <= e < site.num_experts]
        if bad:
            raise InputError(
                f"experts {bad} out of range: layer {site.layer} has experts 0..{site.num_experts - 1}"
            )
        routing = trace.layer(site.layer, site.site)
        used = set(routing.experts[_dispatched_mask(routing)].tolist())
        plans.append(ImportancePlan(site, tuple(ids), tuple(e for e in ids if e in used)))
    if not plans:
        raise InputError(f"no MoE layer chosen (MoE layers: {moe_layers})")
    return plans


def busiest_experts(trace: Trace, n: int, layers: Sequence[int] | None = None) -> dict[int, list[int]]:
    """{layer: the `n` experts the most tokens of `trace` are dispatched to there (ties: lower id), only
    experts with at least one token}, for the MoE layers `layers` (None: all)."""
    if n < 1:
        raise InputError(f"choose at least 1 expert per layer, got {n}")
    counts: dict[int, np.ndarray] = {}
    for routing in trace.layers:
        if layers is not None and routing.layer not in layers:
            continue
        tokens = np.bincount(routing.experts[_dispatched_mask(routing)], minlength=routing.num_experts)
        counts[routing.layer] = counts.get(routing.layer, 0) + tokens  # a token's experts are distinct
    return {
        layer: [int(e) for e in np.argsort(-tokens, kind="stable")[:n] if tokens[e] > 0]
        for layer, tokens in counts.items()
    }


def expert_importance(
    loaded: LoadedModel,
    text: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    layers: Sequence[int] | None = None,
    experts: Sequence[int] | Mapping[int, Sequence[int]] | None = None,
    batch_size: int = 8,
    progress: Progress | None = None,
) -> pd.DataFrame:
    """Per MoE layer and expert: Δ loss when the expert is disabled for every token, beside its use.

    Loss = mean next-token NLL of the text (nats). Columns: layer, site, expert, load (share of the
    layer's token slots dispatched to the expert), weighted_load (mean combination weight per token),
    tokens (tokens sent to it), loss, delta_loss (loss with it disabled − loss without), measured (a
    forward measured it; False: the input never dispatches it there, so Δ = 0 exactly without one).
    `layers` / `experts` choose a subset (`importance_plan`). The disabled copies run `batch_size` at a
    time, each a copy of the text with a different expert disabled, next to an unmodified copy so the
    difference is taken within one forward. `progress(fraction, message)` is called before every decoder
    layer of every forward, so an exception it raises (a cancel) ends the sweep within one layer.
    """
    ids = sequence_ids(loaded, text, token_ids)
    if len(ids) < 2:
        raise InputError("expert importance needs at least 2 tokens (a next-token loss)")
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    seq = len(ids)
    target = torch.tensor(ids[1:])
    rows: list[dict] = []
    with layer_progress(loaded.model, progress, forwards=1, what="routing the prompt") as ticker:
        trace, lp_plain = _capture_with_logprobs(loaded, ids)
        plans = importance_plan(loaded.sites, trace, layers=layers, experts=experts)
        if ticker is not None:
            ticker.forwards = 1 + sum(-(-len(p.measured) // batch_size) for p in plans)
        plain_loss = float(-lp_plain[:-1].gather(1, target[:, None])[:, 0].mean())
        for plan in plans:
            site = plan.site
            routing = trace.layer(site.layer, site.site)
            losses = {e: (plain_loss, 0.0) for e in plan.experts if e not in plan.measured}
            for start in range(0, len(plan.measured), batch_size):
                chunk = list(plan.measured[start : start + batch_size])
                if ticker is not None:
                    ticker.what = f"layer {site.layer}: experts {chunk[0]}–{chunk[-1]} disabled"
                per_seq = (-1, *chunk)
                batch = torch.tensor([ids] * len(per_seq))
                spec = _DisablePerSequence(layer=site.layer, experts=per_seq, site=site.site)
                with intervening(loaded, [spec], seq):
                    lp = next_token_logprobs(loaded, batch)
                nll = -lp[:, :-1].gather(2, target[None, :, None].expand(len(per_seq), -1, 1))[..., 0].mean(1)
                for j, e in enumerate(chunk, start=1):
                    losses[e] = (float(nll[j]), float(nll[j]) - float(nll[0]))
            rows.extend(_importance_rows(site, routing, plan, losses))
    return pd.DataFrame(rows)


def _importance_rows(
    site: MoESite, routing: LayerRouting, plan: ImportancePlan, losses: dict[int, tuple[float, float]]
) -> list[dict]:
    n_tok = max(len(routing.token_rows), 1)
    rows = []
    for e in plan.experts:
        hit = routing.experts == e
        rows.append(
            {
                "layer": site.layer,
                "site": site.site,
                "expert": e,
                "load": float(hit.sum()) / (n_tok * routing.k),
                "weighted_load": float(routing.weights[hit].sum()) / n_tok,
                "tokens": int(hit.any(axis=1).sum()),
                "loss": losses[e][0],
                "delta_loss": losses[e][1],
                "measured": e in plan.measured,
            }
        )
    return rows
