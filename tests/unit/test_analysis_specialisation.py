"""Specialisation with null baselines: domain (OLMoE DS), vocabulary (input / next / predicted ids) and the
mutual-information functions the model cards use, on synthetic routing. On real captures:
tests/models/test_analysis_on_models.py."""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import pairwise

import numpy as np
import pandas as pd
import pytest

from moeviz.analysis.specialisation import (
    domain_specialisation_frame,
    expert_domain_specialisation,
    mutual_information_bits,
    null_columns,
    token_keys,
    vocabulary_specialisation_frame,
    vocabulary_token_frame,
)
from tests.support.traces import make_trace, random_sets


# ---- domain specialisation --------------------------------------------------------------------------------
def domain_trace(rng, seq_len=60, seqs=20, specialised=True):
    """Seqs alternate domains A, B; in A every token has expert 0 in S_t (when `specialised`)."""
    domains = ["A" if i % 2 == 0 else "B" for i in range(seqs)]
    n = seq_len * seqs
    experts = random_sets(rng, n, 8, 2)
    if specialised:
        in_a = np.repeat(np.array(domains) == "A", seq_len)
        other = rng.integers(1, 8, n)
        experts[in_a] = np.stack([np.zeros(n, int), other], axis=1)[in_a]
    return make_trace([experts, random_sets(rng, n, 8, 2)], 8, seq_lengths=[seq_len] * seqs), domains


def test_domain_specialisation_matches_groupby_and_flags_real_specialisation():
    trace, domains = domain_trace(np.random.default_rng(0))
    result = expert_domain_specialisation(trace, domains, shuffles=100, seed=1)
    experts = result.experts.set_index(["layer", "domain", "expert"])
    # Independent: pandas over the tidy routing frame.
    frame = trace.routing_frame()
    frame = frame[frame["expert"] >= 0].assign(domain=lambda f: np.array(domains)[f["seq"]])
    sizes = trace.tokens.assign(domain=np.array(domains)[trace.tokens["seq"]]).groupby("domain").size()
    expected = (
        frame.groupby(["layer", "domain", "expert"]).size()
        / sizes.reindex(
            frame.groupby(["layer", "domain", "expert"]).size().index.get_level_values("domain")
        ).to_numpy()
    )
    np.testing.assert_allclose(experts.loc[expected.index, "ds"], expected)
    assert experts.loc[(0, "A", 0), "ds"] == 1.0
    assert experts.loc[(0, "A", 0), "verdict"] == "above chance"
    assert experts.loc[(0, "A", 0), "baseline"] == 0.25 and experts.loc[(0, "A", 0), "lift"] == 4.0
    summary = result.summary.set_index(["layer", "domain"])
    assert summary.loc[(0, "A"), "top_expert"] == 0 and summary.loc[(0, "A"), "ds"] == 1.0
    assert summary.loc[(0, "A"), "verdict"] == "specialised" and not summary.loc[(0, "A"), "within_noise"]
    # Layer 1 routes at random: within noise for both domains.
    assert summary.loc[1, "within_noise"].all() and set(summary.loc[1, "verdict"]) == {"within noise"}
    assert list(result.experts.columns[:9]) == [
        *["layer", "site", "domain", "expert", "tokens", "dispatched", "ds", "baseline", "lift"]
    ]


def test_domain_specialisation_of_random_routing_is_within_noise():
    trace, domains = domain_trace(np.random.default_rng(2), specialised=False)
    result = expert_domain_specialisation(trace, domains, shuffles=200, seed=3)
    assert result.summary["within_noise"].all()
    assert result.experts["within_noise"].mean() >= 0.85  # ~95 % expected per expert
    assert (result.experts["ds"] - 0.25).abs().max() < 0.1


def test_domain_specialisation_without_shuffles_and_bad_labels():
    trace, domains = domain_trace(np.random.default_rng(4))
    result = expert_domain_specialisation(trace, domains, shuffles=0)
    assert result.experts["within_noise"].isna().all() and set(result.summary["verdict"]) == {"no baseline"}
    with pytest.raises(ValueError, match="seq_domains"):
        expert_domain_specialisation(trace, domains[:-1])


def test_null_columns():
    null = np.array([[0.0, 1.0], [2.0, 1.0]])  # means 1, 1; stds 1, 0
    cols = null_columns(np.array([2.9, 1.0]), null)
    assert cols["z"].tolist() == [pytest.approx(1.9), 0.0] and cols["within_noise"].tolist() == [True, True]
    cols = null_columns(np.array([3.1, 1.5]), null)
    assert cols["within_noise"].tolist() == [False, False] and cols["z"][1] == np.inf


