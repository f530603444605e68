"""Routing replay (R3, arXiv 2510.11370): run the transformers model with another routing's expert sets
forced and the model's own router scores renormalised over them, and measure how much of the log-prob gap
between two engines the routing explains.

Why it lives here: it is an intervention — the forced sets go in through `ForceRouting` and the thread-aware
hooks of `moeviz.interventions.hooks`, and the model is never edited. Unlike a plain `ForceRouting`, the
weights are computed inside the same forward from the router logits that forward produces (the hook hands
them to the rewrite), so every replayed layer sees its own live scores.

Gate of a replayed (token, layer) with forced set S (docs/engine-formats.md, "Replay"):
- softmax routers that renormalise their top-k (Mixtral, MiniMax, Hunyuan; Qwen2/3-MoE and OLMoE with
  norm_topk_prob; gpt-oss and Granite, whose softmax runs over the chosen logits):
  g_i = 1[i∈S] e^{s_i} / Σ_{j∈S} e^{s_j}, s = the router logits — R3's replay gate. Families that do not
  renormalise weight by the softmax probability itself (Jamba; Qwen/OLMoE without norm_topk_prob),
  DeepSeek-V2 by probability × routed_scaling_factor;
- sigmoid routers (DeepSeek-V3, GLM-4.5, Kimi): the family's own rule on the chosen unbiased sigmoid
  scores, g_i = σ(s_i) / (Σ_{j∈S} σ(s_j) + 1e-20) × routed_scaling_factor with norm_topk_prob, else
  σ(s_i) × routed_scaling_factor (transformers 5.24 `DeepseekV3TopkRouter.forward`); the balancing bias
  only selects, so it plays no part in a forced set's weights.
A (token, layer) whose forced set equals the model's own set keeps the model's own decision exactly (same
slots, same weights), so replaying a model's own routing reproduces its logits bit for bit; a row of −1
(a token the other side never routed) keeps the model's own decision too.

Log-prob gap: Δ = log π_train − log π_infer of each actual next token (`engine_diff.logprob_gap`), where
π_train is the model run here (with its own routing: "before"; with the replayed routing: "after"), and
π_infer the side whose routing is replayed, run as that side ran: `infer_model` (the same model loaded at
that side's dtype). Without one (an engine import: moeviz has no log-probs of it), `mode` is "shift" and
Δ = log π_own − log π_replay: the part of a train–inference gap the routing difference alone opens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from moeviz.analysis.engine_diff import align_traces, is_capture, logprob_gap
from moeviz.analysis.structure import row_index
from moeviz.errors import InputError
from moeviz.interventions.counterfactual import next_token_logprobs
from moeviz.interventions.hooks import Probe, probing
from moeviz.interventions.specs import ForceRouting, InterventionError, apply
from moeviz.models.dispatch import unsupported_reason
from moeviz.models.loading import LoadedModel
from moeviz.models.sites import MoESite
from moeviz.scoring import ScoreFn
from moeviz.trace import UNKNOWN_TOKEN, Trace

# family -> (score function, renormalise over S: True | False | "norm_topk_prob", × routed_scaling_factor)
# (transformers 5.24 modeling_<family>.py; tests/support/reference_routing.py writes the same rules out)
REPLAY_RULES: dict[str, tuple[ScoreFn, bool | str, bool]] = {
    **{
        f: ("softmax", True, False) for f in ("mixtral", "minimax", "hunyuan_v1_moe", "gpt_oss", "granitemoe")
    },
    **{f: ("softmax", "norm_topk_prob", False) for f in ("qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe")},
    "jamba": ("softmax", False, False),
    "deepseek_v2": ("softmax", False, True),
    **{f: ("sigmoid", "norm_topk_prob", True) for f in ("deepseek_v3", "glm4_moe", "kimi_linear")},
}
SIGMOID_EPS = 1e-20  # DeepseekV3TopkRouter: denominator = sum + 1e-20


@dataclass(frozen=True)
class ReplayRule:
    """How one site turns its router logits into the weights of a given expert set."""

    family: str
    score_fn: ScoreFn
    renormalise: bool
    scale: float  # routed_scaling_factor (1 where the family has none)

    def weights(self, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """logits [N, E], experts [N, k] (−1 = no expert) → gates [N, k] in fp32 (0 for a −1 slot)."""
        x = logits.detach().float()
        scores = torch.softmax(x, dim=-1) if self.score_fn == "softmax" else torch.sigmoid(x)
        valid = experts >= 0
        gates = torch.where(
            valid, scores.gather(1, experts.clamp(min=0)), torch.zeros((), dtype=scores.dtype)
        )
        if self.renormalise:
            eps = SIGMOID_EPS if self.score_fn == "sigmoid" else 0.0
            gates = gates / (gates.sum(dim=-1, keepdim=True) + eps)
        return gates * self.scale if self.scale != 1.0 else gates


def replay_rule(loaded: LoadedModel, site: MoESite) -> ReplayRule:
    """The replay gate rule of one MoE site; InputError for a family moeviz has no replay rule for, or
    whose decision it cannot rewrite."""
    family = loaded.info.model_type
    reason = unsupported_reason(site)
    if reason is not None:
        raise InputError(f"cannot replay routing in {loaded.info.source}: {reason}")
    if family not in REPLAY_RULES:
        raise InputError(
            f"cannot replay routing in {loaded.info.source}: no replay gate rule for the {family!r} family "
            f"(supported: {', '.join(sorted(REPLAY_RULES))})"
        )
    score_fn, renormalise, scaled = REPLAY_RULES[family]
    config = loaded.model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config

    def setting(name: str, default: Any) -> Any:  # the router's own attribute first (DeepSeek-V3, Qwen3)
        value = getattr(site.router, name, None)
        return getattr(config, name, default) if value is None else value

    if renormalise == "norm_topk_prob":
        renormalise = bool(setting("norm_topk_prob", False))
    scale = float(setting("routed_scaling_factor", 1.0)) if scaled else 1.0
    return ReplayRule(family, score_fn, bool(renormalise), scale)


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[N] rows of two [N, k] id tensors holding the same set (ids distinct per row)."""
    return (torch.sort(a, dim=1).values == torch.sort(b, dim=1).values).all(dim=1)


