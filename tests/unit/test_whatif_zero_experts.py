"""The deployment what-ifs leave zero-computation experts out: their slots need no FFN, no weights and no
transfer, so the routes the simulators replay hold only the routed experts, and say how many slots left."""

from __future__ import annotations

import dataclasses

import numpy as np

from moeviz.testing.scale_traces import synthetic_trace
from moeviz.whatif.routes import routes_from_trace


def test_zero_expert_slots_are_left_out_of_the_simulation_and_counted():
    trace = synthetic_trace(
        num_experts=6, k=2, n_group=1, topk_group=1, num_blocks=1, first_dense=0, num_tokens=6
    )
    experts = np.array([[0, 4], [1, 5], [0, 1], [4, 5], [2, 0], [1, 4]])
    layer = dataclasses.replace(
        trace.layers[0], experts=experts, weights=np.full((6, 2), 0.5, np.float32), zero_experts=2
    )
    routes = routes_from_trace(dataclasses.replace(trace, layers=[layer]))
    (replayed,) = routes.layers
    assert replayed.num_experts == 4
    order = np.lexsort((trace.tokens["pos"].to_numpy(), trace.tokens["seq"].to_numpy()))
    want = np.where(experts >= 4, -1, experts)[order]
    np.testing.assert_array_equal(replayed.experts, want)
    assert (replayed.weights[want < 0] == 0).all()
    assert routes.notes == [
        "41.7% of the expert slots went to zero-computation experts (no FFN, no transfer): they are left out "
        "of the simulation, like slots the model dropped"
    ]
