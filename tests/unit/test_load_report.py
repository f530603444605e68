"""Routing without router scores in the report, the verdicts and the EP what-if: a load table of an engine's
expert counts (`ExpertLoad`, no tokens) and a trace imported without logits (`has_logits` False). Balance
numbers against hand computations, the verdict of a collapsed table, null score-based keys in the JSON,
and EP loads from counts equal to the per-token simulation's."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import numpy as np
import pytest

from moeviz.analysis.balance import load_balance_frame, load_device_load, load_expert_balance_frame
from moeviz.analysis.collapse import Verdict, load_collapse_report
from moeviz.cli.report import report_json, report_markdown, report_text
from moeviz.errors import InputError
from moeviz.report import BIAS_KEYS, LAYER_KEYS, SCORE_KEYS, build_report
from moeviz.trace import ExpertLoad, ModelInfo
from moeviz.trace.records import absent
from moeviz.whatif.ep import EPConfig, gpu_load_from_counts, simulate_ep, simulate_ep_load, split_load_steps
from tests.support.traces import make_layer, make_routes, make_trace, random_sets

INFO = ModelInfo(source="engine-model", model_type="test", architecture="test", num_layers=2)


def _load(counts, top_k: int = 2, source: str = "sglang-dump", layers=None) -> ExpertLoad:
    counts = np.asarray(counts, dtype=np.int64)
    layers = list(range(counts.shape[1])) if layers is None else layers
    return ExpertLoad(model=INFO, counts=counts, layers=layers, top_k=top_k, source=source)


# ---- balance from counts: hand computations ----------------------------------------------------------------
def test_balance_numbers_of_a_load_table_by_hand():
    # layer 0 summed over two steps: c = [5, 3, 2, 0], Σc = 10 slots, k = 2 → T = 5 tokens
    load = _load([[[3, 2, 1, 0], [2, 2, 2, 2]], [[2, 1, 1, 0], [2, 2, 2, 2]]])
    frame = load_balance_frame(load, devices=2)
    row = frame.iloc[0]
    assert (row["layer"], row["site"], row["tokens"], row["experts"], row["top_k"]) == (0, "mlp", 5, 4, 2)
    assert row["dropped"] == 0 and row["dropped_fraction"] == 0.0
    assert row["max_share"] == 0.5  # 5 / (k·T = 10)
    assert row["dead_experts"] == 1 and row["dead_fraction"] == 0.25
    assert row["max_vio"] == pytest.approx(5 / 2.5 - 1)
    assert row["cv"] == pytest.approx(math.sqrt((2.5**2 + 0.5**2 + 0.5**2 + 2.5**2) / 4) / 2.5)
    assert row["gini"] == pytest.approx(16 / 40)  # Σ (2i − E − 1) c_(i) = −2 + 3 + 15 over E Σc
    assert row["jain"] == pytest.approx(100 / (4 * 38))
    entropy = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))
    assert row["load_entropy"] == pytest.approx(entropy / math.log(4))
    assert row["min_utilisation"] == 0.0 and row["max_utilisation"] == pytest.approx(2.0)  # c / (kT/E)
    assert row["ep_balancedness"] == pytest.approx(5 / 8)  # devices [5+3, 2+0]: mean 5, max 8
    even = frame.iloc[1]  # [4, 4, 4, 4]: T = 8
    assert even["tokens"] == 8 and even["cv"] == 0.0 and even["load_entropy"] == 1.0 and even["jain"] == 1.0
    experts = load_expert_balance_frame(load, devices=2)
    assert experts[experts.layer == 0]["share"].tolist() == [0.5, 0.3, 0.2, 0.0]
    assert experts[experts.layer == 0]["device"].tolist() == [0, 0, 1, 1]
    np.testing.assert_array_equal(load_device_load(load, 2), [[8, 2], [8, 8]])


def test_the_load_report_equals_the_trace_report_on_the_same_routing():
    """The counts of a trace's routing give bitwise the trace report's load keys."""
    rng = np.random.default_rng(0)
    layers = [random_sets(rng, 60, 8, 2) for _ in range(3)]
    trace = make_trace(layers, 8, seq_lengths=[60])
    counts = np.stack([np.bincount(ids.ravel(), minlength=8) for ids in layers])[None]
    load = _load(counts)
    want, got = build_report(trace, devices=4), build_report(load, devices=4)
    load_keys = [k for k in LAYER_KEYS if k not in SCORE_KEYS + BIAS_KEYS + ["reasons", "status", "verdict"]]
    for key in [*load_keys, "ep_balancedness"]:
        np.testing.assert_array_equal(got.layers[key].to_numpy(), want.layers[key].to_numpy(), err_msg=key)
    assert got.ep_balancedness_over_layers == want.ep_balancedness_over_layers
    assert got.tokens == 60


# ---- verdicts ---------------------------------------------------------------------------------------------
def test_a_collapsed_count_table_is_judged_collapsed():
    counts = np.zeros((1, 2, 8), np.int64)
    counts[0, :, :2] = 400  # 400 tokens, every one on experts 0 and 1
    report = load_collapse_report(_load(counts))
    assert report.verdict == Verdict.COLLAPSED and report.judged
    assert all("6 of 8 experts received no token" in lv.reasons[0] for lv in report.layers)
    assert all(math.isnan(lv.z_loss) and lv.bias is None for lv in report.layers)
    healthy = np.full((1, 2, 8), 100, np.int64)  # 400 tokens spread evenly
    assert load_collapse_report(_load(healthy)).verdict == Verdict.HEALTHY


def test_steps_that_are_sequences_count_as_correlated_tokens():
    """One sequence of 400 tokens counts as 400 / (1 + 399 ρ) ≈ 4 independent tokens (ρ = 0.25), as a
    trace's sequence does; without sequences its tokens are independent."""
    counts = np.zeros((1, 1, 8), np.int64)
    counts[0, 0, :2] = 400
    independent = load_collapse_report(_load(counts, layers=[3])).layers[0]
    correlated = load_collapse_report(_load(counts, layers=[3]), steps_are_sequences=True).layers[0]
    assert independent.load_test.effective_tokens == 400
    assert correlated.load_test.effective_tokens == pytest.approx(400 / (1 + 399 * 0.25))
    assert any("one expert (e0) took 50%" in r for r in independent.reasons)
    assert any(n.startswith("not significant: one expert (e0) took 50%") for n in correlated.notes)
    report = build_report(
        _load(counts, source="moe-infinity", layers=[3])
    )  # MoE-Infinity: steps are sequences
    assert report.collapse.layers[0].load_test.effective_tokens == correlated.load_test.effective_tokens
    assert any("each step is one sequence" in note for note in report.notes)
    other = build_report(_load(counts, layers=[3]))
    assert any("take its tokens as independent" in note for note in other.notes)


