"""The Learn page's "what to notice" lines (`moeviz.analysis.lesson.*_notice`) against the numbers they
describe, recomputed here in numpy / pandas: each test fails when a line claims what its data do not show
(a rising curve read as "more experts help", a bias read as worsening the load because its busiest expert
moved the other way, two models called different where they look alike)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moeviz.analysis.balance import balance_from_counts
from moeviz.analysis.lesson import (
    aux_notice,
    bias_notice,
    collapse_contrast_layer,
    collapse_notice,
    load_notice,
    router_notice,
    sweep_notice,
    sweep_points,
    top_k_notice,
)

SWEEP = Path(__file__).resolve().parents[2] / "docs" / "experts-sweep.csv"


def normalised_entropy(counts) -> float:
    """H(c / Σc) / log E, by hand."""
    c = np.asarray(counts, dtype=float)
    p = c[c > 0] / c.sum()
    return float(-(p * np.log(p)).sum() / np.log(len(c)))


# ---- step 9: how many experts ---------------------------------------------------------------------------
def curve_shape(sweep: pd.DataFrame, k: int) -> str:
    """A k's curve judged by hand: "flat" when its seed-mean losses span no more than the largest spread
    between seeds at one of its points, else where its lowest and highest points sit."""
    rows = sweep[sweep["k"] == k]
    by_experts = rows.groupby("experts")["heldout_loss"]
    means, noise = by_experts.mean(), (by_experts.max() - by_experts.min()).max()
    if means.max() - means.min() <= noise:
        return "flat"
    if means.idxmin() == means.index.min():
        return "rises"
    return "falls" if means.idxmax() == means.index.min() else "dips"


SHAPE_WORDS = {"flat": "is flat within seed noise", "rises": "rises", "falls": "falls", "dips": "is lowest"}


def said_shape(notice: str, k: int) -> str:
    """The shape the notice gives k's curve."""
    found = re.search(rf"k = {k} (is flat within seed noise|rises|falls|is lowest)", notice)
    assert found, notice
    return {phrase: shape for shape, phrase in SHAPE_WORDS.items()}[found.group(1)]


def test_the_shipped_sweep_is_read_as_it_is() -> None:
    """The shipped sweep: k = 1 rises with the experts (dense lowest), k = 2 is flat within seed noise, and
    the notice says so with the numbers, never "more experts help"; every recorded collapse is named."""
    sweep = pd.read_csv(SWEEP)
    notice = sweep_notice(sweep)
    assert "help less and less" not in notice
    for k in (1, 2):
        assert said_shape(notice, k) == curve_shape(sweep, k), notice
    k1 = sweep[sweep["k"] == 1].groupby("experts")["heldout_loss"].mean()
    assert f"from {k1.min():.3f} at {k1.idxmin()} expert" in notice
    assert f"to {k1.max():.3f} at {k1.idxmax()} experts" in notice
    collapsed = sweep[sweep["collapse_step"].notna()]
    assert len(collapsed), "the shipped sweep records collapses"
    assert f"{len(collapsed)} runs of {len(sweep)} collapsed" in notice
    for run in collapsed.itertuples():
        assert f"seed {run.seed} at step {int(run.collapse_step)}" in notice
    # k = 2 against k = 1 at the same experts, by hand
    means = sweep.groupby(["experts", "k"])["heldout_loss"].mean().unstack()
    gain = (means[1] - means[2]).dropna()
    assert (gain > 0).all()
    assert f"k = 2 beats k = 1 by {gain.min():.3f}–{gain.max():.3f}" in notice


def random_sweep(rng: np.random.Generator, slope: float, noise: float, seeds: int) -> pd.DataFrame:
    """Runs at E ∈ {1, 4, 16, 64} × k ∈ {1, 2} (k = 2 from 4 experts): loss = 5 + slope·log₂E + seed noise."""
    rows = []
    for k in (1, 2):
        for experts in (1, 4, 16, 64):
            if k > experts:
                continue
            for seed in range(seeds):
                loss = 5 + slope * np.log2(experts) - 0.2 * (k - 1) + rng.normal(0, noise)
                rows.append({"experts": experts, "k": k, "seed": seed, "heldout_loss": round(loss, 4)})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("seed", range(40))
