"""The Learn page (Streamlit AppTest): every step renders, its one control changes the numbers, and the key
numbers equal an independent computation on the same text (torch, numpy and the library's own losses)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from streamlit.testing.v1 import AppTest

import moeviz
from moeviz.analysis import loss_frame
from moeviz.charts import token_options
from tests.support.app import run_page
from tests.support.learn import (  # noqa: F401  (fixtures: pytest finds them in the module)
    BIASED,
    HEALTHY,
    PAGE,
    _app_env,
    chart_rows,
    traces,
    ui,
)


def metric(at: AppTest, label: str) -> str:
    (found,) = [m for m in at.metric if m.label == label]
    return found.value


def notice(at: AppTest) -> str:
    (line,) = [i.value for i in at.info if "What to notice" in i.value]
    return line


def softmax_topk(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(p, chosen ids, renormalised weights) of one token's logits, in torch."""
    p = torch.softmax(torch.tensor(logits, dtype=torch.float32), dim=-1)
    top = torch.topk(p, k)
    return p.numpy(), top.indices.numpy(), (top.values / top.values.sum()).numpy()


# The chart each step draws on its defaults; its numbers are checked against the library by the step's own
# test below (test_router_step_…, test_top_k_step_…, …); the deployment step draws none.
STEP_CHARTS = {
    "router": "Token 0:",
    "top_k": "Top-2: the first",
    "load": "Expert load, MoE layer 0",
    "aux": "Terms E·f_e·P_e, MoE layer 0",
    "collapse": "Load per expert, MoE layer",  # opens where the three differ most
    "bias": "Load with and without the bias, MoE layer",  # opens where the bias matters most
    "shared": "each expert processes, layer 1",
    "finetune": "New-domain loss",  # its numbers: tests/app/test_app_learn_finetune.py
    "deployment": None,
}


def test_every_step_renders_with_its_what_to_notice_line() -> None:
    at = run_page(PAGE)
    assert at.title[0].value.startswith("Learn")
    steps = at.segmented_control(key="learn_step_widget").options
    assert len(steps) >= 8
    for step in STEP_CHARTS:
        at.session_state["learn_step"] = step
        at.run()
        assert not at.exception, (step, [e.value for e in at.exception])
        assert not at.error, (step, [e.value for e in at.error])
        assert notice(at), step
        if STEP_CHARTS[step] is None:
            assert not at.get("vega_lite_chart"), step
        else:
            chart_rows(at, STEP_CHARTS[step])  # the step's chart, read as its own test reads it
    at.button(key="learn_prev").click().run()
    assert at.session_state["learn_step"] == "finetune"
    assert at.segmented_control(key="learn_step_widget").value == "finetune"
    at.button(key="learn_next").click().run()
    assert at.session_state["learn_step"] == "deployment"
    at.session_state["learn_step"] = "router"
    at.run()
    at.button(key="learn_prev").click().run()  # before the first step: stays there
    assert at.session_state["learn_step"] == "router"


def test_router_step_is_softmax_then_top_k_renormalised(traces) -> None:
    trace = traces[HEALTHY]
    routing = trace.layers[0]
    labels = list(token_options(trace.tokens))
    at = run_page(PAGE, learn_step="router")
    seen = []
    for row in (0, 7):
        if row:
            at.selectbox(key="learn_token_widget").set_value(labels[row]).run()
        rows = chart_rows(at, f"Token {labels[row]} at MoE layer").sort_values("expert")
        p, chosen, weights = softmax_topk(routing.logits[row], routing.k)
        np.testing.assert_allclose(rows["logit"], routing.logits[row], atol=1e-6)
        np.testing.assert_allclose(rows["score"], p, atol=1e-6)
        assert set(rows.loc[rows["chosen"], "expert"]) == set(chosen.tolist())
        np.testing.assert_allclose(rows.set_index("expert").loc[chosen, "weight"], weights, atol=1e-6)
        np.testing.assert_allclose(
            rows.set_index("expert").loc[chosen, "weight"], routing.weights[row], atol=1e-3
        )
        seen.append(rows["score"].to_numpy())
    assert not np.allclose(*seen)  # the token control changed the numbers


