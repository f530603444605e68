"""The Deployment page (Streamlit AppTest): with the evaluation corpus on, every tab
runs on the corpus (quantisation and prefetch included); the capacity tab's free CFs, dispatch group and
smallest-CF readout; the EP tab's named random split and inter-node bytes; the size table in GiB beside its
GiB input; the hit-rate curve's bytes. Each is compared with `moeviz.whatif` called here on the same input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import moeviz
from moeviz.samples import eval_batch
from moeviz.whatif.capacity import replay_capacity, smallest_cf
from moeviz.whatif.ep import EPConfig, fit_placement, simulate_ep
from moeviz.whatif.model_size import expert_flops_per_token, model_size
from moeviz.whatif.offload import hit_rate_curve
from moeviz.whatif.prefetch import prefetch_recall
from moeviz.whatif.quant import quantisation_flips
from moeviz.whatif.routes import routes_from_trace
from tests.support.app import corpus_trace, run_page, sample_page_fixtures

MODEL = "sample:mixtral-healthy"
PAGE = "pages/deployment.py"
TEXT = "The cat sat on the mat because it was warm and the sun was shining on the garden."

_app_env, loaded = sample_page_fixtures(MODEL)


@pytest.fixture(scope="module")
def corpus_routes():
    return routes_from_trace(corpus_trace(MODEL))


def chart_rows(at, title: str) -> pd.DataFrame:
    """The rows of the one chart whose spec contains `title`."""
    import pyarrow as pa

    (chart,) = [c for c in at.get("vega_lite_chart") if title in c.proto.spec]
    (dataset,) = chart.proto.datasets
    return pa.ipc.open_stream(dataset.data.data).read_all().to_pandas()


def ok(at) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def test_every_tab_uses_the_corpus_when_the_header_says_corpus(loaded, corpus_routes) -> None:
    """Corpus on: the header names the corpus; capacity replays it; quantisation and the prefetch recall run
    its sequences (the library on the corpus's token ids gives the same frames) and their captions say so."""
    ids = [list(map(int, seq)) for seq in eval_batch(loaded).token_ids]
    at = run_page(PAGE, timeout_s=300, model=MODEL, use_corpus=True, deployment_tab="Capacity")
    assert any(f"{corpus_routes.tokens} tokens in {len(ids)} sequence(s)" in c.value for c in at.caption)
    shown = chart_rows(at, "Dropped fraction vs capacity factor").sort_values(["layer", "cf"])
    expected = (
        replay_capacity(corpus_routes, (1.0, 1.25, 1.5, 2.0)).layers_frame().sort_values(["layer", "cf"])
    )
    assert shown["dropped_fraction"].tolist() == pytest.approx(expected["dropped_fraction"].tolist())

    at.session_state["deployment_tab"] = "Quantisation"
    at.run()
    assert any("Run the evaluation corpus (40 sequences" in c.value for c in at.caption)
    at.button(key="quant_run").click().run()
    ok(at)
    want = quantisation_flips(loaded, token_ids=ids, dtype="int8", target="experts")
    (flips,) = [d.value for d in at.dataframe if "flip_rate" in d.value.columns]
    pd.testing.assert_frame_equal(flips.reset_index(drop=True), want.layers_frame().reset_index(drop=True))
    assert int(flips["tokens"].iloc[0]) == corpus_routes.tokens

    at.session_state["deployment_tab"] = "Offloading"
    at.run()
    assert any("Runs the model on the evaluation corpus" in c.value for c in at.caption)
    at.button(key="prefetch_run").click().run()
    ok(at)
    (recall,) = [d.value for d in at.dataframe if "recall" in d.value.columns]
    pd.testing.assert_frame_equal(recall.reset_index(drop=True), prefetch_recall(loaded, token_ids=ids))
    assert set(recall["tokens"]) == {corpus_routes.tokens}


def test_a_routing_file_or_a_store_run_says_why_the_model_runs_the_prompt(loaded) -> None:
    """A routing file or a store run holds routing, not text to run: quantisation and prefetch run the prompt
    (or the corpus) and say so; on the prompt itself nothing needs saying."""
    from components.deployment import rerun_input
    from components.page_input import MODEL as ON_MODEL
    from components.page_input import PageInput

    trace = moeviz.capture(loaded, TEXT)
    prompt = PageInput(ON_MODEL, (MODEL, TEXT), trace, "the prompt")
    file = PageInput("path", ("file", "routing.parquet"), trace, "routing.parquet")
    assert rerun_input(prompt, TEXT, stored=False).note == ""
    assert (
        rerun_input(file, TEXT, stored=False).note
        == "It runs the model, so it uses the prompt, not the routing file."
    )
    stored = rerun_input(prompt, TEXT, stored=True)
    assert stored.kwargs == {"text": TEXT} and "not the store run" in stored.note


def test_capacity_free_cfs_a_batch_group_and_the_smallest_cf_readout(loaded) -> None:
    """A typed CF (5) is replayed beside the presets; a dispatch group of 8 tokens replays as the library's
    group_tokens=8; the readout is `smallest_cf` for the chosen share, group and rounding."""
    at = run_page(PAGE, model=MODEL, prompt=TEXT, deployment_tab="Capacity")
    routes = routes_from_trace(moeviz.capture(loaded, TEXT))
    (readout,) = [i.value for i in at.info if "smallest CF" in i.value]
    assert readout == smallest_cf(routes, 0.01).readout
    at.multiselect(key="capacity_cfs").set_value([1.0, "5"]).run()
    at.radio(key="capacity_group").set_value("a batch of N tokens").run()
    at.number_input(key="capacity_group_tokens").set_value(8).run()
    at.number_input(key="capacity_max_drop").set_value(5.0).run()
    ok(at)
    shown = chart_rows(at, "Dropped fraction vs capacity factor").sort_values(["layer", "cf"])
    expected = replay_capacity(routes, (1.0, 5.0), group_tokens=8).layers_frame().sort_values(["layer", "cf"])
    assert shown["cf"].tolist() == expected["cf"].tolist()
    assert shown["dropped_fraction"].tolist() == pytest.approx(expected["dropped_fraction"].tolist())
    (readout,) = [i.value for i in at.info if "smallest CF" in i.value]
    assert readout == smallest_cf(routes, 0.05, group_tokens=8).readout
    assert "a batch of 8 consecutive tokens" in readout
    assert any("a batch of 8 consecutive tokens" in c.value for c in at.caption)  # the definition line


def test_fit_on_one_part_names_its_random_split_and_inter_node_bytes_head_the_tab(
    loaded, corpus_routes
) -> None:
    """Corpus on, Fit on one part: the placement is fitted on half the sequences drawn with seed 0 (not the
    first domains), the caption names that split, and the Inter-node bytes metric is the library's on the
    evaluation half; the time model's caption says it has no per-message latency."""
    at = run_page(PAGE, timeout_s=300, model=MODEL, use_corpus=True)
    at.toggle(key="ep_fit_on_part").set_value(True).run()
    ok(at)
    fit, rest, how = corpus_routes.split(0.5)
    assert "drawn at random (seed 0)" in how and np.unique(fit.layers[0].seq).tolist() != list(range(20))
    assert any(how in c.value and c.value.startswith("Split:") for c in at.caption)
    config = EPConfig(
        gpus=4,
        gpus_per_node=2,
        placement="eplb",
        hidden_size=model_size(loaded.model).hidden_size,
        expert_flops_per_token=expert_flops_per_token(loaded),
    )
    after = simulate_ep(rest, config, fit_placement(fit, config)).totals()
    before = simulate_ep(rest, EPConfig(**{**config.__dict__, "placement": "contiguous"})).totals()
    (inter,) = [m for m in at.metric if m.label == "Inter-node bytes"]
    assert inter.value == f"{after['dispatch_bytes_inter']:,}"
    assert f"contiguous: {before['dispatch_bytes_inter']:,}" in inter.proto.delta
    assert any("no per-message latency" in c.value for c in at.caption)


def test_the_size_table_shows_gib_beside_the_gib_input() -> None:
    """Every byte column of the size table on screen is its downloaded bytes ÷ 2³⁰, labelled GiB."""
    from components.deployment import known_sizes, size_table

    at = run_page(PAGE, model=MODEL, deployment_tab="Model size")
    (shown,) = [d.value for d in at.dataframe if "total_params" in d.value.columns]
    (element,) = [d for d in at.dataframe if "total_params" in d.value.columns]
    exact = size_table(known_sizes(), ("bf16", "fp8", "int8", "int4"), "bf16", 32_768, 1, 80.0)
    byte_columns = [c for c in shown.columns if c.startswith(("bytes_", "kv_bytes"))]
    assert byte_columns
    for name in byte_columns:
        assert shown[name].iloc[1:].tolist() == pytest.approx((exact[name] / 2**30).tolist())
    assert all(f"{name} (GiB)" in element.proto.columns for name in byte_columns)


def test_the_hit_rate_curve_csv_holds_bytes_not_misses(loaded) -> None:
    """The curve the Offloading tab downloads: bytes = misses × one expert's bytes at the tab's format."""
    from components import deployment

    from moeviz.whatif.model_size import expert_bytes

    routes = routes_from_trace(moeviz.capture(loaded, TEXT))
    size = int(expert_bytes(loaded, "bf16"))
    curve = deployment.offload_curve(MODEL, TEXT, routes, (2, 4, 8), ("lru", "belady"), size)
    assert size > 1 and curve["bytes"].tolist() == (curve["misses"] * size).tolist()
    library = hit_rate_curve(routes, (2, 4, 8), policies=("lru", "belady"), expert_bytes=size)
    pd.testing.assert_frame_equal(curve, library)