def test_each_curve_is_called_what_its_numbers_show(seed: int) -> None:
    """Random sweeps rising, falling, flat or noisy: the shape the notice names is the hand-judged one, and
    the lowest mean it names is the table's."""
    rng = np.random.default_rng(seed)
    sweep = random_sweep(rng, slope=rng.choice([-0.05, 0.0, 0.05]), noise=rng.choice([0.005, 0.05]), seeds=2)
    notice = sweep_notice(sweep)
    for k in (1, 2):
        assert said_shape(notice, k) == curve_shape(sweep, k), notice
    lowest = sweep.groupby(["experts", "k"])["heldout_loss"].mean().min()
    assert f"The lowest mean, {lowest:.3f}" in notice
    assert "collapsed" not in notice  # no collapse_step column: nothing said about collapses


def test_one_seed_says_it_has_no_noise_estimate() -> None:
    sweep = random_sweep(np.random.default_rng(0), slope=-0.05, noise=0.0, seeds=1)
    notice = sweep_notice(sweep)
    assert "no noise estimate" in notice and said_shape(notice, 1) == "falls"


def test_sweep_points_are_the_seed_means_and_collapses() -> None:
    sweep = pd.read_csv(SWEEP)
    points = sweep_points(sweep).set_index(["k", "experts"])
    grouped = sweep.groupby(["k", "experts"])["heldout_loss"]
    np.testing.assert_allclose(points["heldout_loss"], grouped.mean())
    np.testing.assert_allclose(points["highest"] - points["lowest"], grouped.max() - grouped.min())
    marked = points[points["collapses"] != ""].index.tolist()
    assert marked == sorted(
        {(int(r.k), int(r.experts)) for r in sweep[sweep["collapse_step"].notna()].itertuples()}
    )


# ---- step 6: a bias ------------------------------------------------------------------------------------
def test_bias_notice_judges_evenness_by_the_whole_load_not_the_busiest() -> None:
    """The Learn page's default layer once read as if removing the bias evened the load: its busiest expert
    took 7.6% without the bias against 8.0% with it, while the quietest fell from 18 to 8 tokens. The notice
    follows the load entropy and says which expert shows the difference."""
    with_counts = [18, 35, 34, 25, 29, 25, 33, 22, 37, 26, 35, 19, 30, 31, 30, 31]
    without_counts = [22, 32, 34, 29, 32, 8, 35, 19, 35, 34, 31, 33, 25, 29, 32, 30]
    tokens, k = 115, 4
    with_bias = balance_from_counts(np.array(with_counts), tokens, k)
    no_bias = balance_from_counts(np.array(without_counts), tokens, k)
    notice = bias_notice(47, with_bias, no_bias)
    h_with, h_without = normalised_entropy(with_counts), normalised_entropy(without_counts)
    assert h_with > h_without
    assert "With it the load is more even" in notice
    assert f"load entropy {h_with:.3f} vs {h_without:.3f} without" in notice
    slots = tokens * k
    assert f"quietest expert gets {min(with_counts) / slots:.1%} of the slots with the bias, " in notice
    assert f"{min(without_counts) / slots:.1%} without" in notice
    assert (
        f"busiest takes {max(with_counts) / slots:.1%} with it, {max(without_counts) / slots:.1%}" in notice
    )
    assert max(with_counts) > max(without_counts)  # the busiest alone points the wrong way …
    assert "The busiest expert alone does not show the difference" in notice  # … and the notice says so
    assert "47 of 115 tokens (41%)" in notice


def test_bias_notice_says_when_the_bias_makes_the_load_less_even() -> None:
    even, skewed = np.array([10, 10, 10, 10]), np.array([25, 5, 5, 5])
    notice = bias_notice(3, balance_from_counts(skewed, 10, 4), balance_from_counts(even, 10, 4))
    assert "less even with it" in notice and "more even" not in notice
    assert "does not show the difference" not in notice


