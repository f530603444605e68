"""Two routings of the same tokens, from any two sources (moeviz captures at two dtypes or devices, a capture
and an engine import, two imports, two runs of one engine): where do they choose different experts?

Definitions (docs/engine-formats.md, "Engine diff"; R3, arXiv 2510.11370; AReaL PR #1207). A pair is one
(token, MoE layer) both sides routed; S^A, S^B are its two expert sets (dispatched ids, a dropped slot −1
belongs to no set; slot order never matters, so an engine that writes a token's experts in ascending id
order, `LayerRouting.ranked` False, compares like any other):
- router_mismatch = #{pairs with S^A ≠ S^B} / #pairs, per layer and pooled over layers;
- top1_mismatch = #{pairs with top-1^A ≠ top-1^B} / #pairs (top-1 = slot 0), NaN where a side is not ranked;
- jaccard = mean over pairs of |S^A ∩ S^B| / |S^A ∪ S^B| (1 when both sets are empty);
- routers differing per token = #{layers where the token's sets differ}; tokens_any_layer = the fraction of
  tokens (paired in at least one layer) with at least one;
- mismatch by router-margin quartile (`moeviz.analysis.margins`, the quantisation what-if's margin), on the
  side that has logits (B's when both have), quartiles per layer then pooled;
- kl = mean_t Σ_e p^A log(p^A / p^B) and tv = mean_t ½ Σ_e |p^A − p^B| of the router distributions
  (`losses.router_probs`: softmax scores, or sigmoid scores normalised to sum 1) where both have logits;
- identical: no set and no top-1 differs (and, where both sides have logits, the logits are bitwise equal);
  a non-identical result between two sides that name the same source (engine, model, dtype, device) is
  non-determinism (or a capture bug).
- the log-prob gap of the replay (`logprob_gap`): Δ = log π_train − log π_infer per token; mean Δ,
  k3 KL = mean(e^Δ − 1 − Δ), extreme fraction = mean(1[|Δ| > ln 2]).

Tokens are aligned by (stream, seq, pos); token ids must agree wherever both sides know them (an import
without ids has token_id −1: that side aligns by position only, and the result says so).

Pure numpy and pandas: sets are compared without [N, E] masks, by pairwise slot compares on transposed
[k, chunk] blocks (|A ∩ B| = Σ_i Σ_j [A_i = B_j] for distinct ids), so two 1 M-token × 48-layer × k = 8
routings diff in about a second (benchmarks/bench_engine_diff.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from moeviz.analysis.compare import _matched_layers, match_tokens
from moeviz.analysis.losses import router_probs
from moeviz.analysis.margins import margin_quartiles, router_margin
from moeviz.analysis.structure import shared_rows
from moeviz.errors import InputError
from moeviz.trace import UNKNOWN_TOKEN, LayerRouting, Trace
from moeviz.trace.records import CAPTURE_SOURCES

DEFINITION = (
    "router mismatch = share of (token, layer) whose top-k expert sets differ (sets: slot order ignored); "
    "top-1 mismatch on slot 0 where both sides rank their slots; jaccard = mean |A∩B|/|A∪B|; "
    "kl = mean Σ p_A log(p_A/p_B), tv = mean ½Σ|p_A − p_B| of the router distributions (sigmoid scores "
    "normalised to sum 1); replay Δ = log π_train − log π_infer, k3 = mean(e^Δ − 1 − Δ), extreme = "
    "mean(|Δ| > ln 2) (docs/engine-formats.md, 'Engine diff')"
)
LN2 = math.log(2.0)
CHUNK_ROWS = 1 << 15  # rows per block of the set comparison: its [k, chunk] blocks stay in cache
POSITION_BINS = 1024  # at most this many position bins per layer (exact positions when sequences are shorter)


# ---- alignment ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Alignment:
    """How the tokens of two traces pair up.

    - mapping [T_a]: row in b.tokens of each row of a.tokens, −1 where b has no token at that position
    - aligned_by: "token_ids" (every paired token's id known on both sides and equal) or "position" (a side
      does not know some ids: those tokens are paired by (stream, seq, pos) alone)
    - notes: what the alignment left out or could not check
    """

    mapping: np.ndarray
    aligned_by: str
    notes: tuple[str, ...] = ()


def align_traces(a: Trace, b: Trace) -> Alignment:
    """Pair the tokens of `a` and `b` by (stream, seq, pos); InputError naming the first (stream, seq, pos)
    where both know the token id and the ids differ, or when no position is in both."""
    ids_a, ids_b = a.tokens["token_id"].to_numpy(), b.tokens["token_id"].to_numpy()
    known = not ((ids_a == UNKNOWN_TOKEN).any() or (ids_b == UNKNOWN_TOKEN).any())
    if known and len(ids_a) == len(ids_b):
        try:  # the common case: the same tokens on both sides, checked id for id
            return Alignment(match_tokens(a, b), "token_ids")
        except ValueError as exc:
            raise InputError(f"cannot diff these routings: {exc}") from None
    keys = ["stream", "seq", "pos"]
    index_b = pd.MultiIndex.from_frame(b.tokens[keys].astype({"stream": str}))
    mapping = index_b.get_indexer(pd.MultiIndex.from_frame(a.tokens[keys].astype({"stream": str})))
    paired = mapping >= 0
    if not paired.any():
        raise InputError("cannot diff these routings: no (stream, seq, pos) is in both traces")
    id_b = np.where(paired, ids_b[np.maximum(mapping, 0)], UNKNOWN_TOKEN)
    both = paired & (ids_a != UNKNOWN_TOKEN) & (id_b != UNKNOWN_TOKEN)
    differ = np.flatnonzero(both & (ids_a != id_b))
    if len(differ):
        tokens = a.tokens
        first = np.lexsort(  # the first in (stream, seq, pos) order, as match_tokens names it
            (
                tokens["pos"].to_numpy()[differ],
                tokens["seq"].to_numpy()[differ],
                tokens["stream"].astype(str).to_numpy()[differ],
            )
        )[0]
        i = differ[first]
        at = (str(tokens["stream"].iloc[i]), int(tokens["seq"].iloc[i]), int(tokens["pos"].iloc[i]))
        raise InputError(
            f"cannot diff these routings: the traces hold different tokens: at (stream, seq, pos) = {at} the "
            f"token_id is {int(ids_a[i])} in the first and {int(id_b[i])} in the second"
        )
    notes = []
    unknown = int(paired.sum() - both.sum())
    aligned_by = "position" if unknown else "token_ids"
    if unknown:
        sides = [name for name, ids in (("first", ids_a), ("second", ids_b)) if (ids == UNKNOWN_TOKEN).any()]
        notes.append(
            f"{unknown} paired tokens aligned by position only: the {' and '.join(sides)} trace does not "
            "know their token ids"
        )
    only_a = int((~paired).sum())
    only_b = len(ids_b) - int(paired.sum())
    if only_a or only_b:
        notes.append(
            f"{only_a} tokens of the first and {only_b} of the second trace have no counterpart at their "
            "(stream, seq, pos) and are left out (e.g. the last sampled token, which an engine never routes)"
        )
    return Alignment(mapping.astype(np.int64), aligned_by, tuple(notes))


# ---- set comparison ---------------------------------------------------------------------------------------
def set_overlap(ea: np.ndarray, eb: np.ndarray, chunk: int = CHUNK_ROWS) -> np.ndarray:
    """[N] |S^A ∩ S^B| per row of expert ids ea [N, k_a], eb [N, k_b] (distinct ids per row; −1 = a dropped
    slot, in no set), as int16.

    Pairwise slot compares on transposed [k, chunk] blocks: Σ_i Σ_j [A_i = B_j] counts each common id once
    because ids are distinct within a row; no [N, E] mask, no loop over tokens."""
    n = len(ea)
    if len(eb) != n:
        raise ValueError(f"set_overlap: {n} rows vs {len(eb)}")
    dtype = np.promote_types(np.promote_types(ea.dtype, eb.dtype), np.int16)
    negative_b = eb.size and int(eb.min()) < 0
    out = np.empty(n, np.int16)
    hit = np.empty(min(chunk, max(n, 1)), dtype=bool)
    for start in range(0, n, chunk):
        a = np.ascontiguousarray(ea[start : start + chunk].T, dtype=dtype)
        b = np.ascontiguousarray(eb[start : start + chunk].T, dtype=dtype)
        if negative_b:  # a dropped slot of B must not match one of A
            b[b < 0] = -2
        m = a.shape[1]
        acc, scratch = out[start : start + m], hit[:m]
        acc[:] = 0
        for ai in a:
            for bj in b:
                np.equal(ai, bj, out=scratch)
                acc += scratch
    return out


def set_sizes(experts: np.ndarray) -> np.ndarray | int:
    """|S| per row of ids [N, k]: k (an int) when no slot is dropped, else an [N] array."""
    if experts.size == 0 or int(experts.min()) >= 0:
        return experts.shape[1]
    return (experts >= 0).sum(axis=1)


def logprob_gap(delta: np.ndarray) -> dict[str, float]:
    """The gap between two policies' log-probs of the same tokens, Δ = log π_train − log π_infer per token
    (AReaL PR #1207): mean_delta, k3_kl = mean(e^Δ − 1 − Δ) (the k3 estimator of KL(π_infer ‖ π_train) on
    tokens sampled by the inference side), extreme_fraction = mean(1[|Δ| > ln 2]) and tokens. NaN (0 tokens)
    for an empty Δ."""
    delta = np.asarray(delta, dtype=np.float64)
    if not len(delta):
        nan = float("nan")
        return {"mean_delta": nan, "k3_kl": nan, "extreme_fraction": nan, "tokens": 0}
    return {
        "mean_delta": float(delta.mean()),
        "k3_kl": float((np.expm1(delta) - delta).mean()),
        "extreme_fraction": float((np.abs(delta) > LN2).mean()),
        "tokens": len(delta),
    }


def distribution_gap(pa: np.ndarray, pb: np.ndarray, chunk: int = CHUNK_ROWS) -> tuple[float, float]:
    """(Σ_t KL(p^A_t ‖ p^B_t), Σ_t TV(p^A_t, p^B_t)) over rows of two distributions [N, E] (sums: the caller
    divides). KL = Σ_e p^A log(p^A / p^B), 0 log 0 = 0, p^B clamped at the smallest normal float64 so a
    zero there gives a large finite term; TV = ½ Σ_e |p^A − p^B|. Equal rows give exactly 0."""
    tiny = np.finfo(np.float64).tiny
    kl = tv = 0.0
    for start in range(0, len(pa), chunk):
        x = np.asarray(pa[start : start + chunk], dtype=np.float64)
        y = np.asarray(pb[start : start + chunk], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(x > 0, x * (np.log(np.maximum(x, tiny)) - np.log(np.maximum(y, tiny))), 0.0)
        kl += float(terms.sum())
        tv += 0.5 * float(np.abs(x - y).sum())
    return kl, tv


# ---- the diff ------------------------------------------------------------------------------------------
@dataclass
class _Differing:
    """The (token, layer) pairs whose sets differ, as arrays (a frame is built only when asked for)."""

    layer_index: list[np.ndarray] = field(default_factory=list)  # [M] index into the diff's layer list
    rows: list[np.ndarray] = field(default_factory=list)  # [M] row in a.tokens
    experts_a: list[np.ndarray] = field(default_factory=list)  # [M, k_a]
    experts_b: list[np.ndarray] = field(default_factory=list)  # [M, k_b]
    margin: list[np.ndarray] = field(default_factory=list)  # [M] (NaN without logits)


@dataclass
class EngineDiff:
    """The diff of two routings A and B of the same tokens (see the module docstring for every definition).

    - tokens: tokens paired in at least one common MoE layer; pairs / mismatched: (token, layer) pairs and
      those whose sets differ; router_mismatch, top1_mismatch, jaccard: pooled over layers
    - layers: per common MoE layer (layer, site, pairs, mismatched, router_mismatch, top1_mismatch, jaccard,
      kl, tv, logits_equal); its order by layer is the mismatch by depth
    - routers_differing [T_a]: per row of a.tokens, the layers where its sets differ (−1: never paired)
    - margin_side: "a" | "b" | None, whose margins the quartiles use; margins: per (layer, quartile)
    - position_bin: width of the position bins of `position_frame` / `layer_position_frame` (1 = exact)
    - identical, same_source, nondeterministic; sources: how each side names itself
    """

    a: Trace
    b: Trace
    alignment: Alignment
    tokens: int
    pairs: int
    mismatched: int
    router_mismatch: float
    top1_mismatch: float
    jaccard: float
    layers: pd.DataFrame
    routers_differing: np.ndarray
    margin_side: str | None
    margins: pd.DataFrame
    position_bin: int
    position_pairs: np.ndarray  # [L, bins]
    position_mismatched: np.ndarray  # [L, bins]
    identical: bool
    same_source: bool
    sources: tuple[str, str]
    notes: list[str]
    _differing: _Differing = field(repr=False)
    definition: str = DEFINITION

    @property
    def aligned_by(self) -> str:
        return self.alignment.aligned_by

    @property
    def nondeterministic(self) -> bool:
        """Two sides naming the same source (engine, model, dtype, device) that route differently."""
        return self.same_source and not self.identical

    @property
    def tokens_any_layer(self) -> float:
        paired = self.routers_differing >= 0
        return float((self.routers_differing[paired] > 0).mean()) if paired.any() else float("nan")

    @property
    def routers_per_token_mean(self) -> float:
        paired = self.routers_differing >= 0
        return float(self.routers_differing[paired].mean()) if paired.any() else float("nan")

    def routers_frame(self) -> pd.DataFrame:
        """The distribution of routers differing per token: routers (0 … layers), tokens, fraction."""
        counts = self.routers_differing[self.routers_differing >= 0]
        hist = np.bincount(counts, minlength=len(self.layers) + 1)
        total = max(int(hist.sum()), 1)
        return pd.DataFrame({"routers": np.arange(len(hist)), "tokens": hist, "fraction": hist / total})

    def margin_quartile_frame(self) -> pd.DataFrame:
        """Mismatch by router-margin quartile, quartiles taken per layer then pooled: quartile, margin_low,
        margin_high, pairs, mismatched, router_mismatch (empty when neither side has logits)."""
        columns = ["quartile", "margin_low", "margin_high", "pairs", "mismatched", "router_mismatch"]
        if self.margins.empty:
            return pd.DataFrame({c: [] for c in columns})
        pooled = (
            self.margins.groupby("quartile", sort=True)
            .agg(
                margin_low=("margin_low", "min"),
                margin_high=("margin_high", "max"),
                pairs=("pairs", "sum"),
                mismatched=("mismatched", "sum"),
            )
            .reset_index()
        )
        pooled["router_mismatch"] = pooled["mismatched"] / pooled["pairs"]
        return pooled[columns]

    def position_frame(self) -> pd.DataFrame:
        """Mismatch by position (pooled over layers): pos_start, pos_end (inclusive), pairs, mismatched,
        router_mismatch, one row per position bin that holds a pair."""
        return self._position_rows(self.position_pairs.sum(axis=0), self.position_mismatched.sum(axis=0))

    def layer_position_frame(self) -> pd.DataFrame:
        """Mismatch per (layer, position bin): layer, site, pos_start, pos_end, pairs, mismatched,
        router_mismatch: the layer × position heatmap."""
        parts = []
        for i, row in enumerate(self.layers.itertuples()):
            frame = self._position_rows(self.position_pairs[i], self.position_mismatched[i])
            frame.insert(0, "site", row.site)
            frame.insert(0, "layer", row.layer)
            parts.append(frame)
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()

    def _position_rows(self, pairs: np.ndarray, mismatched: np.ndarray) -> pd.DataFrame:
        bins = np.flatnonzero(pairs)
        w = self.position_bin
        return pd.DataFrame(
            {
                "pos_start": bins * w,
                "pos_end": bins * w + w - 1,
                "pairs": pairs[bins],
                "mismatched": mismatched[bins],
                "router_mismatch": mismatched[bins] / pairs[bins],
            }
        )

    @property
    def differing_pairs(self) -> int:
        return self.mismatched

    def differing_frame(self, limit: int | None = None) -> pd.DataFrame:
        """The (token, layer) pairs whose sets differ, by layer then token: row (in a.tokens), seq, pos,
        token_id, token, layer, site, experts_a, experts_b (sorted ids, "3,7"), only_a, only_b (the ids
        one side has and the other lacks) and margin (on `margin_side`, NaN without logits). `limit`: the
        first so many."""
        d = self._differing
        if not d.rows:
            index = np.zeros(0, np.int64)
            rows, ea, eb, margin = index, np.zeros((0, 1), np.int64), np.zeros((0, 1), np.int64), np.zeros(0)
        else:
            index = np.concatenate(d.layer_index)
            rows = np.concatenate(d.rows)
            ea, eb = np.concatenate(d.experts_a), np.concatenate(d.experts_b)
            margin = np.concatenate(d.margin)
        if limit is not None:
            index, rows, ea, eb, margin = index[:limit], rows[:limit], ea[:limit], eb[:limit], margin[:limit]
        tokens = self.a.tokens
        sets_a = [{int(e) for e in row if e >= 0} for row in ea]
        sets_b = [{int(e) for e in row if e >= 0} for row in eb]

        def label(values) -> list[str]:
            return [",".join(str(e) for e in sorted(v)) for v in values]

        return pd.DataFrame(
            {
                "row": rows,
                "seq": tokens["seq"].to_numpy()[rows],
                "pos": tokens["pos"].to_numpy()[rows],
                "token_id": tokens["token_id"].to_numpy()[rows],
                "token": tokens["token"].to_numpy()[rows],
                "layer": self.layers["layer"].to_numpy()[index],
                "site": self.layers["site"].to_numpy()[index],
                "experts_a": label(sets_a),
                "experts_b": label(sets_b),
                "only_a": label(x - y for x, y in zip(sets_a, sets_b, strict=True)),
                "only_b": label(y - x for x, y in zip(sets_a, sets_b, strict=True)),
                "margin": margin,
            }
        )

    def token_frame(self) -> pd.DataFrame:
        """One row per token of a.tokens: seq, pos, token_id, token, routers_differing (−1: not paired) —
        the token strip."""
        tokens = self.a.tokens
        return pd.DataFrame(
            {
                "seq": tokens["seq"].to_numpy(),
                "pos": tokens["pos"].to_numpy(),
                "token_id": tokens["token_id"].to_numpy(),
                "token": tokens["token"].to_numpy(),
                "routers_differing": self.routers_differing,
            }
        )

    def to_json(self, replay: dict[str, Any] | None = None) -> dict[str, Any]:
        """The `moeviz diff --format json` payload (NaN stays NaN here; `moeviz.jsonable` makes it null)."""
        return {
            "tokens": self.tokens,
            "aligned_by": self.aligned_by,
            "identical": self.identical,
            "nondeterministic": self.nondeterministic,
            "same_source": self.same_source,
            "sources": list(self.sources),
            "pairs": self.pairs,
            "mismatched": self.mismatched,
            "router_mismatch": self.router_mismatch,
            "top1_mismatch": self.top1_mismatch,
            "jaccard": self.jaccard,
            "layers": [
                {
                    "layer": int(r.layer),
                    "site": r.site,
                    "pairs": int(r.pairs),
                    "mismatched": int(r.mismatched),
                    "router_mismatch": float(r.router_mismatch),
                    "top1_mismatch": float(r.top1_mismatch),
                    "jaccard": float(r.jaccard),
                    "kl": float(r.kl),
                    "tv": float(r.tv),
                }
                for r in self.layers.itertuples()
            ],
            "tokens_any_layer": self.tokens_any_layer,
            "routers_per_token_mean": self.routers_per_token_mean,
            "routers_per_token": self.routers_frame()[["routers", "tokens"]].to_dict("records"),
            "margin_side": self.margin_side,
            "by_margin_quartile": self.margin_quartile_frame().to_dict("records"),
            "replay": replay,
            "notes": list(self.notes),
            "definition": self.definition,
        }


def source_label(trace: Trace) -> str:
    """How a trace names its routing's source: decision source(s), model, dtype, device."""
    sources = sorted({r.decision_source for r in trace.layers}) or ["?"]
    info = trace.model
    model = info.source
    if info.adapter:  # a fine-tune over the same base is another source
        model += " + adapter " + str(_adapter_path(info.adapter))
    parts = ["+".join(sources), model, info.dtype or "dtype unknown", info.device or "device unknown"]
    return " · ".join(parts)


