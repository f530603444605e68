"""Routing files as the pages' input (Streamlit AppTest): a moeviz routing file chosen once (a path inside the
allowed store folders, or an upload) is what Routing, Load & collapse, Structure, Deployment and About the
model show.

- An engine import without router logits (the sample's own expert ids written as `routed_trace` writes an
  import): every page renders it, its counts are the sample capture's, its verdicts and EP balancedness the
  library's on the same file, and each page says in one caption what needs router scores; ids in id order
  (Megatron) take the top-1 views away with a caption; unknown token ids show as ⟨?⟩.
- A load table (an engine's expert counts, `ExpertLoad`): Load & collapse shows `load_balance_frame` and
  `load_collapse_report`, Deployment's EP tab `simulate_ep_load`; every other page says in one line that it
  needs per-token routing.
- A path outside `MOEVIZ_STORE_DIRS` is refused; the choice holds across pages; pages that run the model say
  so; a DeepSeek-V3-shaped import (256 experts × 58 MoE layers) renders on the four routing pages.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

import moeviz
from moeviz.analysis import (
    AUX_LOSS_FORMS,
    balance_frame,
    collapse_frame,
    collapse_report,
    layer_coactivation_frame,
    transition_frame,
)
from moeviz.analysis.balance import load_balance_frame, load_expert_balance_frame
from moeviz.analysis.collapse import load_collapse_report
from moeviz.architecture import layer_facts_frame
from moeviz.engines.layout import routing_layout
from moeviz.engines.routed import RoutedSequence, routed_trace
from moeviz.trace import ExpertLoad, read_routing_file
from moeviz.whatif.ep import EPConfig, simulate_ep, simulate_ep_load
from moeviz.whatif.routes import routes_from_trace
from tests.support.app import APP, app_test_env, run_page
from tests.support.scale_models import SHAPES
from tests.support.traces import load_table_collapsing_layer_0

MODEL = "sample:mixtral-healthy"  # the sidebar's default: 8 experts, top-2, 4 MoE layers
UNRANKED_MODEL = "sample:deepseek-v3-bias"  # 16 experts, top-4, layer 0 dense
TEXT = (
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list)."
)
SCORES = "need router scores"
TOKENS_NEEDED = "is a load table (expert counts per layer, no tokens): this page needs"
# the EP tab's first view: 4 GPUs (of 1, 2, 4, 8), 2 per node, EPLB, no redundant slot
EP_DEFAULTS = dict(gpus=4, gpus_per_node=2, redundant=0, placement="eplb")
TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def _app_env(monkeypatch, tmp_path):
    app_test_env(monkeypatch)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Routing files in one folder: `imported` (the mixtral sample's routing of TEXT as a vLLM import
    writes it: ids and token ids, no logits, no weights), `unranked` (the deepseek sample's, each token's ids
    in ascending order as Megatron writes them), `no_ids` (the mixtral routing without token ids) and `load`
    (an expert-count table for the mixtral sample: every token of layer 0 goes to expert 0); `captured`: the
    capture the imports were written from."""
    folder = tmp_path_factory.mktemp("routing-files")
    captured = moeviz.capture(moeviz.load_model(MODEL), TEXT)
    experts = np.stack([r.experts for r in captured.layers], axis=1).astype(np.int32)  # [T, L, k]
    ids = captured.tokens["token_id"].to_numpy()
    layout = routing_layout(MODEL)
    paths = {"folder": folder, "captured": captured}
    imported = routed_trace(layout, [RoutedSequence(experts.copy(), ids)], source="vllm-routed")
    paths["imported"] = imported.to_parquet(folder / "imported.parquet")
    no_ids = routed_trace(layout, [RoutedSequence(experts.copy(), None)], source="sglang-routed")
    paths["no_ids"] = no_ids.to_parquet(folder / "no-ids.parquet")
    other = moeviz.capture(moeviz.load_model(UNRANKED_MODEL), TEXT)
    sorted_ids = np.sort(np.stack([r.experts for r in other.layers], axis=1).astype(np.int32), axis=2)
    unranked = routed_trace(
        routing_layout(UNRANKED_MODEL),
        [RoutedSequence(sorted_ids, other.tokens["token_id"].to_numpy())],
        source="megatron-trace",
        ranked=False,
    )
    paths["unranked"] = unranked.to_parquet(folder / "unranked.parquet")
    paths["load"] = load_table_collapsing_layer_0(layout).to_parquet(folder / "load.parquet")
    return paths


def file_state(path) -> dict:
    """The session of a page whose input is the routing file at `path`."""
    return {"page_input": "path", "page_input_path": str(path)}