def test_top_k_step_reroutes_the_captured_scores(traces) -> None:
    routing = traces[HEALTHY].layers[0]
    at = run_page(PAGE, learn_step="top_k")
    loads = {}
    for k in (2, 1):
        if k == 1:
            at.segmented_control(key="learn_k_widget").set_value(1).run()
        weights = chart_rows(at, f"Top-{k}: the first").sort_values(["pos", "rank"])
        for pos, token in weights.groupby("pos"):
            _, chosen, expected = softmax_topk(routing.logits[pos], k)
            assert token["expert"].tolist() == chosen.tolist()
            np.testing.assert_allclose(token["weight"], expected, atol=1e-6)
        load = chart_rows(at, f"Load with top-{k}")
        load = load[load["expert"] >= 0].sort_values("expert")
        top = torch.topk(torch.softmax(torch.tensor(routing.logits), -1), k).indices.numpy()
        np.testing.assert_array_equal(load["count"], np.bincount(top.ravel(), minlength=routing.num_experts))
        loads[k] = load["count"].sum()
    assert loads[2] == 2 * loads[1]


def test_load_step_counts_the_dispatched_experts(traces) -> None:
    trace = traces[HEALTHY]
    at = run_page(PAGE, learn_step="load")
    for layer in (0, 2):
        if layer:
            at.select_slider(key="learn_load_layer_widget").set_value(str(layer)).run()
        routing = trace.layer(layer)
        counts = np.bincount(routing.experts.ravel(), minlength=routing.num_experts)
        load = chart_rows(at, f"Expert load, MoE layer {layer}")
        np.testing.assert_array_equal(load.sort_values("expert")["count"], counts)
        assert metric(at, "Busiest expert") == f"{counts.max() / routing.experts.size:.1%}"
        assert metric(at, "Fair share 1/E") == f"{1 / routing.num_experts:.1%}"
        # normalised, as everywhere (the Lab once showed nats beside it): H(c/Σc) / log E
        share = counts[counts > 0] / counts.sum()
        normalised = -(share * np.log(share)).sum() / np.log(routing.num_experts)
        assert metric(at, "Load entropy") == f"{normalised:.3f}"


def test_aux_loss_step_equals_the_library_loss(traces) -> None:
    losses = loss_frame(traces[HEALTHY]).set_index("layer")
    at = run_page(PAGE, learn_step="aux")
    values = []
    for layer in (0, 3):
        if layer:
            at.select_slider(key="learn_aux_layer_widget").set_value(str(layer)).run()
        value = metric(at, "Aux loss L, top-k form")
        assert value == f"{losses.loc[layer, 'aux_loss_topk']:.4f}"
        terms = chart_rows(at, f"Terms E·f_e·P_e, MoE layer {layer}")
        assert terms["term"].sum() == pytest.approx(losses.loc[layer, "aux_loss_topk"], abs=1e-6)
        routing = traces[HEALTHY].layer(layer)
        p = torch.softmax(torch.tensor(routing.logits), -1)
        f = np.bincount(torch.topk(p, routing.k).indices.numpy().ravel(), minlength=8) / len(p)
        np.testing.assert_allclose(terms.sort_values("expert")["f"], f, atol=1e-9)
        assert metric(at, "Balanced value") == str(routing.k)
        values.append(value)
    assert values[0] != values[1]


def test_collapse_step_shows_the_three_samples_on_one_text(traces, ui) -> None:
    at = run_page(PAGE, learn_step="collapse", learn_collapse_layer="0")
    for layer in (0, 1):
        if layer:
            at.select_slider(key="learn_collapse_layer_widget").set_value(str(layer)).run()
        load = chart_rows(at, f"Load per expert, MoE layer {layer}")
        assert list(dict.fromkeys(load["model"])) == list(ui.COLLAPSE_SAMPLES)
        for name, source in ui.COLLAPSE_SAMPLES.items():
            routing = traces[source].layer(layer)
            share = np.bincount(routing.experts.ravel(), minlength=8) / routing.experts.size
            np.testing.assert_allclose(load[load["model"] == name].sort_values("expert")["share"], share)


