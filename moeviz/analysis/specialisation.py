"""Does routing follow the domain or the vocabulary? Specialisation with null baselines.

Definitions: docs/routing-metrics.md ("Specialisation"). Nothing is called specialised without a
null baseline: the uniform level (k/E for "e ∈ S_t" quantities, 1/E for top-1 ones) and routing shuffled
across tokens (the layer's routing rows permuted over its tokens, seeded; keeps the load and the label
sizes, destroys any link between them). "within noise" = |observed − shuffle mean| ≤ 2 · shuffle std.
Caveat: tokens of one sequence are not independent, so a token-level shuffle gives a narrow band; a small
batch of long sequences can look specialised by topic of the few texts alone.

- Mutual information: I(D; E) = Σ p(d, e) log2 p(d, e) / (p(d) p(e)) over tokens, with E = the token's top-1
  (rank 0) expert. 0 bits = routing ignores the domain; log2(#domains) = the domain alone decides the
  expert. Its null shuffles the domain labels across tokens (same marginals).
- Domain specialisation (OLMoE): DS(e, D) = share of domain D's tokens whose dispatched set S_t includes e.
- Vocabulary specialisation (OLMoE): per token id x with ≥ min_count occurrences, the share of its
  occurrences whose top-1 expert is x's most frequent top-1 expert, averaged over ids per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from moeviz.analysis.structure import conditional, next_token_rows
from moeviz.trace import LayerRouting, Trace


def mutual_information_bits(labels: np.ndarray, experts: np.ndarray) -> float:
    """I(labels; experts) in bits from paired integer samples [N]."""
    if len(labels) == 0:
        return 0.0
    _, label_codes = np.unique(labels, return_inverse=True)
    _, expert_codes = np.unique(experts, return_inverse=True)
    joint = np.zeros((label_codes.max() + 1, expert_codes.max() + 1))
    np.add.at(joint, (label_codes, expert_codes), 1)
    joint /= joint.sum()
    outer = joint.sum(1, keepdims=True) * joint.sum(0, keepdims=True)
    nonzero = joint > 0
    return float((joint[nonzero] * np.log2(joint[nonzero] / outer[nonzero])).sum())


def top1_domain_pairs(
    trace: Trace, routing: LayerRouting, seq_domains: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """(domain label [N], top-1 expert [N]) for the tokens of one layer; seq i has domain seq_domains[i]."""
    seqs = trace.tokens["seq"].to_numpy()[routing.token_rows]
    return np.asarray(seq_domains, dtype=object)[seqs], routing.experts[:, 0]


def domain_specialisation_frame(
    trace: Trace, seq_domains: list[str], shuffles: int = 20, seed: int = 0
) -> pd.DataFrame:
    """Per MoE layer: mi_bits, the shuffled-label baseline (mean and std) and mi_max = log2(#domains)."""
    rng = np.random.default_rng(seed)
    rows = []
    for routing in trace.layers:
        labels, experts = top1_domain_pairs(trace, routing, seq_domains)
        null = [mutual_information_bits(rng.permutation(labels), experts) for _ in range(shuffles)]
        rows.append(
            {
                "layer": routing.layer,
                "site": routing.site,
                "mi_bits": mutual_information_bits(labels, experts),
                "null_mean": float(np.mean(null)),
                "null_std": float(np.std(null)),
                "mi_max": float(np.log2(len(set(seq_domains)))),
            }
        )
    return pd.DataFrame(rows)


# ---- null baselines ---------------------------------------------------------------------------------------
def null_columns(
    observed: np.ndarray | Sequence[float], null: np.ndarray | None, sigmas: float = 2.0
) -> dict[str, np.ndarray]:
    """Compare `observed` [M] with shuffle samples `null` [S, M].

    Returns shuffle_mean, shuffle_std, shuffle_lo / shuffle_hi (2.5 % / 97.5 % quantiles), z = (observed −
    mean) / std (±inf when the null has no spread but the value differs) and within_noise = |observed −
    mean| ≤ sigmas · std (nullable boolean). Without samples (None or S = 0) all are NaN / NA."""
    observed = np.asarray(observed, dtype=np.float64).reshape(-1)
    if null is None or len(null) == 0:
        nan = np.full(observed.shape, np.nan)
        na = pd.array([pd.NA] * len(observed), dtype="boolean")
        names = ("shuffle_mean", "shuffle_std", "shuffle_lo", "shuffle_hi", "z")
        return {**dict.fromkeys(names, nan), "within_noise": na}
    null = np.asarray(null, dtype=np.float64).reshape(len(null), -1)
    mean, std = null.mean(axis=0), null.std(axis=0)
    diff = observed - mean
    spread = std > 0
    with np.errstate(invalid="ignore"):
        z = np.where(spread, diff / np.where(spread, std, 1.0), np.sign(diff) * np.inf)
    z = np.where(~spread & (diff == 0), 0.0, z)
    lo, hi = np.quantile(null, [0.025, 0.975], axis=0)
    within = pd.array(np.abs(diff) <= sigmas * std, dtype="boolean")
    within[np.isnan(observed)] = pd.NA  # e.g. a domain with no token in this layer
    columns = {"shuffle_mean": mean, "shuffle_std": std, "shuffle_lo": lo, "shuffle_hi": hi, "z": z}
    return {**columns, "within_noise": within}


def _pair_counts(codes: np.ndarray, experts: np.ndarray, num_codes: int, e: int) -> np.ndarray:
    """[num_codes, E] occurrences of each (code, expert) pair in paired samples codes [M], experts [M]."""
    return np.bincount(codes * e + experts, minlength=num_codes * e).reshape(num_codes, e)


def _concat(parts: list[pd.DataFrame]) -> pd.DataFrame:
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def _verdict(within: pd.arrays.BooleanArray, z: np.ndarray, above: str, below: str) -> list[str]:
    return [
        "no baseline" if w is pd.NA else "within noise" if w else above if zz > 0 else below
        for w, zz in zip(within, z, strict=True)
    ]


# ---- domain specialisation ------------------------------------------------------------------------------
@dataclass(frozen=True)
class DomainSpecialisation:
    """`experts`: one row per (layer, site, domain, expert); `summary`: one row per (layer, site, domain)
    for the domain's top expert, judged against the shuffle null of the same max-over-experts statistic."""

    experts: pd.DataFrame
    summary: pd.DataFrame


def _domain_codes(trace: Trace, seq_domains: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(domain names [D], domain code of every token row [T])."""
    seqs = trace.tokens["seq"].to_numpy()
    if len(seqs) and seqs.max() >= len(seq_domains):
        raise ValueError(
            f"seq_domains has {len(seq_domains)} labels but the trace has sequences up to seq {seqs.max()}"
        )
    codes, names = pd.factorize(np.asarray(seq_domains, dtype=object))
    return np.asarray(names), codes[seqs] if len(seqs) else np.zeros(0, dtype=np.int64)


def expert_domain_specialisation(
    trace: Trace, seq_domains: Sequence[str], shuffles: int = 200, seed: int = 0, sigmas: float = 2.0
) -> DomainSpecialisation:
    """DS(e, D) = #{t ∈ D : e ∈ S_t} / #{t ∈ D} per MoE layer, against k/E and a shuffle null.

    `seq_domains[i]` is the domain of sequence i (all its tokens, every stream). The shuffle permutes the
    layer's routing rows across its tokens `shuffles` times (seeded); the per-expert columns compare DS(e, D)
    with its own shuffle distribution, the summary compares max_e DS(e, D) with the shuffle distribution of
    that max (a per-expert null would flag the best of E experts by chance alone).

    experts columns: layer, site, domain, expert, tokens, dispatched, ds, baseline (k/E), lift (ds /
    baseline), shuffle_mean, shuffle_std, shuffle_lo, shuffle_hi, z, within_noise, verdict ("above chance",
    "below chance", "within noise", "no baseline" when shuffles = 0).
    summary columns: layer, site, domain, tokens, top_expert, ds, baseline, lift, the same null columns and
    verdict ("specialised", "below chance", "within noise", "no baseline")."""
    names, codes_all = _domain_codes(trace, seq_domains)
    num_domains = len(names)
    rng = np.random.default_rng(seed)
    expert_parts, summary_parts = [], []
    for routing in trace.layers:
        e, k = routing.num_experts, routing.k
        d = codes_all[routing.token_rows]
        rows, slots = np.nonzero(routing.experts >= 0)
        ex = routing.experts[rows, slots]
        sizes = np.bincount(d, minlength=num_domains).astype(np.float64)

        def dispatched_to(labels: np.ndarray, rows=rows, ex=ex, e=e) -> np.ndarray:
            """[D, E] #{t ∈ D : e ∈ S_t} for domain labels [N] of the layer's tokens."""
            return _pair_counts(labels[rows], ex, num_domains, e)

        dispatched = dispatched_to(d)
        ds = conditional(dispatched, sizes)
        # Permuting labels over tokens = permuting routing rows over tokens (same joint distribution).
        null = (
            np.stack([conditional(dispatched_to(d[rng.permutation(len(d))]), sizes) for _ in range(shuffles)])
            if shuffles
            else None
        )
        baseline = k / e
        per_expert = null_columns(ds, null, sigmas)
        expert_parts.append(
            pd.DataFrame(
                {
                    "layer": routing.layer,
                    "site": routing.site,
                    "domain": np.repeat(names, e),
                    "expert": np.tile(np.arange(e), num_domains),
                    "tokens": np.repeat(sizes, e).astype(np.int64),
                    "dispatched": dispatched.reshape(-1).astype(np.int64),
                    "ds": ds.reshape(-1),
                    "baseline": baseline,
                    "lift": ds.reshape(-1) / baseline,
                    **per_expert,
                    "verdict": _verdict(
                        per_expert["within_noise"], per_expert["z"], "above chance", "below chance"
                    ),
                }
            )
        )
        top = np.nanmax(np.where(np.isnan(ds), -1.0, ds), axis=1)
        summary = null_columns(top, None if null is None else np.nanmax(null, axis=2), sigmas)
        summary_parts.append(
            pd.DataFrame(
                {
                    "layer": routing.layer,
                    "site": routing.site,
                    "domain": names,
                    "tokens": sizes.astype(np.int64),
                    "top_expert": np.argmax(np.nan_to_num(ds, nan=-1.0), axis=1),
                    "ds": np.where(sizes > 0, top, np.nan),
                    "baseline": baseline,
                    "lift": np.where(sizes > 0, top, np.nan) / baseline,
                    **summary,
                    "verdict": _verdict(summary["within_noise"], summary["z"], "specialised", "below chance"),
                }
            )
        )
    return DomainSpecialisation(_concat(expert_parts), _concat(summary_parts))


# ---- vocabulary specialisation ----------------------------------------------------------------------------
VOCAB_KEYS = ("input", "next", "predicted")


def token_keys(trace: Trace, key: str) -> np.ndarray:
    """[T] the id each token row is keyed by, -1 where it has none.

    "input": its own token id; "next": the true next token of the same sequence and stream (none at the last
    position); "predicted": `tokens.predicted_id`, the model's argmax next token (-1 = not computed)."""
    ids = trace.tokens["token_id"].to_numpy().astype(np.int64)
    if key == "input":
        return ids
    if key == "next":
        nxt = next_token_rows(trace.tokens)
        return np.where(nxt >= 0, ids[np.maximum(nxt, 0)], -1)
    if key == "predicted":
        return trace.tokens["predicted_id"].to_numpy().astype(np.int64)
    raise ValueError(f"unknown key {key!r}; expected one of {VOCAB_KEYS}")


@dataclass(frozen=True)
class _VocabLayer:
    """Qualifying ids of one layer: per id its occurrences, and the counts behind the shares."""

    ids: np.ndarray  # [K] key ids with ≥ min_count occurrences
    occurrences: np.ndarray  # [K]
    top1_counts: np.ndarray  # [K, E] occurrences whose top-1 is e
    set_counts: np.ndarray  # [K, E] occurrences whose S_t includes e
    codes: np.ndarray  # [M] compact id code of each counted occurrence (into ids)
    population: np.ndarray  # [P] layer rows with a dispatched expert (what the shuffle permutes)
    selected: np.ndarray  # [P] bool, population rows that are counted occurrences


def _vocab_layer(routing: LayerRouting, keys: np.ndarray, min_count: int) -> _VocabLayer:
    e = routing.num_experts
    top1 = routing.experts[:, 0]
    population = np.nonzero(top1 >= 0)[0]  # tokens with every slot dropped have no expert to count
    g = keys[routing.token_rows[population]]
    uniq, inverse, counts = np.unique(g, return_inverse=True, return_counts=True)
    qualifies = (uniq >= 0) & (counts >= min_count)
    selected = qualifies[inverse]
    compact = np.cumsum(qualifies) - 1
    codes = compact[inverse[selected]]
    num = int(qualifies.sum())
    rows = population[selected]
    top1_counts = _pair_counts(codes, top1[rows], num, e)
    experts = routing.experts[rows]
    ok = experts >= 0
    set_counts = _pair_counts(np.broadcast_to(codes[:, None], experts.shape)[ok], experts[ok], num, e)
    return _VocabLayer(
        uniq[qualifies], counts[qualifies], top1_counts, set_counts, codes, population, selected
    )


def _top_shares(v: _VocabLayer, top1_selected: np.ndarray, e: int) -> np.ndarray:
    """[K] max_e share of each id's occurrences with top-1 e, for top-1 experts of the counted occurrences."""
    return _pair_counts(v.codes, top1_selected, len(v.ids), e).max(axis=1) / v.occurrences


def vocabulary_specialisation_frame(
    trace: Trace,
    min_count: int = 10,
    keys: Sequence[str] = VOCAB_KEYS,
    shuffles: int = 0,
    seed: int = 0,
    sigmas: float = 2.0,
) -> pd.DataFrame:
    """Vocabulary specialisation per (layer, site, key) for key in "input", "next", "predicted".

    specialisation: for each id x with ≥ min_count occurrences in the layer, the share of its occurrences
    whose top-1 expert is x's most frequent top-1 expert, averaged over ids (unweighted, as OLMoE's
    script; its script averages over all ids, the paper's ≥ 10 filter is used here). Uniform level
    baseline_top1 = 1/E — a floor only: a max over E experts of a finite count exceeds 1/E by chance, and a
    skewed load raises it further, so judge against the shuffle null (`shuffles` > 0: routing rows permuted
    across the layer's tokens, the keys left in place). specialisation_weighted: the same averaged over
    occurrences. specialisation_in_set: share of occurrences whose S_t includes x's most frequent expert
    (by dispatch count), baseline_in_set = k/E (again a floor). Tokens with no dispatched expert are skipped.

    Columns: layer, site, key, token_ids, occurrences, specialisation, specialisation_weighted,
    baseline_top1, specialisation_in_set, baseline_in_set, shuffle_mean, shuffle_std, shuffle_lo,
    shuffle_hi, z, within_noise (these for `specialisation`; NaN / NA when shuffles = 0)."""
    rng = np.random.default_rng(seed)
    key_arrays = {key: token_keys(trace, key) for key in keys}
    rows = []
    for routing in trace.layers:
        e, k = routing.num_experts, routing.k
        top1 = routing.experts[:, 0]
        for key, key_ids in key_arrays.items():
            v = _vocab_layer(routing, key_ids, min_count)
            n = len(v.ids)
            top = v.top1_counts.max(axis=1) if n else np.zeros(0)
            observed = float((top / v.occurrences).mean()) if n else float("nan")
            null = None
            if shuffles and n:
                pop_top1 = top1[v.population]
                null = np.array(
                    [
                        _top_shares(v, pop_top1[rng.permutation(len(pop_top1))][v.selected], e).mean()
                        for _ in range(shuffles)
                    ]
                )[:, None]
            rows.append(
                {
                    "layer": routing.layer,
                    "site": routing.site,
                    "key": key,
                    "token_ids": n,
                    "occurrences": int(v.occurrences.sum()),
                    "specialisation": observed,
                    "specialisation_weighted": float(top.sum() / v.occurrences.sum()) if n else float("nan"),
                    "baseline_top1": 1.0 / e,
                    "specialisation_in_set": (
                        float((v.set_counts.max(axis=1) / v.occurrences).mean()) if n else float("nan")
                    ),
                    "baseline_in_set": k / e,
                    **{name: col[0] for name, col in null_columns([observed], null, sigmas).items()},
                }
            )
    frame = pd.DataFrame(rows)
    if len(frame):
        frame["within_noise"] = frame["within_noise"].astype("boolean")
    return frame


def vocabulary_token_frame(trace: Trace, key: str = "input", min_count: int = 10) -> pd.DataFrame:
    """Per (layer, site, token_id) with ≥ min_count occurrences, keyed as in `token_keys`: token (decoded
    text where the id occurs as an input token, else ""), occurrences, top_expert (most frequent top-1
    expert; ties → lowest id), share (of occurrences with that top-1), share_in_set (occurrences whose S_t
    includes its most frequent dispatched expert)."""
    key_ids = token_keys(trace, key)
    text = dict(zip(trace.tokens["token_id"].to_numpy().tolist(), trace.tokens["token"], strict=True))
    parts = []
    for routing in trace.layers:
        v = _vocab_layer(routing, key_ids, min_count)
        parts.append(
            pd.DataFrame(
                {
                    "layer": routing.layer,
                    "site": routing.site,
                    "key": key,
                    "token_id": v.ids,
                    "token": [text.get(int(i), "") for i in v.ids],
                    "occurrences": v.occurrences,
                    "top_expert": v.top1_counts.argmax(axis=1) if len(v.ids) else np.zeros(0, np.int64),
                    "share": v.top1_counts.max(axis=1) / v.occurrences if len(v.ids) else np.zeros(0),
                    "share_in_set": v.set_counts.max(axis=1) / v.occurrences if len(v.ids) else np.zeros(0),
                }
            )
        )
    return _concat(parts)
