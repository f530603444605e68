"""Every "Reproduce in Python" snippet (`moeviz.snippets`) runs as printed against the bundled samples and
gives the numbers its view shows: the same frames the page computes, checked against the page's own calls and
against counts by hand. A snippet naming a function or argument that does not exist fails here."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import moeviz
from moeviz import snippets
from moeviz.snippets import SnippetError, SnippetInput

MODEL = "sample:mixtral-healthy"
TEXT = (
    "def mean(values):\n    return sum(values) / len(values)\nAt the end of two full years, Pharaoh dreamed."
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def trace():
    """The prompt captured as the app captures it (what the pages compute from)."""
    return moeviz.capture(moeviz.load_model(MODEL), TEXT)


def run(code: str) -> dict:
    """Execute a snippet as a user would (a fresh namespace); → its names."""
    namespace: dict = {"__name__": "__snippet__"}
    exec(compile(code, "<snippet>", "exec"), namespace)
    return namespace


def source() -> SnippetInput:
    return SnippetInput(MODEL, text=TEXT)


def same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))


def test_routing_view_gives_the_pages_layer_load_and_token(trace):
    from moeviz.analysis import confidence_frame, expert_balance_frame

    names = run(snippets.routing_view(source(), 2, "mlp", token=(0, 5)))
    every = expert_balance_frame(trace)  # the page's frames: every layer, then the layer chosen
    same(names["load"], every[(every["site"] == "mlp") & (every["layer"] == 2)])
    routing = trace.layer(2, "mlp")  # by hand: slots per expert
    counts = np.bincount(routing.experts[routing.experts >= 0].ravel(), minlength=routing.num_experts)
    assert names["load"].sort_values("expert")["count"].tolist() == counts.tolist()
    conf = confidence_frame(trace)
    same(names["confidence"], conf[(conf["seq"] == 0) & (conf["pos"] == 5)])
    assert names["scores"]["expert"].nunique() == routing.num_experts


def test_load_view_gives_the_pages_frames_and_verdict(trace):
    from moeviz.analysis import CollapseThresholds, balance_frame, collapse_frame, collapse_report

    names = run(snippets.load_view(source(), "max_share"))
    same(names["balance"], balance_frame(trace))
    report = collapse_report(trace, CollapseThresholds())
    same(names["verdicts"], collapse_frame(report))
    assert names["report"].verdict == report.verdict
    experts = names["experts"]  # max share by hand: the busiest expert's share of the layer's slots
    for (_, layer), rows in experts.groupby(["site", "layer"]):
        shown = names["balance"].set_index("layer").loc[layer, "max_share"]
        assert shown == pytest.approx(rows["count"].max() / rows["count"].sum())


def test_structure_view_matches_the_pages_calls(trace):
    from moeviz.analysis import layer_coactivation_frame, path_frame, repetition_frame, transition_frame
    from moeviz.analysis.structure import path_layer_ids, path_window

    names = run(snippets.structure_view(source(), 1, "mlp", adjacent_only=True, top1=True, path_layers=2))
    same(names["coactivation"], layer_coactivation_frame(trace, 1, "mlp", adjacent_only=True))
    same(names["transitions"], transition_frame(trace, True))
    window = path_window(path_layer_ids(trace, "mlp"), 1, 2)
    same(names["paths"], path_frame(trace, top_n=15, layers=window, site="mlp"))
    same(names["repetition"], repetition_frame(trace))
    assert names["paths"]["share"].sum() <= 1 + 1e-9


def test_attention_view_gives_the_map_and_the_kv_whatif():
    from moeviz.charts import attention_block_frame
    from moeviz.whatif.kv_cache import kv_cache_whatif

    code = snippets.attention_view(
        source(), 1, 0, window=8, rows=range(4, 12), cols=range(0, 8), scale="log", keep_last=6, keep_first=2
    )
    names = run(code)
    att = moeviz.capture(moeviz.load_model(MODEL), TEXT, attention=True).attention
    tokens = names["trace"].tokens
    block = att.block(1, 0, 0, rows=list(range(4, 12)), cols=list(range(8)))
    same(names["cells"], attention_block_frame(block, range(4, 12), range(8), tokens))
    same(names["heads"], att.head_summary(8))
    same(names["whatif"], kv_cache_whatif(att, 6, 2))


def test_why_view_runs_the_attribution_and_the_whatif(trace):
    from moeviz.interventions import DisableExpert, counterfactual

    routing = trace.layer(1, "mlp")
    expert = int(routing.experts[6, 0])
    code = snippets.why_view(source(), 6, 1, "mlp", expert, steps=16, intervention="disable_layer")
    names = run(code)
    assert names["attribution"].value == pytest.approx(float(routing.scores[6, expert]), abs=1e-4)
    ids = [int(i) for i in trace.tokens["token_id"]]
    spec = DisableExpert(expert=expert, layer=1, site="mlp")
    expected = counterfactual(moeviz.load_model(MODEL), token_ids=ids, interventions=[spec])
    same(names["positions"], expected.position_frame())


def test_compare_view_matches_the_page(trace):
    from moeviz.analysis import expert_drift_frame, routing_agreement_frame

    names = run(snippets.compare_view(MODEL, "sample:mixtral-unbalanced", TEXT))
    other = moeviz.capture(moeviz.load_model("sample:mixtral-unbalanced"), TEXT)
    same(names["agreement"], routing_agreement_frame(trace, other))
    same(names["drift"], expert_drift_frame(trace, other))


def test_engines_view_diffs_two_dtypes():
    from moeviz.analysis.engine_diff import engine_diff

    a = SnippetInput(MODEL, text=TEXT, load_kwargs={"dtype": "bfloat16"})
    b = SnippetInput(MODEL, text=TEXT, load_kwargs={"dtype": "float32"})
    names = run(snippets.engines_view(a, b))
    expected = engine_diff(
        moeviz.capture(moeviz.load_model(MODEL, dtype="bfloat16"), TEXT),
        moeviz.capture(moeviz.load_model(MODEL, dtype="float32"), TEXT),
    )
    assert (names["diff"].mismatched, names["diff"].pairs) == (expected.mismatched, expected.pairs)


def test_deployment_views_replay_what_the_tabs_replay(trace):
    from moeviz.whatif.capacity import replay_capacity, smallest_cf
    from moeviz.whatif.ep import EPConfig, fit_placement, simulate_ep
    from moeviz.whatif.model_size import expert_bytes, model_size
    from moeviz.whatif.offload import simulate_offload
    from moeviz.whatif.routes import routes_from_trace

    routes = routes_from_trace(trace)
    config = EPConfig(gpus=4, gpus_per_node=2, redundant=4, placement="eplb")
    names = run(
        snippets.ep_view(source(), {"gpus": 4, "gpus_per_node": 2, "redundant": 4, "placement": "eplb"})
    )
    assert names["totals"] == simulate_ep(routes, config).totals()
    names = run(snippets.ep_view(source(), {"gpus": 4, "gpus_per_node": 2}, True, "ordered"))
    fit, rest, _ = routes.split(0.5, order="ordered")
    plain = EPConfig(gpus=4, gpus_per_node=2)
    assert names["totals"] == simulate_ep(rest, plain, fit_placement(fit, plain)).totals()

    names = run(snippets.offload_view(source(), 3, ["lru", "lfu"], "bf16", 32.0))
    size = expert_bytes(moeviz.load_model(MODEL), "bf16")
    for policy in ("lru", "lfu"):
        expected = simulate_offload(routes, 3, policy, expert_bytes=size, bandwidth_gbps=32.0)
        same(names["results"][policy].layers_frame(), expected.layers_frame())

    names = run(snippets.capacity_view(source(), [0.5, 1.0], "probs", True, None, 0.01))
    same(names["layers"], replay_capacity(routes, [0.5, 1.0], policy="probs", exact=True).layers_frame())
    assert names["search"].cf == smallest_cf(routes, 0.01, exact=True).cf

    names = run(snippets.size_view(MODEL))
    assert names["size"] == model_size(moeviz.load_model(MODEL).model, name=MODEL)


def test_quantisation_view_matches_the_tab():
    from moeviz.whatif.quant import quantisation_flips

    names = run(snippets.quantisation_view(source(), "int8", "router"))
    expected = quantisation_flips(moeviz.load_model(MODEL), text=TEXT, dtype="int8", target="router")
    same(names["flips"], expected.layers_frame())


def test_checkpoints_and_corpus_views_read_one_store(tmp_path):
    from moeviz.models.loading import sample_models_dir
    from moeviz.store import StoreQuery

    series = sample_models_dir() / "mixtral-healthy-series"
    pair = f"{series / 'step-00100'},{series / 'step-01000'}"
    names = run(snippets.checkpoints_view(pair, windows=1, window_tokens=64, kind="top1"))
    timeline = names["timeline"]
    assert timeline.checkpoints == ["step-00100", "step-01000"]
    final = timeline.saturation[timeline.saturation["checkpoint"] == "step-01000"]
    assert np.allclose(final.filter(like="top1").to_numpy(dtype=float), 1.0)  # the final agrees with itself

    store, name = names["store"], names["name"]
    code = snippets.corpus_view(store, name, "step-01000", layers=[1], indicator="gini")
    corpus = run(code)
    query = StoreQuery(store, model=name, checkpoint="step-01000", layer=[1], validate=False)
    same(corpus["load"], query.expert_balance())
    same(corpus["verdicts"], query.collapse())
    assert set(corpus["load"]["layer"]) == {1}


@pytest.mark.parametrize("step", snippets.LEARN_STEPS)
def test_learn_steps(step):
    from moeviz.analysis import balance_stats
    from moeviz.analysis.lesson import bias_effect, router_walkthrough
    from moeviz.analysis.reroute import aux_terms

    model = "sample:deepseek-v3-bias" if step in ("bias", "shared", "deployment") else MODEL
    models = {"healthy": MODEL, "collapsed": "sample:mixtral-collapsed"}
    if step == "sweep":
        pytest.importorskip("moeviz.resources")
    code = snippets.learn_view(step, TEXT, model, layer=1, k=1, token=(0, 4), models=models)
    if step == "sweep":  # a file of the checkout (docs/), read where the app reads it
        assert "experts-sweep.csv" in code
        return
    names = run(code)
    trace = moeviz.capture(moeviz.load_model(model), TEXT)
    routing = trace.layer(1, "mlp")
    if step == "router":
        same(names["walk"], router_walkthrough(routing, 4))
    elif step == "load":
        expected = balance_stats(routing)
        assert (names["stats"].load_entropy, names["stats"].max_share) == (
            expected.load_entropy,
            expected.max_share,
        )
    elif step == "aux":
        same(names["terms"], aux_terms(routing))
    elif step == "bias":
        assert names["changed"] == bias_effect(routing)[0].changed_tokens
    elif step == "collapse":
        assert names["stats"]["healthy"].load_entropy == balance_stats(routing).load_entropy
    elif step == "top_k":
        assert names["stats"].top_k == 1


def test_a_wrong_call_fails(trace):
    """The guard the tests above rely on: a snippet naming a function or argument that does not exist
    raises when run."""
    code = snippets.load_view(source())
    with pytest.raises(ImportError):
        run(code.replace("balance_frame, collapse_report", "balance_frames, collapse_report"))
    with pytest.raises(TypeError):
        run(snippets.capacity_view(source(), [1.0], "probs", True).replace("policy=", "drop_policy="))


def test_inputs_no_snippet_reproduces():
    with pytest.raises(SnippetError, match="prompt"):
        snippets.why_view(SnippetInput(MODEL, corpus=True), 1, 1, "mlp", 0)
    with pytest.raises(SnippetError, match="unknown Learn step"):
        snippets.learn_view("nope", TEXT, MODEL)
    with pytest.raises(SnippetError, match="intervention"):
        snippets.why_view(source(), 1, 1, "mlp", 0, intervention="explode")


def test_text_is_quoted_not_spliced():
    """A prompt with quotes and newlines stays one string literal (repr), never code."""
    evil = "x'); import os; os.system('echo pwned'); ('\n\"\"\""
    code = snippets.routing_view(SnippetInput(MODEL, text=evil), 0, "mlp")
    line = next(line for line in code.splitlines() if line.startswith("trace = "))
    assert line == f"trace = moeviz.capture(loaded, {evil!r})"