def forced_logits(
    loaded: LoadedModel, ids: Sequence[int], forced: dict[int, np.ndarray]
) -> tuple[torch.Tensor, int]:
    """(output logits [T, V], (token, layer) pairs whose set the replay changed) of one sequence `ids` run
    with `forced[site index]` [T, k] expert ids at that site (a row of −1: keep the model's own decision),
    weighted by `ReplayRule.weights` of the live router logits."""
    sites = loaded.sites
    seq_len = len(ids)
    rules = {i: replay_rule(loaded, sites[i]) for i in forced}
    targets = {
        i: torch.as_tensor(np.asarray(e, dtype=np.int64), device=loaded.device) for i, e in forced.items()
    }
    changed = [0]

    def rewrite(index: int, top_k_index, top_k_weights, logits):
        k = top_k_index.shape[-1]
        own_idx, own_w = top_k_index.reshape(-1, k), top_k_weights.reshape(-1, k)
        target = targets[index]
        if logits is None:
            raise InterventionError(f"layer {sites[index].layer}: the router's logits were not seen")
        if tuple(target.shape) != tuple(own_idx.shape):
            raise InputError(
                f"layer {sites[index].layer}: {tuple(target.shape)} forced experts for a call of "
                f"{tuple(own_idx.shape)} (tokens, top-k)"
            )
        keep = (target < 0).all(dim=1) | _same_sets(target, own_idx.long())
        gates = rules[index].weights(logits.reshape(-1, logits.shape[-1]), target)
        new_idx = torch.where(keep[:, None], own_idx.long(), target)
        new_w = torch.where(keep[:, None], own_w, gates.to(own_w.dtype))
        changed[0] += int((~keep).sum())
        spec = ForceRouting(layer=sites[index].layer, experts=new_idx, weights=new_w, site=sites[index].site)
        return apply(spec, sites[index], own_idx, own_w, logits, seq_len)

    probe = Probe(rewrite=rewrite, rewrite_sites=set(forced))
    batch = torch.tensor([list(ids)], device=loaded.device)
    with probing(loaded.model, sites, probe), torch.inference_mode():
        logits = loaded.model(input_ids=batch).logits[0]
    return logits, changed[0]


