"""The router z-loss rule: judged on the log-partition's excess over log E, which uniform
logits reach at any E, and only for softmax routers (sigmoid routers are not trained with a z-loss)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moeviz.analysis import CollapseThresholds, Verdict, collapse_frame, collapse_report, layer_verdict
from moeviz.testing.scale_traces import synthetic_trace
from tests.support.traces import make_layer


def balanced_layer(num_experts: int, logit: float, score_fn: str = "softmax", tokens_per_expert: int = 10):
    """A top-1 layer with every expert equally loaded and every router logit equal to `logit`."""
    experts = np.repeat(np.arange(num_experts), tokens_per_expert)
    logits = np.full((len(experts), num_experts), logit, np.float32)
    return make_layer(experts, num_experts, logits, score_fn=score_fn)


def rms_logsumexp(logits: np.ndarray) -> float:
    """RMS over tokens of log Σ_e exp(logit), computed directly in float64 (shifted by the row max)."""
    x = np.asarray(logits, np.float64)
    top = x.max(axis=1, keepdims=True)
    lse = (top + np.log(np.exp(x - top).sum(axis=1, keepdims=True)))[:, 0]
    return float(np.sqrt((lse**2).mean()))


def z_reasons(verdict) -> list[str]:
    return [r for r in verdict.reasons if r.startswith("router z-loss")]


@pytest.mark.parametrize("num_experts", [8, 64, 256, 384])
def test_uniform_logits_are_never_warned_about_at_any_number_of_experts(num_experts):
    """Zero logits have RMS logsumexp log E exactly: an excess of 0, however many experts."""
    layer = balanced_layer(num_experts, 0.0)
    assert rms_logsumexp(layer.logits) == pytest.approx(math.log(num_experts), rel=1e-6)
    assert z_reasons(layer_verdict(layer)) == []


def test_the_threshold_grows_with_log_e():
    t = CollapseThresholds()
    for e in (8, 256):
        assert t.z_loss_threshold(e) == pytest.approx((math.log(e) + t.warning_logit_excess) ** 2)
    assert t.z_loss_threshold(8) == pytest.approx(101.6, abs=0.05)  # ≈ the former fixed 100 at E = 8
    assert t.z_loss_threshold(256) == pytest.approx(183.5, abs=0.05)  # as docs/verdicts.md tabulates


def test_a_256_expert_softmax_router_with_modest_logits_is_not_warned():
    """Logits of 5 everywhere: RMS logsumexp = 5 + log 256 ≈ 10.5, z ≈ 111 — over the former fixed 100, but
    only 5 nats above uniform logits: the top logit is 5, well inside bf16's fine range."""
    layer = balanced_layer(256, 5.0)
    rms = rms_logsumexp(layer.logits)
    assert rms**2 > 100 and rms - math.log(256) == pytest.approx(5.0, abs=1e-4)
    verdict = layer_verdict(layer)
    assert z_reasons(verdict) == [] and verdict.verdict is Verdict.HEALTHY


def test_a_256_expert_softmax_router_with_large_logits_is_warned_with_its_excess():
    layer = balanced_layer(256, 9.0)
    rms = rms_logsumexp(layer.logits)
    verdict = layer_verdict(layer)
    (reason,) = z_reasons(verdict)
    limit = (math.log(256) + 8) ** 2
    assert verdict.verdict is Verdict.WARNING
    assert reason.startswith(f"router z-loss {rms**2:.1f} > {limit:.1f} ")
    assert f"= log E + {rms - math.log(256):.1f} > log E + 8" in reason


def test_a_sigmoid_router_gets_no_z_loss_warning_but_keeps_its_z_loss():
    """Sigmoid routers (DeepSeek-V3) score each expert on its own: no partition function, no z-loss in
    training. Logits of 12 would warn a softmax router; the sigmoid one's z-loss is still reported."""
    softmax, sigmoid = balanced_layer(256, 12.0), balanced_layer(256, 12.0, "sigmoid")
    assert z_reasons(layer_verdict(softmax)) != []
    verdict = layer_verdict(sigmoid)
    assert z_reasons(verdict) == [] and verdict.verdict is Verdict.HEALTHY
    assert verdict.z_loss == pytest.approx(rms_logsumexp(sigmoid.logits) ** 2, rel=1e-5)


def test_the_deepseek_v3_shaped_trace_has_no_z_loss_warning():
    """58 sigmoid layers of 256 experts: none is warned about its z-loss; the frame still has the values."""
    trace = synthetic_trace(num_tokens=256)
    report = collapse_report(trace)
    assert not any(z_reasons(lv) for lv in report.layers)
    frame = collapse_frame(report)
    expected = [rms_logsumexp(r.logits) ** 2 for r in trace.layers]
    np.testing.assert_allclose(frame["z_loss"].to_numpy(), expected, rtol=1e-4)