def on_file(page: str, path, monkeypatch, **state) -> AppTest:
    """`page` run on the routing file at `path` (its folder the allowed store folder); asserts no exception
    and no error."""
    monkeypatch.setenv("MOEVIZ_STORE_DIRS", str(path.parent))
    return run_page(f"pages/{page}.py", timeout_s=TIMEOUT_S, **file_state(path), **state)


def captions(at) -> str:
    return " ".join(c.value for c in at.caption)


def frame_with(at, *columns: str):
    """The one dataframe on the page holding `columns`."""
    (found,) = [d.value for d in at.dataframe if set(columns) <= set(d.value.columns)]
    return found


def chart_rows(at, title: str):
    """The rows of the one chart whose spec contains `title` (Streamlit ships them as Arrow)."""
    (chart,) = [c for c in at.get("vega_lite_chart") if title in c.proto.spec]
    (dataset,) = chart.proto.datasets
    return pa.ipc.open_stream(dataset.data.data).read_all().to_pandas()


def assert_frames_equal(shown, expected, columns) -> None:
    assert len(shown) == len(expected)
    for column in columns:
        want, got = expected[column].to_numpy(), shown[column].to_numpy()
        if np.issubdtype(want.dtype, np.number):
            np.testing.assert_allclose(got.astype(float), want.astype(float), rtol=1e-9, err_msg=column)
        else:
            assert got.tolist() == want.tolist(), column


BALANCE = ["layer", "tokens", "load_entropy", "max_share", "dead_experts", "cv", "gini", "jain"]
VERDICTS = ["layer", "verdict", "status", "p_dead", "p_max_share", "p_entropy"]


# ---- (a) an imported per-token trace without router logits ------------------------------------------------
def test_load_and_collapse_of_an_import_is_the_captures_load_and_the_librarys_verdicts(files, monkeypatch):
    at = on_file("load", files["imported"], monkeypatch)
    trace = read_routing_file(files["imported"])
    assert not any(r.has_logits for r in trace.layers)
    # the counts are the capture's (the import holds the same expert ids), computed apart from the app
    assert_frames_equal(frame_with(at, *BALANCE), balance_frame(files["captured"]), BALANCE)
    report = collapse_report(trace)
    assert_frames_equal(frame_with(at, "verdict", "status"), collapse_frame(report), VERDICTS)
    assert f"Model verdict: **{report.verdict.name.lower()}**" in " ".join(m.value for m in at.markdown)
    assert f"the balancing losses and z-loss {SCORES}, which vllm-routed does not record" in captions(at)
    losses = set(AUX_LOSS_FORMS)
    assert not [d for d in at.dataframe if losses & set(d.value.columns)]  # no losses of NaN probabilities
    assert "imported.parquet (vllm-routed)" in captions(at)


def test_routing_of_an_import_draws_the_dispatch_and_names_what_needs_scores(files, monkeypatch):
    at = on_file("routing", files["imported"], monkeypatch)
    text = captions(at)
    assert f"the token's scores, margins and confidence {SCORES}" in text
    assert "Filled with ● = expert the token was dispatched to" in text
    summary = balance_frame(files["captured"]).iloc[0]  # layer 0, the first on show
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Load entropy"] == f"{summary['load_entropy']:.2f}"
    assert metrics["Dead experts"] == str(int(summary["dead_experts"]))
    heatmap = chart_rows(at, '"text": "Dispatch"')
    dispatched = heatmap[heatmap["dispatched"]].sort_values(["row", "expert"])
    routing = files["captured"].layers[0]
    want = sorted((row, int(e)) for row, slots in enumerate(routing.experts) for e in slots if e >= 0)
    assert list(zip(dispatched["row"], dispatched["expert"], strict=True)) == want
    assert not [c for c in at.get("vega_lite_chart") if "Router scores" in c.proto.spec]
    # the token drill-down: its experts, no scores; their table built once opened
    assert not at.dataframe
    at.session_state["token_routing_table"] = True
    at.run()
    (path,) = [d.value for d in at.dataframe if list(d.value.columns) == ["layer", "rank", "expert"]]
    assert len(path) == len(files["captured"].layers) * routing.k


def test_ids_in_id_order_lose_the_top1_views_with_a_caption(files, monkeypatch):
    at = on_file("structure", files["unranked"], monkeypatch, model=UNRANKED_MODEL)
    assert "top-1 repetition need ranked slots: megatron-trace lists each token's experts in id order" in (
        captions(at)
    )
    assert not [t for t in at.toggle if t.label in ("Top-1 only", "Rank-adjacent pairs only")]
    assert at.radio(key="repetition_kind").options == ["share ≥ 1 expert"]
    routing = run_page(
        "pages/routing.py", timeout_s=TIMEOUT_S, model=UNRANKED_MODEL, **file_state(files["unranked"])
    )
    assert "the token strip (top-1 expert) and the top-1 line of the token's path need ranked slots" in (
        captions(routing)
    )
    assert not [c for c in routing.get("vega_lite_chart") if "Tokens by top-1 expert" in c.proto.spec]


