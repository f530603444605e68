"""The what-if libraries bound what they are given before they allocate or loop on it: capacity factors
finite, positive and counted once, the capacity C clamped to T·k (a huge CF no longer overflows int64 into
"every slot dropped"), position buckets at most the tokens, redundant slots at most E·(G − 1) and
P = E + R ≤ 65,536 (≤ 512 for `traffic`), link and compute rates finite and > 0; and EP needs only
(E + R) % G == 0, so 8 experts + 8 slots run on 16 GPUs, one slot each (checked against EPLB's greedy
worked by hand)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moeviz.errors import InputError
from moeviz.whatif.capacity import replay_capacity
from moeviz.whatif.ep import MAX_SLOTS, TRAFFIC_MAX_SLOTS, EPConfig, fit_placement, simulate_ep
from moeviz.whatif.eplb import rebalance_experts
from moeviz.whatif.offload import simulate_offload
from moeviz.whatif.routes import Routes
from tests.support.traces import make_routes, random_sets

EXPERTS, K = 8, 2
LENGTHS = (5, 9, 2)  # three sequences: one dispatch group each


def routes_of(seed: int = 0) -> Routes:
    rng = np.random.default_rng(seed)
    n = sum(LENGTHS)
    experts = random_sets(rng, n, EXPERTS, K, p=np.arange(EXPERTS, 0, -1) / 36)  # skewed: drops at CF 1
    weights = rng.random((n, K)).astype(np.float32)
    seq = np.repeat(np.arange(len(LENGTHS)), LENGTHS)
    return make_routes([experts, experts[::-1]], EXPERTS, weights=[weights, weights], seq=seq)


# ---- capacity ---------------------------------------------------------------------------------------------
def test_a_huge_cf_keeps_every_slot_and_c_is_at_most_t_k() -> None:
    routes = routes_of()
    got = replay_capacity(routes, [1.0, 1e19]).layers_frame()
    huge = got[got.cf == 1e19]
    assert (huge.dropped == 0).all() and (huge.dropped_fraction == 0).all()
    # C per group is clamped to T·k: the largest group is the longest sequence
    assert (huge.capacity == max(LENGTHS) * K).all() and (huge.capacity_min == min(LENGTHS) * K).all()
    assert (got[got.cf == 1.0].dropped > 0).any()  # the routing does overflow at CF 1: the test has teeth
    every = replay_capacity(routes, [1e19], policy="position", exact=True).layers_frame()
    assert (every.dropped == 0).all() and (every.tokens_all_dropped == 0).all()


@pytest.mark.parametrize("bad", [math.inf, math.nan, -math.inf, 0.0])
def test_a_non_finite_or_non_positive_cf_is_refused(bad) -> None:
    with pytest.raises(InputError, match=r"capacity factor must be a finite positive number"):
        replay_capacity(routes_of(), [1.0, bad])


def test_a_repeated_cf_is_replayed_once() -> None:
    routes = routes_of()
    twice = replay_capacity(routes, [1.5, 1.0, 1.5, 1.0])
    once = replay_capacity(routes, [1.5, 1.0])
    for frame in ("layers_frame", "experts_frame", "position_frame"):
        a, b = getattr(twice, frame)(), getattr(once, frame)()
        assert a.equals(b), frame
    assert sorted(twice.layers_frame().cf) == sorted([1.0, 1.5] * len(routes.layers))


def test_position_buckets_are_bounded_by_the_tokens() -> None:
    routes = routes_of()
    tokens = sum(LENGTHS)
    assert len(replay_capacity(routes, [1.0], buckets=tokens).position_frame()) == tokens
    for bad in (tokens + 1, 10**12, 0):
        with pytest.raises(InputError, match=rf"--buckets\) must be between 1 and {tokens}"):
            replay_capacity(routes, [1.0], buckets=bad)
    short = make_routes([np.array([[0, 1], [2, 3]])], 4, seq=[0, 0])  # 2 tokens: the default 10 stands
    assert len(replay_capacity(short).position_frame()) == 4 * 10


# ---- expert parallelism -----------------------------------------------------------------------------------
def test_redundant_slots_are_bounded_by_e_times_g_minus_one() -> None:
    routes = routes_of()
    most = EXPERTS * (4 - 1)
    ok = simulate_ep(routes, EPConfig(gpus=4, gpus_per_node=2, redundant=most, placement="eplb"))
    assert ok.placement.phy2log.shape == (2, EXPERTS * 4)
    for redundant in (most + 4, 10**12):
        config = EPConfig(gpus=4, gpus_per_node=2, redundant=redundant, placement="eplb")
        with pytest.raises(InputError, match=rf"--redundant\) {redundant:,} exceed E·\(G − 1\) = 8·3 = 24"):
            simulate_ep(routes, config)
    with pytest.raises(InputError, match=r"exceed E·G = 8·4 = 32"):
        rebalance_experts(np.ones((1, EXPERTS)), 36, 1, 1, 4)


def test_any_placement_takes_at_most_65536_slots() -> None:
    experts, gpus = 8, 16_384  # E·(G − 1) = 131,064 would admit more: the fixed cap decides
    at_bound = EPConfig(gpus=gpus, gpus_per_node=8, redundant=MAX_SLOTS - experts, placement="eplb")
    at_bound.check_fit(experts)
    over = EPConfig(gpus=gpus, gpus_per_node=8, redundant=81_920 - experts, placement="eplb")
    with pytest.raises(InputError, match=r"make 81,920 slots; a placement takes at most 65,536"):
        simulate_ep(make_routes([np.arange(experts)[:, None]], experts), over)


def test_traffic_takes_at_most_512_slots() -> None:
    experts, gpus = 8, 128  # E·(G − 1) = 1016 allows more than 512 slots: the traffic bound decides
    at_bound = EPConfig(
        gpus=gpus, gpus_per_node=8, redundant=TRAFFIC_MAX_SLOTS - experts, placement="traffic"
    )
    at_bound.check_fit(experts)  # accepted (fitting 512 slots takes seconds: not run here)
    routes = make_routes([np.arange(experts)[:, None]], experts)
    over = EPConfig(gpus=gpus, gpus_per_node=8, redundant=640 - experts, placement="traffic")
    with pytest.raises(InputError, match=r"traffic refines 640 slots .* at most 512 \(--redundant ≤ 504"):
        simulate_ep(routes, over)
    eplb = simulate_ep(
        routes, EPConfig(gpus=gpus, gpus_per_node=8, redundant=640 - experts, placement="eplb")
    )
    assert eplb.placement.phy2log.shape == (1, 640)  # eplb is linear in P: the E·(G − 1) bound is enough


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("nvlink_gbps", math.nan, r"NVLink bandwidth \(--nvlink-gbps, GB/s\) must be a finite number > 0"),
        ("internode_gbps", math.inf, r"inter-node bandwidth \(--internode-gbps, GB/s\) must be a finite"),
        ("gpu_tflops", math.nan, r"GPU throughput \(--gpu-tflops, TFLOP/s\) must be a finite number > 0"),
        ("gpu_tflops", 0.0, r"must be a finite number > 0, got 0.0"),
        ("expert_flops_per_token", math.nan, r"expert FLOPs per token must be a finite number ≥ 0"),
        ("traffic_slack", math.inf, r"traffic slack must be a finite number ≥ 0"),
    ],
)
def test_rates_must_be_finite(field, value, message) -> None:
    with pytest.raises(InputError, match=message):
        EPConfig(gpus=4, gpus_per_node=2, **{field: value})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(bandwidth_gbps=math.nan),
            r"bandwidth \(--bandwidth\) must be a finite number > 0 GB/s, got nan",
        ),
        (dict(bandwidth_gbps=math.inf), r"must be a finite number > 0 GB/s, got inf"),
        (dict(step_time_s=math.nan), r"step time \(--step-time\) must be a finite number ≥ 0 s, got nan"),
    ],
)
def test_offload_rates_must_be_finite(kwargs, message) -> None:
    with pytest.raises(InputError, match=message):
        simulate_offload(routes_of(), 4, "lru", expert_bytes=1, **kwargs)


def test_eight_experts_and_eight_slots_run_on_sixteen_gpus_one_slot_each() -> None:
    # Expert e chosen by 8 − e tokens (k = 1): loads [8, 7, …, 1]. EPLB's replicate_experts gives each of
    # the 8 extra slots to the largest load per copy (lowest id on ties): e0 (8 → 4), e1 (7 → 3.5), e2
    # (6 → 3), e3 (5 → 2.5), e0 (4, tie with e4 → 8/3), e4 (4 → 2), e1 (3.5 → 7/3), e2 (3, tie with e5).
    # Copies [3, 3, 3, 2, 2, 1, 1, 1]; one slot per GPU, so a GPU's load is its copy's share under the
    # `even` rule: e0 3,3,2; e1 3,2,2; e2 2,2,2; e3 3,2; e4 2,2; e5 3; e6 2; e7 1.
    experts = np.repeat(np.arange(8), np.arange(8, 0, -1))[:, None]
    routes = make_routes([experts], 8)
    config = EPConfig(gpus=16, gpus_per_node=8, redundant=8, placement="eplb")
    placement = fit_placement(routes, config)
    assert placement.slots_per_gpu == 1 and placement.phy2log.shape == (1, 16)
    assert np.bincount(placement.phy2log[0], minlength=8).tolist() == [3, 3, 3, 2, 2, 1, 1, 1]
    load = simulate_ep(routes, config).gpu_load[0]
    assert sorted(load.tolist()) == sorted([3, 3, 2, 3, 2, 2, 2, 2, 2, 3, 2, 2, 2, 3, 2, 1])
    traffic = simulate_ep(routes, EPConfig(gpus=16, gpus_per_node=8, redundant=8, placement="traffic"))
    assert traffic.placement.slots_per_gpu == 1 and int(traffic.gpu_load.sum()) == 36
    with pytest.raises(InputError, match="8 experts \\+ 4 redundant slots do not split evenly over 16 GPUs"):
        simulate_ep(routes, EPConfig(gpus=16, gpus_per_node=8, redundant=4, placement="eplb"))
