"""The Deployment page (Streamlit AppTest): every tab renders on the default sample, and what it shows is what
`moeviz.whatif` gives directly (in the browser: tests/browser/test_app_browser_deployment.py)."""

from __future__ import annotations

import pandas as pd
import pytest

import moeviz
from moeviz.whatif.ep import EPConfig, simulate_ep
from moeviz.whatif.model_size import expert_flops_per_token, model_size
from moeviz.whatif.quant import quantisation_flips
from moeviz.whatif.routes import routes_from_trace
from tests.support.app import run_page, sample_page_fixtures

MODEL = "sample:mixtral-healthy"
PAGE = "pages/deployment.py"
TABS = ["Expert parallelism", "Offloading", "Capacity", "Quantisation", "Model size"]
TEXT = "The cat sat on the mat because it was warm and the sun was shining on the garden."

_app_env, loaded = sample_page_fixtures(MODEL)


def metric(at, label: str) -> str:
    (found,) = [m for m in at.metric if m.label == label]
    return found.value


def chart_rows(at, title: str) -> pd.DataFrame:
    """The rows of the one chart whose spec contains `title` (Streamlit ships them as Arrow)."""
    import pyarrow as pa

    (chart,) = [c for c in at.get("vega_lite_chart") if title in c.proto.spec]
    (dataset,) = chart.proto.datasets
    return pa.ipc.open_stream(dataset.data.data).read_all().to_pandas()


def test_every_tab_shows_the_librarys_what_if_by_default(loaded) -> None:
    """Each tab on the example prompt with its default settings: its chart holds what `moeviz.whatif` gives
    for those settings (quantisation waits for its button: no chart yet)."""
    from moeviz.whatif.capacity import DEFAULT_CFS, DROP_POLICIES, replay_capacity
    from moeviz.whatif.model_size import expert_bytes
    from moeviz.whatif.offload import POLICIES, hit_rate_curve, simulate_offload
    from moeviz.whatif.quant import FORMATS

    at = run_page(PAGE, model=MODEL)
    assert at.title[0].value == "Deployment what-ifs"
    routes = routes_from_trace(moeviz.capture(loaded, at.session_state["prompt"]))
    experts, k = routes.layers[0].num_experts, routes.layers[0].k
    for tab in TABS:
        at.session_state["deployment_tab"] = tab
        at.run()
        assert not at.exception, (tab, [e.value for e in at.exception])
        assert not at.error, (tab, [e.value for e in at.error])
        assert any("Definition" in c.value for c in at.caption), tab
        if tab == "Expert parallelism":  # 4 GPUs, 2 a node, EPLB (the defaults)
            config = EPConfig(
                gpus=4,
                gpus_per_node=2,
                placement="eplb",
                hidden_size=model_size(loaded.model).hidden_size,
                expert_flops_per_token=expert_flops_per_token(loaded),
            )
            expected = simulate_ep(routes, config).layers_frame()
            shown = chart_rows(at, "Dispatch bytes per layer").pivot(
                index="layer", columns="kind", values="bytes"
            )
            for column, kind in (("dispatch_bytes_local", "local"), ("dispatch_bytes_inter", "inter-node")):
                (label,) = [c for c in shown.columns if c.startswith(kind)]
                assert shown[label].astype(int).tolist() == expected[column].astype(int).tolist(), column
        if tab == "Offloading":  # a cache of 2k experts, every policy; the curve from k to E
            size = expert_bytes(loaded, FORMATS[0])
            metrics = {m.label: m.value for m in at.metric}
            for policy in POLICIES:
                rate = simulate_offload(routes, min(experts, 2 * k), policy, expert_bytes=size).hit_rate
                assert metrics[f"{policy} hit rate"] == f"{rate:.1%}", policy
            curve = hit_rate_curve(routes, tuple(range(k, experts + 1)), policies=tuple(POLICIES))
            shown = chart_rows(at, "Hit rate vs cache size").sort_values(["policy", "cache"])
            expected = curve.sort_values(["policy", "cache"])
            assert shown[["policy", "cache"]].values.tolist() == expected[["policy", "cache"]].values.tolist()
            assert shown["hit_rate"].tolist() == pytest.approx(expected["hit_rate"].tolist())
        if tab == "Capacity":  # the default capacity factors and drop policy, Megatron's rounding
            replay = replay_capacity(routes, tuple(sorted(DEFAULT_CFS)), policy=DROP_POLICIES[0], exact=False)
            shown = chart_rows(at, "Dropped fraction vs capacity factor").sort_values(["layer", "cf"])
            expected = replay.layers_frame().sort_values(["layer", "cf"])
            assert shown["dropped_fraction"].tolist() == pytest.approx(expected["dropped_fraction"].tolist())
        if tab == "Quantisation":
            assert not at.get("vega_lite_chart")  # nothing runs before its button
        if tab == "Model size":  # the sample's parameters first, then the known architectures
            shown = chart_rows(at, "Parameters: total vs active per token")
            total = shown[(shown["name"] == MODEL) & shown["kind"].str.startswith("total")]["params"]
            assert total.astype(int).tolist() == [model_size(loaded.model, name=MODEL).total_params]


def test_the_hit_rate_curve_samples_the_cache_sizes_at_scale() -> None:
    """Every cache size up to CURVE_POINTS of them (the samples: k = 2 of 8); at 256 experts, top-8, 25 sizes
    from k to E instead of 249 replays of every layer."""
    from components.deployment import CURVE_POINTS, curve_caches

    assert curve_caches(2, 8) == tuple(range(2, 9))
    sizes = curve_caches(8, 256)
    assert len(sizes) == CURVE_POINTS and sizes[0] == 8 and sizes[-1] == 256
    assert list(sizes) == sorted(set(sizes))


def test_gpus_change_the_balancedness_to_the_library_value(loaded) -> None:
    at = run_page(PAGE, model=MODEL, prompt=TEXT)
    routes = routes_from_trace(moeviz.capture(loaded, TEXT))
    common = dict(
        gpus_per_node=2,
        placement="eplb",
        hidden_size=model_size(loaded.model).hidden_size,
        expert_flops_per_token=expert_flops_per_token(loaded),
    )
    assert (
        metric(at, "ep_balancedness_over_layers")
        == f"{simulate_ep(routes, EPConfig(gpus=4, **common)).ep_balancedness_over_layers:.3f}"
    )
    at.selectbox(key="ep_gpus").set_value(8).run()
    at.selectbox(key="ep_gpus_per_node").set_value(2).run()
    assert not at.exception and not at.error
    assert (
        metric(at, "ep_balancedness_over_layers")
        == f"{simulate_ep(routes, EPConfig(gpus=8, **common)).ep_balancedness_over_layers:.3f}"
    )


def test_the_quantisation_button_shows_the_library_flip_rates(loaded) -> None:
    at = run_page(PAGE, model=MODEL, prompt=TEXT, deployment_tab="Quantisation")
    at.selectbox(key="quant_dtype").set_value("int4").run()
    at.selectbox(key="quant_target").set_value("router").run()
    at.button(key="quant_run").click().run()
    assert not at.exception and not at.error
    expected = quantisation_flips(loaded, text=TEXT, dtype="int4", target="router").layers_frame()
    (shown,) = [d.value for d in at.dataframe if "flip_rate" in d.value.columns]
    pd.testing.assert_frame_equal(shown.reset_index(drop=True), expected.reset_index(drop=True))
    assert any(c.proto.spec and "flip rate" in c.proto.spec for c in at.get("vega_lite_chart"))
