"""Collapse verdicts on synthetic layers with known answers, and the verdict ordering a CLI gates on.
On real captures: tests/models/test_analysis_on_models.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moeviz.analysis import CollapseThresholds, Verdict, collapse_frame, collapse_report, layer_verdict
from moeviz.analysis.collapse import NOT_ENOUGH_TOKENS
from tests.support.traces import make_layer, make_trace


def top1_layer(counts: list[int], layer: int = 0, logits=None, bias=None, **kwargs):
    """A top-1 layer whose expert e received counts[e] tokens (in blocks)."""
    experts = np.repeat(np.arange(len(counts)), counts)
    return make_layer(experts, len(counts), logits, layer=layer, bias=bias, **kwargs)


def independent_trace(*layers):
    """A trace whose tokens are independent: each one its own sequence (no intra-text correlation)."""
    trace = make_trace(layers)
    trace.tokens["seq"] = np.arange(len(trace.tokens))
    trace.tokens["pos"] = 0
    return trace


def test_uniform_routing_is_healthy():
    lv = layer_verdict(top1_layer([10] * 8))
    assert lv.verdict is Verdict.HEALTHY and lv.reasons == [] and lv.notes == ()
    assert lv.describe() == "layer 0: healthy"


def test_every_token_to_one_expert_is_collapsed():
    report = collapse_report(make_trace([top1_layer([0, 0, 80, 0, 0, 0, 0, 0])]))
    assert report.verdict is Verdict.COLLAPSED
    (reason,) = report.reasons
    assert reason.startswith(
        "layer 0: 7 of 8 experts received no token; one expert (e2) took 100% of the load"
    )
    assert "normalised load entropy 0.00" in reason


def test_reason_text_names_dead_experts_and_the_dominant_one():
    lv = layer_verdict(top1_layer([15, 14, 71, 0, 0, 0, 0, 0], layer=3))
    assert lv.verdict is Verdict.COLLAPSED
    assert lv.describe().startswith(
        "layer 3: 5 of 8 experts received no token; one expert (e2) took 71% of the load"
    )
    levels = [f.level for f in lv.findings]
    assert levels[:2] == [Verdict.COLLAPSED, Verdict.COLLAPSED]  # 62.5% dead, 71% > 50% share


def test_dead_fraction_thresholds_are_inclusive():
    one_dead = layer_verdict(top1_layer([12, 12, 12, 12, 12, 12, 12, 0]))
    assert one_dead.verdict is Verdict.HEALTHY  # 1/8 dead < 25%, entropy 0.94, share 1.14× fair
    two_dead = layer_verdict(top1_layer([14, 14, 14, 14, 14, 14, 0, 0]))
    assert two_dead.verdict is Verdict.WARNING and two_dead.reasons == ["2 of 8 experts received no token"]
    four_dead = layer_verdict(top1_layer([20, 20, 20, 20, 0, 0, 0, 0]))
    assert four_dead.verdict is Verdict.COLLAPSED  # exactly 50%
    assert four_dead.reasons[0] == "4 of 8 experts received no token"


def test_max_share_rules():
    # top-1, E = 8: 2.5/E = 31.25% → warning; > 50% → collapsed
    warn = layer_verdict(top1_layer([35, 10, 10, 10, 10, 10, 10, 5]))
    assert warn.verdict is Verdict.WARNING
    assert warn.reasons[0].startswith("one expert (e0) took 35% of the load (2.8× fair share)")
    # E = 2: 2.5/E > 1 never fires and 0.6 > 0.5 must not call a 60/40 split collapsed
    assert layer_verdict(top1_layer([60, 40])).verdict is Verdict.HEALTHY
    # top-2: the share is capped at 1/k; the reason also says how many tokens picked the expert
    pairs = [(0, 1 + i % 7) for i in range(70)]
    top2 = layer_verdict(make_layer(pairs, 8))
    assert top2.verdict is Verdict.WARNING
    assert "one expert (e0) took 50% of the load (4.0× fair share, picked by 100% of tokens)" in top2.reasons


def test_entropy_rule():
    # E = 2, 85/15: entropy 0.61 → warning only; 95/5: 0.29 → collapsed
    assert layer_verdict(top1_layer([85, 15])).verdict is Verdict.WARNING
    collapsed = layer_verdict(top1_layer([95, 5]))
    assert collapsed.verdict is Verdict.COLLAPSED
    assert collapsed.reasons[-1].startswith("normalised load entropy 0.29")


def test_too_few_tokens_are_not_judged_on_load_but_bias_still_is():
    small = layer_verdict(top1_layer([3, 0, 0, 0, 0, 0, 0, 0]))
    assert small.verdict is Verdict.HEALTHY and small.reasons == []
    # too few tokens to judge is a note, not a reason: it starts with NOT_ENOUGH_TOKENS and the status says so
    assert small.notes == (f"{NOT_ENOUGH_TOKENS}: 3 tokens (needs ≥ 40 tokens)",)
    assert small.status == "not enough tokens" and small.load_test.min_tokens == 40
    biased = layer_verdict(top1_layer([3, 0, 0, 0], bias=[3.0, -3.0, 0.0, 0.0]))
    assert biased.verdict is Verdict.WARNING and biased.reasons == ["balancing bias std 2.12 > 1"]
    empty = layer_verdict(make_layer(np.zeros((0, 2)), 4))
    assert empty.verdict is Verdict.HEALTHY and empty.notes == ("no tokens routed: load not judged",)


def test_router_warnings_bias_and_z_loss():
    counts = [10] * 8
    big_bias = layer_verdict(top1_layer(counts, bias=[6.0] * 8))
    assert big_bias.verdict is Verdict.WARNING
    assert big_bias.reasons == ["balancing bias |b| up to 6.00 > 5"]
    logits = np.full((80, 8), 12.0, np.float32)  # balanced dispatch, but logsumexp = 12 + log 8 → z ≈ 198.2
    hot = layer_verdict(top1_layer(counts, logits=logits))
    assert hot.verdict is Verdict.WARNING and hot.reasons[0].startswith("router z-loss 198.2 > 101.6")
    assert layer_verdict(top1_layer(counts, logits=logits - 8)).verdict is Verdict.HEALTHY


def test_heavy_dropping_is_noted():
    experts = np.where((np.arange(80) // 8) % 2 == 0, np.arange(80) % 8, -1)  # every other block dropped
    lv = layer_verdict(make_layer(experts, 8))
    assert lv.notes == ("50% of slots dropped by capacity: the load shown is after dropping",)


def test_model_verdict_is_the_worst_layer():
    trace = independent_trace(
        top1_layer([10] * 8, layer=0),
        top1_layer([14, 14, 14, 14, 14, 14, 0, 0], layer=1),
        top1_layer([0, 0, 80, 0, 0, 0, 0, 0], layer=2),
        top1_layer([0, 80, 0, 0, 0, 0, 0, 0], layer=3, site="decoder"),
    )
    report = collapse_report(trace)
    assert report.verdict is Verdict.COLLAPSED
    assert [lv.verdict for lv in report.layers] == [
        Verdict.HEALTHY,
        Verdict.WARNING,
        Verdict.COLLAPSED,
        Verdict.COLLAPSED,
    ]
    assert [r.split(":")[0] for r in report.reasons] == ["layer 1", "layer 2", "decoder layer 3"]
    assert report.fails("warning") and report.fails(Verdict.COLLAPSED)
    frame = collapse_frame(report)
    assert frame["verdict"].tolist() == ["healthy", "warning", "collapsed", "collapsed"]
    assert frame.loc[1, "reasons"] == "2 of 8 experts received no token"
    assert "verdict: collapsed (4 MoE layers)" in report.summary()
    healthy = collapse_report(make_trace([top1_layer([10] * 8)]))
    assert healthy.verdict is Verdict.HEALTHY and not healthy.fails("warning") and healthy.reasons == []
    assert collapse_report(make_trace()).verdict is Verdict.HEALTHY


def test_thresholds_are_configurable():
    layer = top1_layer([14, 14, 14, 14, 14, 14, 0, 0])
    lenient = dataclasses.replace(CollapseThresholds(), warning_dead_fraction=0.3)
    assert layer_verdict(layer, lenient).verdict is Verdict.HEALTHY
    strict = dataclasses.replace(CollapseThresholds(), collapsed_dead_fraction=0.25)
    assert layer_verdict(layer, strict).verdict is Verdict.COLLAPSED
    assert collapse_report(make_trace([layer]), strict).thresholds is strict


def test_verdict_order_and_parsing_for_a_cli():
    assert Verdict.HEALTHY < Verdict.WARNING < Verdict.COLLAPSED
    assert max([Verdict.WARNING, Verdict.COLLAPSED, Verdict.HEALTHY]) is Verdict.COLLAPSED
    assert Verdict.parse("Warning") is Verdict.WARNING and Verdict.parse(" collapsed ") is Verdict.COLLAPSED
    assert Verdict.parse(Verdict.HEALTHY) is Verdict.HEALTHY
    assert str(Verdict.COLLAPSED) == "collapsed" and Verdict.choices() == ["healthy", "warning", "collapsed"]
    with pytest.raises(ValueError, match="healthy, warning, collapsed"):
        Verdict.parse("broken")


def test_one_text_counts_as_few_independent_tokens():
    # the layers of test_model_verdict_is_the_worst_layer as ONE 84-token text: ρ = 0.25 makes it ≈ 3.9
    # independent tokens, and a top-1 layer of 8 experts needs ≈ 4.4 for total collapse to be significant
    layers = [
        top1_layer([14, 14, 14, 14, 14, 14, 0, 0], layer=1),
        top1_layer([0, 0, 84, 0, 0, 0, 0, 0], layer=2),
    ]
    report = collapse_report(make_trace(layers))
    assert report.verdict is Verdict.HEALTHY and not report.judged
    assert all(lv.status == "not enough tokens" for lv in report.layers)
    assert report.notes[0].startswith(
        f"layer 1: {NOT_ENOUGH_TOKENS}: 84 tokens in 1 sequence(s) ≈ 3.9 independent"
    )
    assert "more sequences" in report.notes[0] and f"load {NOT_ENOUGH_TOKENS}" in report.summary()
    # the same tokens as independent draws are judged; the dead experts of layer 1 are significant
    independent = collapse_report(independent_trace(*layers))
    assert [str(lv.verdict) for lv in independent.layers] == ["warning", "collapsed"]
    frame = collapse_frame(independent)
    assert frame["status"].tolist() == ["judged", "judged"]
    assert frame.loc[0, "p_dead"] < frame.loc[0, "alpha"] == pytest.approx(0.01 / 6)
    assert np.isnan(frame.loc[0, "p_max_share"])  # rule not fired: no p-value
    assert frame["effective_tokens"].tolist() == [84.0, 84.0]
    # the threshold alone would fire, but 2 of 8 dead in a 40-token text (≈ 3.7 independent tokens) is chance
    pairs = make_layer([(i % 6, (i + 1) % 6) for i in range(40)], 8)
    chance = layer_verdict(pairs, sequence_lengths=[40])
    assert chance.verdict is Verdict.HEALTHY and chance.status == "judged"
    assert chance.notes[0].startswith("not significant: 2 of 8 experts received no token (p = ")
    assert chance.load_test.p_dead > chance.load_test.alpha


def test_no_correlation_and_level_are_configurable():
    layer = top1_layer([14, 14, 14, 14, 14, 14, 0, 0])
    independent = dataclasses.replace(CollapseThresholds(), token_correlation=0.0)
    assert collapse_report(make_trace([layer]), independent).verdict is Verdict.WARNING
    lax = dataclasses.replace(
        CollapseThresholds(), alpha=3.0
    )  # per-test level 3 / (3 · 1) = 1: thresholds alone
    pairs = make_layer([(i % 6, (i + 1) % 6) for i in range(40)], 8)
    assert layer_verdict(pairs, lax, sequence_lengths=[40]).verdict is Verdict.WARNING