def test_unknown_token_ids_show_as_a_question_mark(files, monkeypatch):
    at = on_file("routing", files["no_ids"], monkeypatch)
    strip = chart_rows(at, "Tokens by top-1 expert")
    assert set(strip["token"]) == {"⟨?⟩"}
    assert len(strip) == len(files["captured"].tokens)


def test_structure_of_an_import_counts_as_the_capture(files, monkeypatch):
    at = on_file("structure", files["imported"], monkeypatch)
    assert "imported.parquet (vllm-routed)" in captions(at)
    assert "Not shown" not in captions(at)  # every view of the dispatch is drawn (the ids are ranked)
    shown = chart_rows(at, "Co-activation, layer 0")  # the diagonal left out
    want = layer_coactivation_frame(files["captured"], 0, "mlp")
    merged = shown.merge(want, on=["expert", "co_expert"], suffixes=("", "_want"))
    assert len(merged) == len(shown) == 8 * 7
    assert merged["pair_count"].tolist() == merged["pair_count_want"].tolist()
    transitions = chart_rows(at, "next_expert").query("layer == 0").sort_values(["expert", "next_expert"])
    want = transition_frame(files["captured"]).query("layer == 0").sort_values(["expert", "next_expert"])
    assert transitions["count"].tolist() == want["count"].tolist()


def test_deployment_replays_an_import_as_the_library(files, monkeypatch):
    at = on_file("deployment", files["imported"], monkeypatch)
    routes = routes_from_trace(read_routing_file(files["imported"]))
    result = simulate_ep(routes, EPConfig(**EP_DEFAULTS))
    (shown,) = [m.value for m in at.metric if m.label == "ep_balancedness_over_layers"]
    assert shown == f"{result.ep_balancedness_over_layers:.3f}"
    layers = frame_with(at, "ep_balancedness", "max_gpu_load")
    np.testing.assert_allclose(layers["ep_balancedness"], result.layers_frame()["ep_balancedness"])
    capacity = on_file("deployment", files["imported"], monkeypatch, deployment_tab="Capacity")
    assert capacity.selectbox(key="capacity_policy").options == ["position"]  # no weights to keep by


def test_about_lists_what_the_file_records(files, monkeypatch):
    at = on_file("about", files["imported"], monkeypatch)
    table = frame_with(at, "decision_source", "router_scores")
    facts = layer_facts_frame(read_routing_file(files["imported"]))
    assert table["layer"].tolist() == facts["layer"].tolist()
    assert set(table["decision_source"]) == {"vllm-routed"}
    assert not table["router_scores"].any() and not table["weights"].any() and table["ranked"].all()
    assert {m.label: m.value for m in at.metric}["Routed experts"] == "8"


def test_pages_that_run_the_model_say_they_use_the_prompt(files, monkeypatch):
    at = on_file("attention", files["imported"], monkeypatch)
    assert "Attention runs the model on text, so it uses the prompt below, not the routing file" in (
        captions(at)
    )


def test_the_choice_holds_across_pages(files, monkeypatch):
    at = on_file("load", files["imported"], monkeypatch)
    at.switch_page("pages/structure.py").run(timeout=TIMEOUT_S)
    assert not at.exception, [e.value for e in at.exception]
    assert "imported.parquet (vllm-routed)" in captions(at)
    assert at.radio(key="page_input_widget").value == "path"


# ---- (b) a load table --------------------------------------------------------------------------------------
def test_load_and_collapse_of_a_load_table_are_the_librarys(files, monkeypatch):
    at = on_file("load", files["load"], monkeypatch)
    load = ExpertLoad.from_parquet(files["load"])
    assert_frames_equal(frame_with(at, *BALANCE), load_balance_frame(load), BALANCE)
    report = load_collapse_report(load)
    assert_frames_equal(frame_with(at, "verdict", "status"), collapse_frame(report), VERDICTS)
    assert report.layers[0].verdict.name != "HEALTHY"  # the table was built so that layer 0 is flagged
    assert f"Model verdict: **{report.verdict.name.lower()}**" in " ".join(m.value for m in at.markdown)
    text = captions(at)
    assert "A load table counts each layer's experts without tokens" in text
    assert "balancing losses and z-loss need each token's router scores" in text
    heatmap = chart_rows(at, "Load per layer and expert").sort_values(["layer", "expert"])
    experts = load_expert_balance_frame(load).sort_values(["layer", "expert"])
    assert heatmap["count"].tolist() == experts["count"].tolist() == load.layer_counts().reshape(-1).tolist()
    np.testing.assert_allclose(heatmap["utilisation"], experts["utilisation"])