# ---- step 5: collapse ----------------------------------------------------------------------------------
def collapse_frame() -> pd.DataFrame:
    """Three models × three layers: at layer 0 the first two look alike, at layer 2 they are out of order."""
    entropy = {0: (0.96, 0.95, 0.50), 1: (0.99, 0.75, 0.33), 2: (0.90, 0.93, 0.40)}
    rows = [
        ("mlp", layer, model, 0.2 + 0.1 * i, value, int(i == 2))
        for layer, values in entropy.items()
        for i, (model, value) in enumerate(zip(("healthy", "unbalanced", "collapsed"), values, strict=True))
    ]
    return pd.DataFrame(rows, columns=["site", "layer", "model", "busiest", "entropy", "dead"])


def test_collapse_opens_where_no_two_models_look_alike() -> None:
    frame = collapse_frame()
    smallest_gap = {
        layer: np.diff(-rows["entropy"].to_numpy()).min() for layer, rows in frame.groupby("layer")
    }
    best = max(smallest_gap, key=smallest_gap.get)
    assert collapse_contrast_layer(frame) == ("mlp", best) == ("mlp", 1)


def test_collapse_notice_names_look_alikes_and_disorder() -> None:
    frame = collapse_frame()
    at_0 = collapse_notice(frame, "mlp", 0, 8)
    assert "The weaker the balancing, the less even the load." in at_0
    assert "Healthy and unbalanced differ by 0.010 in load entropy here, by 0.240 at layer 1" in at_0
    assert "1 of 8 experts dead in collapsed" in at_0
    at_1 = collapse_notice(frame, "mlp", 1, 8)
    assert "clearest there" not in at_1  # it is the contrast layer
    at_2 = collapse_notice(frame, "mlp", 2, 8)
    assert "Here unbalanced is no less even than healthy." in at_2
    assert "The weaker the balancing" not in at_2


# ---- steps 1–4 -----------------------------------------------------------------------------------------
def walkthrough(model_weight: list[float]) -> pd.DataFrame:
    score = np.array([0.5, 0.3, 0.15, 0.05])
    chosen = np.array([True, True, False, False])
    weight = np.where(chosen, score / score[chosen].sum(), 0.0)
    return pd.DataFrame(
        {
            "expert": range(4),
            "score": score,
            "chosen": chosen,
            "rank": [0, 1, -1, -1],
            "weight": weight,
            "model_weight": model_weight,
        }
    )


def test_router_notice_says_renormalised_only_when_the_model_renormalises() -> None:
    renormalised = router_notice(walkthrough([0.625, 0.375, 0, 0]), 4)
    assert "they are rescaled to sum to 1" in renormalised and "w = 0.625" in renormalised
    raw = router_notice(walkthrough([0.5, 0.3, 0, 0]), 4)  # e.g. norm_topk_prob = false
    assert "rescaled" not in raw and "they sum to 0.800" in raw


def test_top_k_notice_takes_the_largest_weight_as_the_first_expert() -> None:
    weights = np.array([[0.3, 0.7], [0.6, 0.4]])  # slots not ordered by weight
    notice = top_k_notice(weights, max_share=0.25, tokens=2, num_experts=8)
    assert f"carries {np.mean([0.7, 0.6]):.0%} of the output" in notice
    assert f"the other {1 - np.mean([0.7, 0.6]):.0%}" in notice


def test_load_notice_names_the_busiest_and_the_quietest() -> None:
    counts = np.array([5, 1, 2, 0])
    load = pd.DataFrame({"expert": range(4), "share": counts / 8, "utilisation": counts / 2})
    notice = load_notice(load, 3)
    assert "expert 0 gets 62.5% (2.50× its share) and expert 3 0.0% (0.00×)" in notice


def test_aux_notice_says_why_the_largest_term_is_large() -> None:
    """The largest term can come from probability alone: the notice then says the expert gets no more than
    its share of the tokens."""
    f = np.array([0.5, 0.5, 0.5, 0.5])  # k = 2, E = 4: every f at k/E
    p = np.array([0.7, 0.1, 0.1, 0.1])
    terms = pd.DataFrame({"expert": range(4), "f": f, "P": p, "term": 4 * f * p})
    notice = aux_notice(terms, 2, 0)
    assert "Expert 0 adds the most" in notice
    assert "no more than its share of the tokens" in notice
    assert "and more than its share of the probability" in notice
    assert f"it is {4 * (f * p).sum():.4f}" in notice and "(at it)" in notice