# ---- vocabulary specialisation ----------------------------------------------------------------------------
def test_vocabulary_specialisation_hand_example():
    # id 5: 10×, top-1 expert 2 seven times and 1 three times, second slot always 4 → in-set share 1.
    # id 6: 20×, top-1 always 3. id 7: 3× (below min_count).
    ids = [5] * 10 + [6] * 20 + [7] * 3
    top = [2] * 7 + [1] * 3 + [3] * 20 + [0] * 3
    second = [4] * 10 + [5, 6] * 10 + [1] * 3
    trace = make_trace([np.array([top, second]).T], 8, token_ids=ids)
    row = vocabulary_specialisation_frame(trace, keys=["input"]).iloc[0]
    assert (row["token_ids"], row["occurrences"]) == (2, 30)
    assert row["specialisation"] == pytest.approx((0.7 + 1.0) / 2)
    assert row["specialisation_weighted"] == pytest.approx((7 + 20) / 30)
    assert row["specialisation_in_set"] == 1.0
    assert (row["baseline_top1"], row["baseline_in_set"]) == (1 / 8, 2 / 8)
    assert pd.isna(row["within_noise"])
    tokens = vocabulary_token_frame(trace).set_index("token_id")
    assert tokens.loc[5, "top_expert"] == 2 and tokens.loc[5, "share"] == 0.7
    assert tokens.loc[6, "share_in_set"] == 1.0 and tokens.loc[5, "token"] == "t5" and 7 not in tokens.index
    assert len(vocabulary_specialisation_frame(trace, min_count=3, keys=["input"])) == 1
    assert vocabulary_specialisation_frame(trace, min_count=3, keys=["input"])["token_ids"].iloc[0] == 3


def brute_vocab(keys: list[int], top1: list[int], min_count: int) -> float:
    by_key = defaultdict(list)
    for x, e in zip(keys, top1, strict=True):
        if x >= 0 and e >= 0:
            by_key[x].append(e)
    shares = [Counter(v).most_common(1)[0][1] / len(v) for v in by_key.values() if len(v) >= min_count]
    return float(np.mean(shares))


def test_vocabulary_keys_match_brute_force():
    rng = np.random.default_rng(5)
    lengths = [40, 25, 35]
    n = sum(lengths)
    ids = rng.integers(0, 6, n)
    predicted = np.where(rng.random(n) < 0.2, -1, rng.integers(0, 6, n))
    experts = random_sets(rng, n, 4, 2, [0.4, 0.3, 0.2, 0.1])
    experts[3] = -1  # no dispatched expert: skipped
    trace = make_trace([experts], 4, seq_lengths=lengths, token_ids=ids, predicted=predicted)
    frame = vocabulary_specialisation_frame(trace, min_count=4).set_index("key")
    starts = np.cumsum([0, *lengths])
    nxt = np.full(n, -1)
    for a, b in pairwise(starts):  # next token within each sequence
        nxt[a : b - 1] = ids[a + 1 : b]
    assert token_keys(trace, "next").tolist() == nxt.tolist()
    top1 = experts[:, 0].tolist()
    for key, values in (("input", ids), ("next", nxt), ("predicted", predicted)):
        assert frame.loc[key, "specialisation"] == pytest.approx(brute_vocab(values.tolist(), top1, 4))
    with pytest.raises(ValueError, match="unknown key"):
        token_keys(trace, "previous")


def test_vocabulary_specialisation_against_shuffles():
    rng = np.random.default_rng(6)
    n = 4000
    ids = rng.integers(0, 50, n)
    random_routing = random_sets(rng, n, 8, 2)
    by_id = np.stack([ids % 8, (ids + 1) % 8], axis=1)  # routing decided by the token id
    trace = make_trace([random_routing, by_id], 8, token_ids=ids)
    frame = vocabulary_specialisation_frame(trace, keys=["input"], shuffles=50, seed=7).set_index("layer")
    # Random routing: ~80 occurrences per id → the max share sits well above 1/E by chance alone.
    assert frame.loc[0, "specialisation"] > 0.16 > frame.loc[0, "baseline_top1"] + 0.03
    assert frame.loc[0, "within_noise"] and not frame.loc[1, "within_noise"]
    assert frame.loc[1, "specialisation"] == 1.0 and frame.loc[1, "z"] > 10


# ---- mutual information (used by the model cards) ---------------------------------------------------------
def test_mutual_information_and_frame_columns():
    labels = np.array([0, 0, 1, 1] * 10)
    assert mutual_information_bits(labels, labels * 3) == pytest.approx(1.0)
    assert mutual_information_bits(labels, np.zeros(40, int)) == 0.0
    trace, domains = domain_trace(np.random.default_rng(8))
    frame = domain_specialisation_frame(trace, domains, shuffles=5)
    assert list(frame.columns) == ["layer", "site", "mi_bits", "null_mean", "null_std", "mi_max"]
    assert frame["mi_bits"].iloc[0] > frame["null_mean"].iloc[0] + 3 * frame["null_std"].iloc[0]
