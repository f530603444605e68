"""When the app switches to its views at scale: a model whose MoE layers have more experts than a categorical
legend lists (`moeviz.charts.MAX_CATEGORICAL`, 20; DeepSeek-V3's 256, Kimi-K2's 384). No Streamlit."""

from __future__ import annotations

import moeviz
from moeviz.charts import MAX_CATEGORICAL


def at_scale(num_experts: int) -> bool:
    """Whether an expert axis of `num_experts` needs the views at scale."""
    return num_experts > MAX_CATEGORICAL


def trace_at_scale(trace: moeviz.Trace) -> bool:
    """Whether any MoE layer of the trace has more than MAX_CATEGORICAL experts."""
    return any(at_scale(routing.num_experts) for routing in trace.layers)