def _adapter_path(adapter: str) -> str:
    """The folder of `ModelInfo.adapter` (its JSON), or the text itself when it is not that JSON."""
    try:
        return str(json.loads(adapter)["path"])
    except (ValueError, KeyError, TypeError):
        return adapter


def is_capture(trace: Trace) -> bool:
    """The routing came from a moeviz capture (not an engine import)."""
    return bool(trace.layers) and all(r.decision_source in CAPTURE_SOURCES for r in trace.layers)


def engine_diff(a: Trace, b: Trace, *, chunk: int = CHUNK_ROWS) -> EngineDiff:
    """Diff routing A against routing B of the same tokens (definitions: the module docstring).

    InputError when the token ids differ where both know them (naming the first (stream, seq, pos)), when no
    position or no MoE layer is in both, or when a common layer has another number of experts."""
    alignment = align_traces(a, b)
    try:
        layer_pairs = _matched_layers(a, b)
    except ValueError as exc:
        raise InputError(f"cannot diff these routings: {exc}") from None
    notes = list(alignment.notes)
    only = sorted(set(a.layer_keys) ^ set(b.layer_keys))
    if only:
        notes.append(f"MoE layers in one trace only, left out: {only}")
    mapping = alignment.mapping
    n_a, n_b = len(a.tokens), len(b.tokens)
    identity = n_a == n_b and np.array_equal(mapping, np.arange(n_a))
    margin_side = "b" if any(y.has_logits for _, y in layer_pairs) else None
    if margin_side is None and any(x.has_logits for x, _ in layer_pairs):
        margin_side = "a"
    pos = a.tokens["pos"].to_numpy()
    width = max(1, -(-(int(pos.max()) + 1 if len(pos) else 1) // POSITION_BINS))
    n_bins = (int(pos.max()) if len(pos) else 0) // width + 1
    differing_count = np.zeros(n_a, np.int32)
    paired_layers = np.zeros(n_a, np.int32)
    position_pairs = np.zeros((len(layer_pairs), n_bins), np.int64)
    position_mismatched = np.zeros((len(layer_pairs), n_bins), np.int64)
    shared: dict[tuple[int, int], tuple[np.ndarray, np.ndarray | None, np.ndarray | None]] = {}
    bins_of_rows: dict[int, np.ndarray] = {}
    row_arrays: dict[int, tuple[np.ndarray, int]] = {}  # id → (rows in a.tokens, layers that paired them)
    differing = _Differing()
    rows_out, margin_rows = [], []
    totals = {"pairs": 0, "mismatched": 0, "top1_pairs": 0, "top1_mismatched": 0}
    jaccard_total = 0.0
    logits_all_equal = True
    for index, (x, y) in enumerate(layer_pairs):
        key = (id(x.token_rows), id(y.token_rows))
        if key not in shared:  # imported layers share one token_rows array: align it once
            shared[key] = _pair_rows(x, y, mapping, n_b, identity)
        rows, ia, ib = shared[key]
        ea = x.experts if ia is None else x.experts[ia]
        eb = y.experts if ib is None else y.experts[ib]
        n = len(rows)
        inter = set_overlap(ea, eb, chunk)
        size_a, size_b = set_sizes(ea), set_sizes(eb)
        differ = (inter != size_a) | (inter != size_b)
        mis = np.flatnonzero(differ)
        # Jaccard is 1 wherever the sets agree: compute it only on the differing rows
        inter_m = inter[mis].astype(np.float64)
        union_m = _at(size_a, mis) + _at(size_b, mis) - inter_m
        jaccard_sum = (n - len(mis)) + float(
            np.divide(inter_m, union_m, where=union_m > 0, out=np.ones_like(inter_m)).sum()
        )
        ranked = x.ranked and y.ranked
        top1_mis = int(np.count_nonzero(ea[:, 0] != eb[:, 0])) if ranked and n else 0
        kl = tv = float("nan")
        logits_equal = None
        if x.has_logits and y.has_logits:
            la = x.logits if ia is None else x.logits[ia]
            lb = y.logits if ib is None else y.logits[ib]
            logits_equal = bool(np.array_equal(la, lb))
            logits_all_equal &= logits_equal
            if x.score_fn == y.score_fn and n:
                pa = router_probs(x) if ia is None else router_probs(x)[ia]
                pb = router_probs(y) if ib is None else router_probs(y)[ib]
                kl_sum, tv_sum = distribution_gap(pa, pb, chunk)
                kl, tv = kl_sum / n, tv_sum / n
        margin = np.full(len(mis), np.nan)
        if margin_side is not None:
            side, side_index = (y, ib) if margin_side == "b" else (x, ia)
            if side.has_logits and n:
                full = router_margin(side)
                m = full if side_index is None else full[side_index]
                margin = m[mis]
                margin_rows.extend(_margin_rows(x, m, differ))
        # per token and per position
        mis_rows = rows[mis]
        differing_count[mis_rows] += 1
        if id(rows) not in bins_of_rows:  # per distinct rows array, not per layer (imports share one)
            bins_of_rows[id(rows)] = np.bincount(pos[rows] // width, minlength=n_bins)
            row_arrays[id(rows)] = (rows, 0)
        row_arrays[id(rows)] = (rows, row_arrays[id(rows)][1] + 1)
        position_pairs[index] = bins_of_rows[id(rows)]
        position_mismatched[index] = np.bincount(pos[mis_rows] // width, minlength=n_bins)
        differing.layer_index.append(np.full(len(mis), index, np.int64))
        differing.rows.append(mis_rows)
        differing.experts_a.append(ea[mis])
        differing.experts_b.append(eb[mis])
        differing.margin.append(margin)
        nan = float("nan")
        rows_out.append(
            {
                "layer": x.layer,
                "site": x.site,
                "pairs": n,
                "mismatched": len(mis),
                "router_mismatch": len(mis) / n if n else nan,
                "top1_mismatch": top1_mis / n if ranked and n else nan,
                "jaccard": jaccard_sum / n if n else nan,
                "kl": kl,
                "tv": tv,
                "logits_equal": logits_equal,
            }
        )
        totals["pairs"] += n
        totals["mismatched"] += len(mis)
        jaccard_total += jaccard_sum
        if ranked:
            totals["top1_pairs"] += n
            totals["top1_mismatched"] += top1_mis
    for rows, layers_paired in row_arrays.values():
        paired_layers[rows] += layers_paired
    pairs = totals["pairs"]
    routers_differing = np.where(paired_layers > 0, differing_count, -1)
    identical = totals["mismatched"] == 0 and totals["top1_mismatched"] == 0 and logits_all_equal
    sources = (source_label(a), source_label(b))
    top1_pairs = totals["top1_pairs"]
    nan = float("nan")
    return EngineDiff(
        a=a,
        b=b,
        alignment=alignment,
        tokens=int((paired_layers > 0).sum()),
        pairs=pairs,
        mismatched=totals["mismatched"],
        router_mismatch=totals["mismatched"] / pairs if pairs else nan,
        top1_mismatch=totals["top1_mismatched"] / top1_pairs if top1_pairs else nan,
        jaccard=jaccard_total / pairs if pairs else nan,
        layers=pd.DataFrame(rows_out),
        routers_differing=routers_differing,
        margin_side=margin_side,
        margins=pd.DataFrame(margin_rows),
        position_bin=width,
        position_pairs=position_pairs,
        position_mismatched=position_mismatched,
        identical=bool(identical),
        same_source=sources[0] == sources[1],
        sources=sources,
        notes=notes,
        _differing=differing,
    )


def _at(size: np.ndarray | int, index: np.ndarray) -> np.ndarray | int:
    return size if isinstance(size, int) else size[index]


def _pair_rows(
    x: LayerRouting, y: LayerRouting, mapping: np.ndarray, num_rows_b: int, identity: bool
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(rows in a.tokens [M], index into x [M] | None, index into y [M] | None) of the M tokens both
    layers routed; None = all of the layer's rows in order (no copy)."""
    if identity and (x.token_rows is y.token_rows or np.array_equal(x.token_rows, y.token_rows)):
        return x.token_rows, None, None
    mapped = mapping[x.token_rows]
    keep = np.flatnonzero(mapped >= 0)
    within, ib = shared_rows(mapped[keep], y.token_rows, num_rows_b)
    ia = keep[within]
    return x.token_rows[ia], ia, ib


def _margin_rows(x: LayerRouting, margin: np.ndarray, differ: np.ndarray) -> list[dict[str, Any]]:
    quartile = margin_quartiles(margin)
    out = []
    for q in range(1, 5):
        sel = quartile == q
        if sel.any():
            m = margin[sel]
            out.append(
                {
                    "layer": x.layer,
                    "site": x.site,
                    "quartile": q,
                    "margin_low": float(m.min()),
                    "margin_high": float(m.max()),
                    "pairs": int(sel.sum()),
                    "mismatched": int(differ[sel].sum()),
                    "router_mismatch": float(differ[sel].mean()),
                }
            )
    return out
