"""Known-answer tests for the EP simulator and the EPLB port (every expected figure computed by hand)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeviz.errors import InputError
from moeviz.whatif.ep import EPConfig, Placement, fit_placement, simulate_ep
from moeviz.whatif.eplb import balanced_packing, rebalance_experts, replicate_experts
from moeviz.whatif.routes import Routes
from tests.support.traces import make_routes

# ---------------------------------------------------------------------------------------------------------
# EPLB port


def test_eplb_readme_example_reproduces_exactly():
    # deepseek-ai/EPLB README: 2 layers × 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs.
    weight = np.array(
        [
            [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
            [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
        ]
    )
    phy2log, log2phy, logcnt = rebalance_experts(weight, 16, 4, 2, 8)
    assert phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    # Consistency of the other two outputs with the printed map.
    assert logcnt.tolist() == [np.bincount(row, minlength=12).tolist() for row in phy2log.tolist()]
    assert log2phy.shape == (2, 12, 2)
    for layer in range(2):
        for expert in range(12):
            slots = sorted(int(s) for s in log2phy[layer, expert] if s >= 0)
            assert slots == [p for p in range(16) if phy2log[layer, p] == expert]


def test_balanced_packing_heaviest_first_into_lightest_pack():
    # Order 0(5) 2(4) 3(4) 5(3) 4(2) 1(1): 0→A, 2→B, 3→B (4<5), 5→A (5<8), 4→A (8=8, lowest id), 1→B (A full).
    pack, rank = balanced_packing(np.array([[5.0, 1, 4, 4, 2, 3]]), 2)
    assert pack.tolist() == [[0, 1, 1, 1, 0, 0]]
    assert rank.tolist() == [[0, 2, 0, 1, 2, 1]]


def test_balanced_packing_one_item_per_pack_keeps_ids():
    pack, rank = balanced_packing(np.array([[1.0, 9.0, 5.0]]), 3)
    assert pack.tolist() == [[0, 1, 2]] and rank.tolist() == [[0, 0, 0]]


def test_replicate_experts_gives_each_slot_to_largest_load_per_copy():
    # [6,3,2]: slot 3 → expert 0 (6); now per copy [3,3,2]: slot 4 → expert 0 (tie, lowest id).
    phy2log, rank, logcnt = replicate_experts(np.array([[6.0, 3, 2]]), 5)
    assert phy2log.tolist() == [[0, 1, 2, 0, 0]]
    assert rank.tolist() == [[0, 0, 0, 1, 2]]
    assert logcnt.tolist() == [[3, 1, 1]]


def test_global_policy_when_groups_do_not_divide_nodes():
    # 1 group over 2 nodes → global: one group, one node. Loads [10,1,1,1], P=6, 2 GPUs:
    # replicas: expert 0 gets both extras (10 → 5 → 3.33 per copy). Packing 6 copies [3.3,1,1,1,3.3,3.3]
    # into 2 GPUs of 3: items 0,4,5,1,2,3 → A,B,A,B,B,A. GPU0 = items 0,5,3; GPU1 = items 4,1,2.
    weight = np.array([[10.0, 1, 1, 1]])
    phy2log, _, logcnt = rebalance_experts(weight, 6, 1, 2, 2)
    assert phy2log.tolist() == [[0, 0, 3, 0, 1, 2]]
    assert logcnt.tolist() == [[3, 1, 1, 1]]


# ---------------------------------------------------------------------------------------------------------
# Dispatch bytes, loads, times on a 4-token route (hand-computed)
#   E=4, k=2, G=2, contiguous: experts 0,1 on GPU0, 2,3 on GPU1. Source ranks t·2//4: 0,0,1,1.
#   t0 [0,1] src0 → {GPU0}: 1 local.            t1 [0,2] src0 → {GPU0, GPU1}: 1 local + 1 remote.
#   t2 [2,-1] src1 → {GPU1}: 1 local.           t3 [1,0] src1 → {GPU0}: 1 remote (2 remote pairs).
#   Loads: GPU0 2+1+0+2 = 5, GPU1 0+1+1+0 = 2 → b = 3.5/5. No-dedup remote pairs: 1 + 2 = 3.

TINY = [[0, 1], [0, 2], [2, -1], [1, 0]]
MSG = 256 * 2  # hidden 256 in BF16


def _tiny_config(**kw) -> EPConfig:
    base = dict(gpus=2, gpus_per_node=1, hidden_size=256, nvlink_gbps=1e-6, internode_gbps=1e-6)
    base.update(kw)
    return EPConfig(**base)


def test_tiny_two_nodes_of_one_gpu():
    result = simulate_ep(make_routes([TINY], 4), _tiny_config())
    row = result.layers_frame().iloc[0]
    assert result.gpu_load.tolist() == [[5, 2]]
    assert row.ep_balancedness == pytest.approx(0.7)
    assert row.dispatch_bytes_local == 3 * MSG
    assert row.dispatch_bytes_intra == 0
    assert row.dispatch_bytes_inter == 2 * MSG
    assert row.dispatch_bytes_nodedup == 3 * MSG
    assert row.dispatch_bytes_node_dedup_rdma == 2 * MSG  # t1 → node 1, t3 → node 0
    assert row.combine_bytes == 5 * MSG
    # Each GPU sends one 512-byte message across nodes at 1000 B/s: 0.512 s, × 2 for combine.
    assert row.a2a_time_s == pytest.approx(1.024)
    assert np.isnan(row.comm_share)  # no compute model
    assert result.same_data


def test_tiny_one_node_of_two_gpus():
    row = simulate_ep(make_routes([TINY], 4), _tiny_config(gpus_per_node=2)).layers_frame().iloc[0]
    assert row.dispatch_bytes_local == 3 * MSG
    assert row.dispatch_bytes_intra == 2 * MSG
    assert row.dispatch_bytes_inter == 0
    assert row.dispatch_bytes_nodedup == 3 * MSG
    assert row.dispatch_bytes_node_dedup_rdma == 0
    assert row.a2a_time_s == pytest.approx(1.024)


def test_tiny_round_robin_source_fp8_and_compute_share():
    # Sources t mod 2: 0,1,0,1. t0 local; t1 (src1) local GPU1 + remote GPU0; t2 (src0) remote; t3 remote.
    # Remote pairs: t1 1, t2 1, t3 2 = 4. FP8: 256 + 2·4 = 264 bytes per message.
    config = _tiny_config(
        source="round-robin", message_dtype="fp8", expert_flops_per_token=1e12, gpu_tflops=1
    )
    row = simulate_ep(make_routes([TINY], 4), config).layers_frame().iloc[0]
    fp8 = 264
    assert row.dispatch_bytes_local == 2 * fp8
    assert row.dispatch_bytes_inter == 3 * fp8
    assert row.dispatch_bytes_nodedup == 4 * fp8
    # GPU0 sends t2's message (264 B), GPU1 sends t1's and t3's (528 B): slowest 0.528 s, × 2.
    assert row.a2a_time_s == pytest.approx(1.056)
    assert row.compute_time_s == pytest.approx(5.0)  # busiest GPU: 5 assignments × 1 s
    assert row.comm_share == pytest.approx(1.056 / 6.056)


def test_json_is_plain_and_complete():
    result = simulate_ep(make_routes([TINY] * 2, 4), _tiny_config())
    data = json.loads(json.dumps(result.to_json()))
    assert {
        "model",
        "tokens",
        "placement",
        "ep_balancedness_over_layers",
        "definition",
        "same_data",
        "layers",
        "totals",
    } <= set(data)
    assert data["tokens"] == 4 and data["placement"] == "contiguous"
    assert data["layers"][0]["gpu_load"] == [5, 2]
    assert data["layers"][0]["comm_share"] is None
    assert data["totals"]["dispatch_bytes_inter"] == 2 * 2 * MSG
    assert data["ep_balancedness_over_layers"] == pytest.approx(7 / 10)  # (3.5 + 3.5) / (5 + 5)
    frame = result.gpu_load_frame()
    assert frame.columns.tolist() == ["layer", "gpu", "load"] and len(frame) == 4


# ---------------------------------------------------------------------------------------------------------
# Replica choice
#   E=4, R=2, G=2: slots [0,1,2 | 0,3,1] → expert 0 on GPU0 (copy 0) and GPU1 (copy 1).
#   Every token chooses expert 0 in slot j=0 and expert 2 or 3 in slot 1.


def _replica_case(rule: str) -> np.ndarray:
    routes = make_routes([[[0, 2], [0, 3], [0, 2], [0, 3]]], 4)
    placement = Placement(np.array([[0, 1, 2, 0, 3, 1]]), layers=[0], gpus=2, kind="hand", fitted_on="hand")
    config = EPConfig(gpus=2, gpus_per_node=2, redundant=2, placement="eplb", replica=rule)
    result = simulate_ep(routes, config, placement)
    assert not result.same_data
    return result.gpu_load[0]


def test_vllm_rule_follows_the_slot_when_copies_divide_k():
    # (t·2 + 0) mod 2 = 0 for every token: expert 0 always on GPU0. GPU0: 4 + two expert-2 = 6; GPU1: 2.
    assert _replica_case("vllm").tolist() == [6, 2]


def test_even_rule_spreads_the_copies():
    # Expert 0's i-th token → copy i mod 2: GPU0, GPU1, GPU0, GPU1. GPU0: 2 + 2 = 4; GPU1: 2 + 2 = 4.
    assert _replica_case("even").tolist() == [4, 4]


def test_vllm_rule_spreads_when_copies_do_not_divide_k():
    # E=2, k=2, R=4, G=2: slots [0,0,1 | 0,1,1]. Expert 0 copies at slots 0,1,3 (GPU0,GPU0,GPU1).
    # Tokens [0,1] × 3: expert 0 copy (2t) mod 3 = 0,2,1 → GPU0,GPU1,GPU0.
    # Expert 1 copies at slots 2,4,5 (GPU0,GPU1,GPU1): copy (2t+1) mod 3 = 1,0,2 → GPU1,GPU0,GPU1.
    routes = make_routes([[[0, 1]] * 3], 2)
    placement = Placement(np.array([[0, 0, 1, 0, 1, 1]]), layers=[0], gpus=2, kind="hand", fitted_on="hand")
    config = EPConfig(gpus=2, gpus_per_node=2, redundant=4, placement="eplb", replica="vllm")
    assert simulate_ep(routes, config, placement).gpu_load[0].tolist() == [3, 3]


def test_eplb_fit_loads_by_hand():
    # Counts [10,1,1,1] → phy2log [0,0,3 | 0,1,2] (see test_global_policy...). Even rule over expert 0's
    # copies (slots 0,1,3 = GPU0,GPU0,GPU1): 10 tokens → copies 4,3,3 → GPU0 7, GPU1 3.
    # Plus expert 3 on GPU0 and experts 1, 2 on GPU1: loads [8, 5].
    routes = make_routes([[[0]] * 10 + [[1], [2], [3]]], 4)
    config = EPConfig(gpus=2, gpus_per_node=2, redundant=2, placement="eplb")
    result = simulate_ep(routes, config)
    assert result.placement.phy2log.tolist() == [[0, 0, 3, 0, 1, 2]]
    assert result.gpu_load.tolist() == [[8, 5]]


# ---------------------------------------------------------------------------------------------------------
# Traffic placement


def _blocky_routes(tokens: int, seed: int) -> Routes:
    """E=16 in 4 interleaved blocks {b, b+4, b+8, b+12}: every token picks 2 experts of one block, so the
    contiguous placement (4 experts per GPU: 0-3, 4-7, ...) spreads every block over all GPUs."""
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 4, tokens)
    pick = np.argsort(rng.random((tokens, 4)), axis=1)[:, :2]
    experts = block[:, None] + 4 * pick
    return make_routes([experts], 16, seq=np.repeat(np.arange(8), tokens // 8))


def test_traffic_cuts_inter_node_bytes_out_of_sample_and_stays_balanced():
    fit, evaluate, how = _blocky_routes(4000, seed=1).split()
    assert "sequences" in how
    contiguous = EPConfig(gpus=4, gpus_per_node=2)
    traffic = EPConfig(gpus=4, gpus_per_node=2, placement="traffic")
    placement = fit_placement(fit, traffic)
    # Each GPU holds one whole block: a token's 2 experts share a GPU.
    for gpu in placement.phy2log[0].reshape(4, 4):
        assert len({int(e) % 4 for e in gpu}) == 1
    base = simulate_ep(evaluate, contiguous).layers_frame().iloc[0]
    moved = simulate_ep(evaluate, traffic, placement)
    row = moved.layers_frame().iloc[0]
    # Contiguous: every token's 2 experts are on 2 GPUs; ours: 1 GPU, remote for 3 of 4 sources.
    assert row.dispatch_bytes_inter < 0.7 * base.dispatch_bytes_inter
    assert row.dispatch_bytes_node_dedup_rdma <= base.dispatch_bytes_node_dedup_rdma
    assert not moved.same_data
    assert moved.ep_balancedness_over_layers > 0.85


def test_traffic_respects_balance_slack_in_sample():
    routes = _blocky_routes(4000, seed=2)
    config = EPConfig(gpus=4, gpus_per_node=2, placement="traffic", traffic_slack=0.05)
    load = simulate_ep(routes, config).gpu_load[0]
    assert load.max() <= 1.05 * load.mean() + 1e-9


def test_traffic_with_redundant_slots_places_every_expert():
    routes = _blocky_routes(800, seed=3)
    placement = fit_placement(routes, EPConfig(gpus=4, gpus_per_node=2, redundant=4, placement="traffic"))
    assert placement.phy2log.shape == (1, 20)
    assert set(placement.phy2log[0].tolist()) == set(range(16))


# ---------------------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(gpus=8, gpus_per_node=3), "whole nodes"),
        (dict(gpus=4, gpus_per_node=2, redundant=-4, placement="eplb"), "must be ≥ 0"),
        (dict(gpus=4, gpus_per_node=2, placement="random"), "unknown placement"),
        (dict(gpus=4, gpus_per_node=2, replica="first"), "unknown replica rule"),
        (dict(gpus=4, gpus_per_node=2, redundant=4), "contiguous placement has no redundant"),
        (dict(gpus=4, gpus_per_node=2, message_dtype="fp8", hidden_size=100), "128"),
        (dict(gpus=0, gpus_per_node=1), "≥ 1"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(InputError, match=message):
        EPConfig(**kwargs)


def test_experts_must_split_over_gpus():
    with pytest.raises(InputError, match="do not split evenly over 3 GPUs"):
        simulate_ep(make_routes([TINY], 4), EPConfig(gpus=3, gpus_per_node=1))


def test_placement_for_other_layers_is_refused():
    placement = fit_placement(make_routes([TINY], 4), _tiny_config())
    with pytest.raises(InputError, match="layers"):
        simulate_ep(make_routes([TINY] * 2, 4), _tiny_config(), placement)