@dataclass
class Replay:
    """The replay of one routing (the "infer" side) in a model (the "train" side). T' = next tokens.

    - mode: "gap" (π_infer from `infer_model`) or "shift" (no log-probs of the infer side)
    - reference: what π_infer is, in words
    - tokens: one row per predicted token: seq, pos (of the context's last token), next_id, logprob_own (the
      model with its own routing), logprob_replay (with the infer side's sets), logprob_infer (NaN in shift
      mode), delta (the headline Δ: gap mode log π_replay − log π_infer, shift mode log π_own − log π_replay)
      and delta_before (gap mode: log π_own − log π_infer; NaN in shift mode)
    - pairs: (token, layer) the infer side routed and the model ran; pairs_replayed: those whose set the
      replay changed (the model's own set differed)
    """

    mode: str
    reference: str
    tokens: pd.DataFrame
    pairs: int
    pairs_replayed: int
    notes: list[str] = field(default_factory=list)

    @property
    def after(self) -> dict[str, float]:
        """`logprob_gap` of the headline Δ (gap mode: after replay; shift mode: the shift)."""
        return logprob_gap(self.tokens["delta"].to_numpy())

    @property
    def before(self) -> dict[str, float] | None:
        """`logprob_gap` of the gap without replay (gap mode only)."""
        return logprob_gap(self.tokens["delta_before"].to_numpy()) if self.mode == "gap" else None

    def to_json(self) -> dict[str, Any]:
        after = self.after
        return {
            "mean_delta": after["mean_delta"],
            "k3_kl": after["k3_kl"],
            "extreme_fraction": after["extreme_fraction"],
            "tokens": after["tokens"],
            "mode": self.mode,
            "reference": self.reference,
            "before": self.before,
            "pairs": self.pairs,
            "pairs_replayed": self.pairs_replayed,
            "notes": list(self.notes),
        }


def _sequence_ids(infer: Trace, rows: np.ndarray, fill: np.ndarray | None, seq: int) -> list[int]:
    ids = infer.tokens["token_id"].to_numpy()[rows]
    if fill is not None:
        ids = np.where(ids == UNKNOWN_TOKEN, fill[rows], ids)
    if (ids == UNKNOWN_TOKEN).any():
        raise InputError(
            f"cannot replay sequence {seq}: its token ids are unknown (an import without ids); import it "
            "with --token-ids or --text, or diff it against a trace that has them"
        )
    return [int(i) for i in ids]


def _forced_experts(infer: Trace, loaded: LoadedModel, rows: np.ndarray) -> tuple[dict[int, np.ndarray], int]:
    """{site index: [T, k] ids of the infer side at the sequence's rows (−1: not routed there)}, pairs."""
    forced, pairs = {}, 0
    by_key = {r.key: r for r in infer.layers}
    n_rows = len(infer.tokens)
    for i, site in enumerate(loaded.sites):
        routing = by_key.get(site.key)
        if routing is None:
            continue
        if site.top_k is not None and routing.k != site.top_k:
            raise InputError(
                f"layer {site.layer}: the routing to replay has {routing.k} experts per token, the model "
                f"routes each token to {site.top_k}: is it the model that produced this routing?"
            )
        if routing.experts.size and int(routing.experts.max()) >= site.num_experts:
            raise InputError(
                f"layer {site.layer}: expert id {int(routing.experts.max())} in the routing to replay, the "
                f"model has {site.num_experts} experts"
            )
        at = row_index(routing.token_rows, n_rows)[rows]
        ids = np.full((len(rows), routing.k), -1, np.int64)
        ids[at >= 0] = routing.experts[at[at >= 0]]
        pairs += int((at >= 0).sum())
        forced[i] = ids
    if not forced:
        raise InputError(
            f"no MoE layer of the routing to replay is in the model: {infer.layer_keys} vs "
            f"{[s.key for s in loaded.sites]}"
        )
    return forced, pairs