def test_a_load_table_upload_is_read_too(files, monkeypatch):
    data = files["load"].read_bytes()
    at = run_page(
        "pages/load.py",
        page_input="upload",
        page_input_upload_kept=("load.parquet", data),
        timeout_s=TIMEOUT_S,
    )
    load = ExpertLoad.from_parquet(files["load"])
    assert_frames_equal(frame_with(at, *BALANCE), load_balance_frame(load), BALANCE)


def test_the_ep_tab_replays_a_load_table_as_the_library(files, monkeypatch):
    at = on_file("deployment", files["load"], monkeypatch)
    load = ExpertLoad.from_parquet(files["load"])
    result = simulate_ep_load(load, EPConfig(**EP_DEFAULTS), groups=1)  # the mixtral sample has no groups
    (shown,) = [m.value for m in at.metric if m.label == "ep_balancedness_over_layers"]
    assert shown == f"{result.ep_balancedness_over_layers:.3f}"
    layers = frame_with(at, "ep_balancedness", "max_gpu_load")
    np.testing.assert_allclose(layers["ep_balancedness"], result.layers_frame()["ep_balancedness"])
    assert layers["max_gpu_load"].tolist() == result.layers_frame()["max_gpu_load"].tolist()
    for tab in ("Offloading", "Capacity"):
        other = on_file("deployment", files["load"], monkeypatch, deployment_tab=tab)
        assert any(
            "needs each token's experts: a load table has expert counts only" in i.value for i in other.info
        )


@pytest.mark.parametrize("page", ["routing", "structure", "about"])
def test_pages_that_need_tokens_say_so_in_one_line(files, monkeypatch, page):
    at = on_file(page, files["load"], monkeypatch)
    (line,) = [i.value for i in at.info]
    assert f"load.parquet (sglang-dump expert counts) {TOKENS_NEEDED}" in line
    assert not at.get("vega_lite_chart") and not at.dataframe


# ---- (c) the allowlist -------------------------------------------------------------------------------------
def test_a_path_outside_the_allowed_folders_is_refused(files, tmp_path, monkeypatch):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    monkeypatch.setenv("MOEVIZ_STORE_DIRS", str(allowed))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    for key, value in file_state(files["imported"]).items():
        at.session_state[key] = value
    at.switch_page("pages/load.py").run()
    assert not at.exception, [e.value for e in at.exception]
    outside = files["imported"].resolve()
    assert [e.value for e in at.error] == [
        f"{outside} is outside the store folders this server may open: {allowed.resolve()}"
    ]
    assert not at.dataframe  # nothing of the file was read


# ---- at scale ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepseek_v3_import(tmp_path_factory):
    """A DeepSeek-V3-shaped routing (256 experts, top-8 of 8 groups, 58 MoE layers of 61, 1,024 tokens) as an
    engine import writes it: the model's config alone (no weights), ids without logits or weights."""
    from transformers import DeepseekV3Config

    from moeviz.testing.scale_traces import shaped_trace

    folder = tmp_path_factory.mktemp("deepseek-v3")
    DeepseekV3Config(**SHAPES["deepseek-v3"]).save_pretrained(folder / "model")
    source = shaped_trace("deepseek_v3", num_tokens=1024)
    experts = np.stack([r.experts for r in source.layers], axis=1).astype(np.int32)
    trace = routed_trace(
        routing_layout(folder / "model"),
        [RoutedSequence(experts, source.tokens["token_id"].to_numpy() % 2048)],
        source="vllm-routed",
    )
    return trace.to_parquet(folder / "routes.parquet")


@pytest.mark.parametrize("page", ["routing", "load", "structure", "deployment"])
def test_a_deepseek_v3_import_renders(deepseek_v3_import, monkeypatch, page):
    at = on_file(page, deepseek_v3_import, monkeypatch)
    trace = read_routing_file(deepseek_v3_import)
    assert len(trace.layers) == 58 and trace.layers[0].num_experts == 256
    assert at.get("vega_lite_chart")
    if page == "load":
        assert_frames_equal(
            frame_with(at, "verdict", "status"), collapse_frame(collapse_report(trace)), VERDICTS
        )
    if page in ("routing", "load"):
        assert SCORES in captions(at)