def unbiased_recount(routing) -> tuple[int, np.ndarray]:
    """Tokens whose expert set changes when the bias is removed, recounted in numpy: DeepSeek-V3's choice
    (best `topk_group` groups by the sum of their two best, then the top k) on sigmoid(logits) + bias and on
    sigmoid(logits) alone."""
    scores = 1 / (1 + np.exp(-routing.logits.astype(np.float64)))

    def choose(selection):
        n, e = selection.shape
        grouped = selection.reshape(n, routing.n_group, e // routing.n_group)
        group_score = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)
        best = np.argsort(-group_score, axis=1)[:, : routing.topk_group]
        keep = np.zeros_like(group_score, dtype=bool)
        np.put_along_axis(keep, best, True, axis=1)
        masked = np.where(np.repeat(keep, e // routing.n_group, axis=1), selection, -np.inf)
        return np.sort(np.argsort(-masked, axis=1)[:, : routing.k], axis=1)

    biased, plain = choose(scores + routing.bias), choose(scores)
    np.testing.assert_array_equal(biased, np.sort(routing.experts, axis=1))  # the recount is the model's rule
    return int((biased != plain).any(axis=1).sum()), plain


def test_bias_step_counts_the_tokens_the_bias_moves(traces) -> None:
    trace = traces[BIASED]
    at = run_page(PAGE, learn_step="bias", learn_bias_layer="1")
    counts = []
    for layer in (1, 3):
        if layer != 1:
            at.select_slider(key="learn_bias_layer_widget").set_value(str(layer)).run()
        routing = trace.layer(layer)
        changed, plain = unbiased_recount(routing)
        assert metric(at, "Tokens that change experts") == f"{changed} of {len(routing.logits)}"
        load = chart_rows(at, f"Load with and without the bias, MoE layer {layer}")
        without = load[load["routing"] == "without the bias"].sort_values("expert")["count"]
        np.testing.assert_array_equal(without, np.bincount(plain.ravel(), minlength=routing.num_experts))
        counts.append(changed)
    assert counts[0] > 0 and counts[0] != counts[1]


def test_shared_step_shows_the_always_on_expert(traces) -> None:
    config = moeviz.load_model(BIASED).model.config
    at = run_page(PAGE, learn_step="shared")
    shares = []
    for layer in (1, 2):
        if layer != 1:
            at.select_slider(key="learn_shared_layer_widget").set_value(str(layer)).run()
        routing = traces[BIASED].layer(layer)
        rows = chart_rows(at, f"each expert processes, layer {layer}")
        assert rows.iloc[0]["expert"] == "shared" and rows.iloc[0]["share"] == 1.0
        routed = rows[rows["kind"] == "routed"]
        counts = np.bincount(routing.experts.ravel(), minlength=routing.num_experts)
        np.testing.assert_allclose(routed["share"], counts / len(routing.logits))
        shares.append(routed["share"].to_numpy())
    assert metric(at, "Shared experts") == str(config.n_shared_experts)
    shared = config.n_shared_experts * config.moe_intermediate_size
    routed = config.num_experts_per_tok * config.moe_intermediate_size
    assert metric(at, "Shared share of weights") == f"{shared / (shared + routed):.0%}"
    assert not np.allclose(*shares)


def test_deployment_step_links_and_counts_parameters() -> None:
    model = moeviz.load_model(BIASED).model
    at = run_page(PAGE, learn_step="deployment")
    assert metric(at, "Parameters to hold") == f"{sum(p.numel() for p in model.parameters()):,}"
    links = [link.proto.page for link in at.get("page_link")]
    assert any("deployment" in link for link in links), links


def test_the_experts_sweep_step_appears_with_its_table(tmp_path, monkeypatch, ui) -> None:
    sweep = pd.DataFrame({"experts": [1, 8, 16, 1, 8, 16], "k": [1, 1, 1, 2, 2, 2]})
    sweep["heldout_loss"] = [3.1, 2.8, 2.75, 3.0, 2.7, 2.72]
    sweep.to_csv(tmp_path / "experts-sweep.csv", index=False)
    monkeypatch.setattr(ui, "SWEEP", tmp_path / "experts-sweep.csv")
    at = run_page(PAGE, learn_step="sweep")
    assert "2.700" in notice(at)
    rows = chart_rows(at, "Held-out loss vs number of experts")
    assert len(rows) == 6
    assert any("How many" in str(option) for option in at.segmented_control(key="learn_step_widget").options)
    monkeypatch.setattr(ui, "SWEEP", tmp_path / "missing.csv")
    at.run()
    assert not any(
        "How many" in str(option) for option in at.segmented_control(key="learn_step_widget").options
    )