def replay(
    loaded: LoadedModel,
    infer: Trace,
    *,
    infer_model: LoadedModel | None = None,
    ids_from: Trace | None = None,
    progress: Callable[[float, str], None] | None = None,
) -> Replay:
    """Replay the routing `infer` (its expert sets, per sequence of its "input" stream) in `loaded`, and
    compare next-token log-probs (module docstring). `infer_model`: the model as the infer side ran it (e.g.
    loaded at its dtype) → mode "gap"; None → mode "shift". `ids_from`: a trace of the same tokens whose ids
    fill in the ones `infer` does not know."""
    if loaded.is_encoder_decoder:
        raise InputError("routing replay covers decoder-only models")
    loaded.refuse_token_classifier("routing replay")
    tokens = infer.tokens
    streams = set(tokens["stream"].astype(str))
    if streams - {"input"}:
        raise InputError(f"routing replay covers one input stream; this trace has {sorted(streams)}")
    fill = None
    if ids_from is not None and (tokens["token_id"].to_numpy() == UNKNOWN_TOKEN).any():
        mapping = align_traces(infer, ids_from).mapping
        other = ids_from.tokens["token_id"].to_numpy()
        fill = np.where(mapping >= 0, other[np.maximum(mapping, 0)], UNKNOWN_TOKEN)
    report = progress or (lambda _f, _m: None)
    seqs = np.unique(tokens["seq"].to_numpy())
    parts, pairs, replayed = [], 0, 0
    for n, seq in enumerate(seqs):
        rows = np.flatnonzero(tokens["seq"].to_numpy() == seq)
        rows = rows[np.argsort(tokens["pos"].to_numpy()[rows], kind="stable")]
        pos = tokens["pos"].to_numpy()[rows]
        if not np.array_equal(pos, np.arange(len(rows))):
            raise InputError(f"sequence {seq}: positions are not 0 … {len(rows) - 1}; cannot replay it")
        if len(rows) < 2:
            continue
        report(n / len(seqs), f"replaying sequence {seq} ({len(rows)} tokens)")
        ids = _sequence_ids(infer, rows, fill, int(seq))
        forced, seq_pairs = _forced_experts(infer, loaded, rows)
        batch = torch.tensor([ids], device=loaded.device)
        target = batch[0, 1:, None]
        own = next_token_logprobs(loaded, batch)[0, :-1].gather(1, target)[:, 0].cpu().numpy()
        logits, changed = forced_logits(loaded, ids, forced)
        lp = torch.log_softmax(logits.float(), dim=-1)[:-1].gather(1, target)[:, 0].cpu().numpy()
        if infer_model is not None:
            infer_lp = next_token_logprobs(infer_model, batch.to(infer_model.device))[0, :-1]
            inf = infer_lp.gather(1, target.to(infer_lp.device))[:, 0].cpu().numpy()
            delta, before = lp - inf, own - inf
        else:
            inf = np.full(len(own), np.nan, np.float32)
            delta, before = own - lp, np.full(len(own), np.nan, np.float32)
        parts.append(
            pd.DataFrame(
                {
                    "seq": int(seq),
                    "pos": pos[:-1],
                    "next_id": ids[1:],
                    "logprob_own": own,
                    "logprob_replay": lp,
                    "logprob_infer": inf,
                    "delta": delta.astype(np.float64),
                    "delta_before": before.astype(np.float64),
                }
            )
        )
        pairs += seq_pairs
        replayed += changed
    report(1.0, "done")
    if not parts:
        raise InputError("nothing to replay: no sequence of 2 or more tokens")
    if infer_model is not None:
        info = infer_model.info
        mode, reference = (
            "gap",
            f"{info.source} at {info.dtype} on {info.device} (the infer side run as it ran)",
        )
    else:
        mode, reference = "shift", "no log-probs of the infer side: Δ = log π_own − log π_replay"
    notes = []
    if is_capture(infer) and infer.model.source != loaded.info.source:
        notes.append(f"the routing was captured from {infer.model.source}, replayed in {loaded.info.source}")
    return Replay(mode, reference, pd.concat(parts, ignore_index=True), pairs, replayed, notes)
