"""Deployment what-ifs replayed from real routing: expert parallelism and All-to-All, expert offloading
caches, capacity drops, quantisation flips, a windowed KV cache, and a model-size calculator.

Every definition follows the anchors in docs/deployment-whatifs.md; each result's `.definition` says which
one it used. The replay simulators (ep, offload, capacity) take `Routes` (from a Trace or a corpus store) and
never run the model; `quantisation_flips` and `prefetch_recall` must run it.
"""

from moeviz.whatif.capacity import CapacityResult, expert_capacity, replay_capacity
from moeviz.whatif.ep import EPConfig, EPResult, Placement, fit_placement, simulate_ep
from moeviz.whatif.eplb import rebalance_experts
from moeviz.whatif.kv_cache import kv_cache_whatif
from moeviz.whatif.model_size import KNOWN_MODELS, ModelSize, expert_bytes, expert_flops_per_token, model_size
from moeviz.whatif.offload import (
    POLICIES,
    OffloadResult,
    hit_rate_curve,
    simulate_offload,
    simulate_offload_policies,
)
from moeviz.whatif.prefetch import prefetch_recall
from moeviz.whatif.quant import QuantResult, fake_quantise, quantisation_flips
from moeviz.whatif.routes import LayerRoutes, Routes, routes_from_store, routes_from_trace

__all__ = [
    "KNOWN_MODELS",
    "POLICIES",
    "CapacityResult",
    "EPConfig",
    "EPResult",
    "LayerRoutes",
    "ModelSize",
    "OffloadResult",
    "Placement",
    "QuantResult",
    "Routes",
    "expert_bytes",
    "expert_capacity",
    "expert_flops_per_token",
    "fake_quantise",
    "fit_placement",
    "hit_rate_curve",
    "kv_cache_whatif",
    "model_size",
    "prefetch_recall",
    "quantisation_flips",
    "rebalance_experts",
    "replay_capacity",
    "routes_from_store",
    "routes_from_trace",
    "simulate_ep",
    "simulate_offload",
    "simulate_offload_policies",
]
