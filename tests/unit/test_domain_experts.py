"""`moeviz.analysis.domain_top_experts` against counts by hand. The Corpus page's table against it:
tests/app/test_domain_experts_page.py."""

from __future__ import annotations

from math import comb

import numpy as np
import pandas as pd
import pytest

from moeviz.analysis import domain_top_experts
from moeviz.analysis import domains as domains_module
from moeviz.testing.scale_traces import synthetic_trace


def counts(rows: dict[str, list[int]]) -> pd.DataFrame:
    """One layer, k = 1: rows[domain][expert] = tokens of the domain whose top-1 is the expert."""
    out = []
    for domain, per_expert in rows.items():
        for expert, n in enumerate(per_expert):
            out.append(
                {"site": "mlp", "layer": 0, "domain": domain, "expert": expert}
                | {"tokens": sum(per_expert), "dispatched": n}
            )
    return pd.DataFrame(out)


def test_top_experts_by_hand() -> None:
    # A: 4 tokens → experts 0,0,0,1; B: 4 tokens → 0,1,2,2. T = 8; M = (4, 2, 2) tokens per expert.
    top = domain_top_experts(counts({"A": [3, 1, 0], "B": [1, 1, 2]}), top_n=2, level=0.95)
    got = top.set_index(["domain", "rank"])
    assert list(got.loc["A", "expert"]) == [0, 1] and list(got.loc["B", "expert"]) == [2, 0]  # tie → low id
    a1, a2, b1, b2 = (got.loc[key] for key in [("A", 1), ("A", 2), ("B", 1), ("B", 2)])
    assert a1["share"] == 3 / 4 and a1["null_share"] == 4 / 8 and a1["lift"] == 1.5
    assert a2["share"] == 1 / 4 and a2["null_share"] == 2 / 8 and a2["lift"] == 1.0
    assert b1["share"] == 2 / 4 and b1["null_share"] == 2 / 8 and b1["lift"] == 2.0
    assert b2["share"] == 1 / 4 and b2["null_share"] == 4 / 8 and b2["lift"] == 0.5
    # Domain labels permuted over the 8 tokens: X ~ Hypergeometric(8, M_e, 4).
    total = comb(8, 4)
    assert a1["p_value"] == pytest.approx((comb(4, 3) * comb(4, 1) + comb(4, 4)) / total)  # 17/70
    assert a2["p_value"] == pytest.approx(1 - comb(6, 4) / total)  # 55/70
    assert b1["p_value"] == pytest.approx(comb(6, 2) / total)  # 15/70
    # X for expert 0 (M = 4): pmf 1, 16, 36, 16, 1 (/70) → 2.5 % quantile 1, 97.5 % quantile 3 (of 4 slots).
    assert (a1["null_lo"], a1["null_hi"]) == (1 / 4, 3 / 4)
    assert not top["significant"].any()  # 8 tokens: nothing below 0.05 / 6


def test_strong_specialisation_is_significant_and_normal_tail_agrees(monkeypatch) -> None:
    frame = counts({"code": [900, 50, 50, 0], "prose": [100, 300, 300, 300]})
    exact = domain_top_experts(frame, top_n=1)
    row = exact.set_index("domain").loc["code"]
    assert row["expert"] == 0 and row["significant"] and row["lift"] == pytest.approx(0.9 / 0.5)
    assert row["null_lo"] < 0.5 < row["null_hi"] < row["share"]
    monkeypatch.setattr(domains_module, "EXACT_SUPPORT", 0)  # the normal approximation of large stores
    approx = domain_top_experts(frame, top_n=1)
    prose = exact.set_index("domain").loc["prose"]
    assert approx.set_index("domain").loc["prose", "p_value"] == pytest.approx(prose["p_value"], abs=0.02)
    assert approx["significant"].tolist() == exact["significant"].tolist()


def test_trace_input_matches_counts_by_hand() -> None:
    trace = synthetic_trace(
        num_experts=8, k=2, n_group=1, topk_group=1, num_blocks=2, first_dense=0, num_tokens=64
    )
    top = domain_top_experts(trace, ["only"], top_n=8)
    for routing in trace.layers:
        ids = routing.experts[routing.experts >= 0]
        per_expert = np.bincount(ids, minlength=8)
        got = top[top["layer"] == routing.layer]
        order = sorted(range(8), key=lambda e: (-per_expert[e], e))
        assert got["expert"].tolist() == [e for e in order if per_expert[e] > 0]  # unused experts left out
        assert got["share"].tolist() == pytest.approx([per_expert[e] / len(ids) for e in got["expert"]])
        assert got["lift"].tolist() == pytest.approx([1.0] * len(got))  # one domain: no preference possible
        assert got["p_value"].tolist() == pytest.approx([1.0] * len(got))