# ---- the report's shape and its nulls ----------------------------------------------------------------------
def test_score_based_keys_are_null_in_the_json_and_named_in_the_notes():
    counts = np.zeros((1, 2, 8), np.int64)
    counts[0, :, :2] = 400
    report = build_report(_load(counts), devices=2)
    out = json.loads(report_json(report))
    assert out["verdict"] == "collapsed" and out["tokens"] == 400
    for row in out["layers"]:
        assert list(row)[: len(LAYER_KEYS)] == LAYER_KEYS
        assert all(row[key] is None for key in SCORE_KEYS + BIAS_KEYS), row
        assert row["dead_fraction"] == 0.75 and row["max_share"] == 0.5 and row["ep_balancedness"] == 0.5
    assert out["ep_balancedness_over_layers"] == 0.5
    assert any("need router scores and are null" in note and "aux_loss_topk" in note for note in out["notes"])
    text = report_text(report)
    assert "verdict: COLLAPSED" in text and "note: a load table of sglang-dump" in text
    assert "- note: a load table" in report_markdown(report)
    with pytest.raises(ValueError, match="no sequences to give domains to"):
        build_report(_load(counts), seq_domains=["a"])


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_a_trace_without_logits_gives_nan_losses_without_warnings(score_fn):
    rng = np.random.default_rng(1)
    layers = []
    for i in range(2):
        ids = random_sets(rng, 300, 8, 2)
        layer = make_layer(ids, 8, layer=i, score_fn=score_fn)
        layers.append(
            dataclasses.replace(
                layer, logits=absent(300, 8), weights=absent(300, 2), has_logits=False, has_weights=False
            )
        )
    layers[1] = dataclasses.replace(layers[1], experts=np.tile([0, 1], (300, 1)))  # layer 1 collapsed
    trace = make_trace(layers, seq_lengths=[30] * 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = build_report(trace)
    assert report.layers[SCORE_KEYS].isna().all().all()  # sigmoid's NaN scores must not become uniform
    assert report.layers["load_entropy"].notna().all()
    assert report.verdict == "collapsed" and report.layers["verdict"].tolist()[1] == "collapsed"
    assert report.notes and "router logits absent in every MoE layer" in report.notes[0]
    out = json.loads(report_json(report))
    assert all(row["z_loss"] is None and row["seq_aux_loss"] is None for row in out["layers"])


def test_a_captured_trace_has_no_notes():
    trace = make_trace([random_sets(np.random.default_rng(2), 40, 8, 2)], 8)
    report = build_report(trace)
    assert report.notes == () and json.loads(report_json(report))["notes"] == []
    assert report.layers[SCORE_KEYS].notna().all().all()


# ---- expert parallelism from counts ------------------------------------------------------------------------
def test_gpu_loads_from_counts_split_replicas_as_the_even_rule():
    # expert 0 has copies in slots 0 and 3 (GPU 0 and 1): its 7 assignments split 4 / 3
    phy2log = np.array([0, 1, 2, 0])
    np.testing.assert_array_equal(gpu_load_from_counts(np.array([7, 2, 5]), phy2log, 2), [4 + 2, 5 + 3])


@pytest.mark.parametrize(("placement", "redundant"), [("contiguous", 0), ("eplb", 4)])
def test_ep_from_counts_equals_the_per_token_simulation(placement, redundant):
    rng = np.random.default_rng(3)
    layers = [random_sets(rng, 200, 16, 2, p=rng.uniform(0.2, 5.0, 16)) for _ in range(3)]  # uneven load
    routes = make_routes(layers, 16, n_group=4)
    config = EPConfig(gpus=4, gpus_per_node=2, redundant=redundant, placement=placement)
    want = simulate_ep(routes, config)
    counts = np.stack([np.bincount(ids.ravel(), minlength=16) for ids in layers])[None]
    got = simulate_ep_load(_load(counts), config, groups=4)
    np.testing.assert_array_equal(got.gpu_load, want.gpu_load)
    np.testing.assert_array_equal(got.placement.phy2log, want.placement.phy2log)
    assert got.ep_balancedness_over_layers == want.ep_balancedness_over_layers
    frame = got.layers_frame()
    assert frame["dispatch_bytes_inter"].isna().all() and frame["a2a_time_s"].isna().all()
    payload = got.to_json()
    assert payload["layers"][0]["combine_bytes"] is None and payload["totals"]["comm_share"] is None


def test_what_needs_tokens_is_refused_for_counts():
    load = _load(np.full((2, 1, 8), 5))
    with pytest.raises(InputError, match=r"placement traffic .* needs per-token expert sets"):
        simulate_ep_load(load, EPConfig(gpus=2, gpus_per_node=2, placement="traffic"))
    with pytest.raises(InputError, match="replica rule vllm picks a copy by each token's slot"):
        simulate_ep_load(
            load, EPConfig(gpus=2, gpus_per_node=2, placement="eplb", redundant=2, replica="vllm")
        )
    fit, rest, how = split_load_steps(load, 0.5, order="ordered")
    assert (fit.steps, rest.steps, how) == (
        ["0"],
        ["1"],
        "fitted on 1 of 2 steps of the load table in order (the first ones), evaluated on the other 1",
    )
    with pytest.raises(InputError, match="one step cannot be split"):
        split_load_steps(_load(np.full((1, 1, 8), 5)), 0.5)
