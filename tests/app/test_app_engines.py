"""The Engines page (Streamlit AppTest): on first open it diffs the sidebar model at bfloat16 against float32
on the example prompt, and shows what `moeviz.analysis.engine_diff` computes from the same two captures made
here (headline, metrics, per-layer table, differing pairs); A = B says identical; a routing file imported
without router logits loads (by path, inside the allowed store folders) and the page says in one caption what
it cannot show without scores; two files naming the same source that route differently are flagged as
non-determinism; a path outside the allowlist, an expert-count table and a bad upload are refused; a
differing token opens on the Routing page; the replay shows the library's replay; the page renders at
DeepSeek-V3 scale (256 experts × 58 MoE layers, a real random model)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

import moeviz
from moeviz.analysis.engine_diff import engine_diff
from moeviz.charts import token_options
from moeviz.engines.layout import routing_layout
from moeviz.engines.routed import RoutedSequence, routed_trace
from moeviz.interventions.replay import replay
from moeviz.trace import ExpertLoad
from tests.support.app import APP, REPO, app_test_env, run_page
from tests.support.scale_models import save_scale_model

PAGE = "pages/engines.py"
MODEL = "sample:mixtral-healthy"  # the default: bf16 and fp32 pick the same sets on the example prompt
FLIPS = "sample:deepseek-v3-bias"  # bf16 flips 4 of its 84 (token, layer) on the example prompt
TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


def captures(model: str, text: str, dtypes=("bfloat16", "float32")) -> list[moeviz.Trace]:
    """`text` captured by `model` loaded at each dtype, apart from the app."""
    return [moeviz.capture(moeviz.load_model(model, dtype=dtype), text) for dtype in dtypes]


def shown_text(at) -> str:
    return " ".join(e.value for e in [*at.success, *at.warning, *at.info])


def layer_table(at):
    (frame,) = [d.value for d in at.dataframe if "router_mismatch" in d.value and "kl" in d.value]
    return frame


def routing_file(
    trace: moeviz.Trace, model: str, path, *, flip: tuple[int, int] | None = None, ranked: bool = True
):
    """`trace`'s expert ids as an engine import writes them (`routed_trace`: [T, L, k] ids and the token
    ids, no logits, no weights), saved at `path`; `flip` = (token, MoE layer index) gets another expert in
    slot 1; `ranked` False: each token's experts in ascending id order, as Megatron's router trace writes
    them."""
    experts = np.stack([r.experts for r in trace.layers], axis=1).astype(np.int32)  # [T, L, k]
    if flip is not None:
        token, layer = flip
        taken = set(experts[token, layer].tolist())
        experts[token, layer, 1] = min(set(range(trace.layers[0].num_experts)) - taken)
    if not ranked:
        experts = np.sort(experts, axis=2)
    ids = trace.tokens["token_id"].to_numpy()
    sequences = [RoutedSequence(experts, ids)]
    imported = routed_trace(routing_layout(model), sequences, source="vllm-routed", ranked=ranked)
    return imported.to_parquet(path)


def file_state(side: str, path) -> dict:
    return {f"engines_{side}_kind": "path", f"engines_{side}_path": str(path)}


# ---- the default view --------------------------------------------------------------------------------------
def test_first_open_diffs_bf16_against_fp32_as_the_library_does() -> None:
    at = run_page(PAGE, timeout_s=TIMEOUT_S)
    expected = engine_diff(*captures(MODEL, at.session_state["prompt"]))
    assert not expected.identical and expected.pairs == len(expected.a.tokens) * len(expected.a.layers)
    assert f"{expected.mismatched:,} of {expected.pairs:,} (token, layer) differ" in shown_text(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Router mismatch"] == f"{expected.router_mismatch:.2%}"
    assert metrics["Top-1 mismatch"] == f"{expected.top1_mismatch:.2%}"
    table = layer_table(at)
    assert table["layer"].tolist() == expected.layers["layer"].tolist()
    for column in ("pairs", "mismatched", "router_mismatch", "top1_mismatch", "jaccard", "kl", "tv"):
        assert table[column].to_numpy() == pytest.approx(expected.layers[column].to_numpy(), rel=1e-9), column
    assert (table["kl"] > 0).all()  # the logits differ even where no set does
    captions = " ".join(c.value for c in at.caption)
    assert "A: this model at bfloat16" in captions and "B: this model at float32" in captions
    assert "Not shown:" not in captions  # both captures have their logits


def test_bf16_flips_match_the_library_and_open_on_the_routing_page() -> None:
    at = run_page(PAGE, timeout_s=TIMEOUT_S, model=FLIPS)
    expected = engine_diff(*captures(FLIPS, at.session_state["prompt"]))
    assert expected.mismatched > 0
    assert (
        f"**{expected.mismatched:,} of {expected.pairs:,} (token, layer) differ** (router mismatch "
        f"{expected.router_mismatch:.2%})" in shown_text(at)
    )
    (differing,) = [d.value for d in at.dataframe if "experts_a" in d.value]
    want = expected.differing_frame()
    for column in ("row", "layer", "experts_a", "experts_b", "only_a", "only_b"):
        assert differing[column].tolist() == want[column].tolist(), column
    assert differing["margin"].to_numpy() == pytest.approx(want["margin"].to_numpy())
    # the margin quartiles are B's, as the library's
    (quartiles,) = [d.value for d in at.dataframe if "quartile" in d.value]
    assert quartiles["mismatched"].tolist() == expected.margin_quartile_frame()["mismatched"].tolist()

    # open the first differing token on the Routing page, with A's (bf16) scores
    at.selectbox(key="engines_whose").set_value("A (bfloat16)").run(timeout=TIMEOUT_S)
    at.button(key="engines_open_routing").click().run(timeout=TIMEOUT_S)
    assert not at.exception, [e.value for e in at.exception]
    first = want.iloc[0]
    label = {key: name for name, key in token_options(expected.a.tokens).items()}[(first.seq, first.pos)]
    assert at.session_state["load_dtype"] == "bfloat16"
    assert at.selectbox(key="token_widget").value == label  # the Routing page's token picker
    assert at.session_state["layer"] == str(first.layer)


def test_a_token_past_the_routing_pages_first_window_opens_there() -> None:
    """Over 200 tokens the Routing page shows a window of the input: the link moves it to the token."""
    text = (REPO / "sample_models" / "eval" / "bible_en.txt").read_text(encoding="utf-8")[:2400]
    at = run_page(PAGE, timeout_s=TIMEOUT_S, model=FLIPS, prompt=text)
    expected = engine_diff(*captures(FLIPS, text))
    assert len(expected.a.tokens) > 200
    late = expected.differing_frame().query("pos >= 200").iloc[0]  # past the first window
    picker = at.selectbox(key="engines_pick")
    (option,) = [o for o in picker.options if o.startswith(f"layer {late.layer} · {late.pos}:")]
    picker.set_value(option).run(timeout=TIMEOUT_S)  # as in the browser: the choice reruns the page
    at.button(key="engines_open_routing").click().run(timeout=TIMEOUT_S)
    assert not at.exception, [e.value for e in at.exception]
    start = at.slider(key="routing_start").value
    assert start <= late.pos < start + 200
    label = {key: name for name, key in token_options(expected.a.tokens).items()}[(late.seq, late.pos)]
    assert at.selectbox(key="token_widget").value == label


def test_the_same_source_twice_is_identical() -> None:
    at = run_page(PAGE, timeout_s=TIMEOUT_S, engines_a_dtype="float32")
    (trace,) = captures(MODEL, at.session_state["prompt"], ("float32",))
    pairs = len(trace.tokens) * len(trace.layers)
    assert [s.value for s in at.success] == [
        f"**identical routing: 0 of {pairs:,} (token, layer) differ** — every expert set agrees, and the "
        "router logits are bitwise equal."
    ]
    assert not at.warning


# ---- routing files -----------------------------------------------------------------------------------------
def test_a_routing_file_without_logits_loads_and_says_what_it_cannot_show(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOEVIZ_STORE_DIRS", str(tmp_path))
    text = run_page(PAGE, timeout_s=TIMEOUT_S).session_state["prompt"]
    (fp32,) = captures(MODEL, text, ("float32",))
    path = routing_file(fp32, MODEL, tmp_path / "rollout.parquet")
    at = run_page(PAGE, timeout_s=TIMEOUT_S, **file_state("a", path))
    pairs = len(fp32.tokens) * len(fp32.layers)
    # the same sets as the fp32 capture: identical routing, no logits to compare
    assert [s.value for s in at.success] == [
        f"**identical routing: 0 of {pairs:,} (token, layer) differ** — every expert set agrees."
    ]
    captions = [c.value for c in at.caption]
    (without,) = [c for c in captions if c.startswith("Not shown:")]
    assert "A has no router scores" in without and "router KL and TV are not shown" in without
    assert "margins are B's" in without
    assert any("A: rollout.parquet (vllm-routed · sample:mixtral-healthy" in c for c in captions)
    assert not [e.value for e in at.error]


def test_two_files_of_one_source_that_differ_are_non_determinism(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOEVIZ_STORE_DIRS", str(tmp_path))
    text = run_page(PAGE, timeout_s=TIMEOUT_S).session_state["prompt"]
    (fp32,) = captures(MODEL, text, ("float32",))
    run_a = routing_file(fp32, MODEL, tmp_path / "run1.parquet", ranked=False)
    # one (token, layer) changed
    run_b = routing_file(fp32, MODEL, tmp_path / "run2.parquet", flip=(5, 2), ranked=False)
    at = run_page(PAGE, timeout_s=TIMEOUT_S, **file_state("a", run_a), **file_state("b", run_b))
    pairs = len(fp32.tokens) * len(fp32.layers)
    (warning,) = [w.value for w in at.warning]
    assert warning.startswith(f"**non-determinism: 1 of {pairs:,} (token, layer) differ**")
    captions = " ".join(c.value for c in at.caption)
    assert "A and B have no router scores" in captions  # one caption, no error
    assert "neither are the margin quartiles" in captions
    assert "A and B write each token's experts in id order, so top-1 mismatch is not defined" in captions
    assert {m.label: m.value for m in at.metric}["Top-1 mismatch"] == "–"
    assert not [e.value for e in at.error]
    # neither side is a capture of the prompt: nothing to open on the Routing page
    assert "no token to open there" in captions


def _refused(state: dict) -> list[str]:
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    for key, value in state.items():
        at.session_state[key] = value
    at.switch_page(PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    return [e.value for e in at.error]


def test_a_path_outside_the_allowed_folders_is_refused(tmp_path, monkeypatch) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (outside / "routes.parquet").write_bytes(b"not read")
    monkeypatch.setenv("MOEVIZ_STORE_DIRS", str(allowed))
    errors = _refused(file_state("a", outside / "routes.parquet"))
    assert errors == [
        f"{(outside / 'routes.parquet').resolve()} is outside the store folders this server may open: "
        f"{allowed.resolve()}"
    ]


def test_an_expert_count_table_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOEVIZ_STORE_DIRS", str(tmp_path))
    (fp32,) = captures(MODEL, "a few tokens", ("float32",))
    counts = np.ones((1, len(fp32.layers), 8), np.int64)
    path = ExpertLoad(fp32.model, counts, [r.layer for r in fp32.layers], 2, "moe-infinity").to_parquet(
        tmp_path / "load.parquet"
    )
    errors = _refused(file_state("b", path))
    assert errors == [
        f"{path} holds expert counts (moe-infinity), not per-token routing: a diff needs which experts each "
        "token chose"
    ]


def test_uploads_must_be_small_parquet_files(monkeypatch) -> None:
    from components import engine_sources, prompt

    limit = prompt.PROMPT_FILE_LIMIT
    with pytest.raises(moeviz.MoevizError, match=r"^routes\.json is not a routing file: upload a \.parquet"):
        engine_sources.check_upload("routes.json", b"{}")
    with pytest.raises(
        moeviz.MoevizError, match=rf"has {limit + 1:,} bytes; uploads may have at most {limit:,}"
    ):
        engine_sources.check_upload("big.parquet", bytes(limit + 1))
    engine_sources.check_upload("routes.parquet", bytes(limit))  # at the limit: taken


# ---- replay ------------------------------------------------------------------------------------------------
def test_the_replay_shows_the_librarys_gap_before_and_after() -> None:
    at = run_page(PAGE, timeout_s=TIMEOUT_S, model=FLIPS)
    at.button(key="engines_replay").click().run(timeout=TIMEOUT_S)
    assert not at.exception, [e.value for e in at.exception]
    bf16, fp32 = (moeviz.load_model(FLIPS, dtype=d) for d in ("bfloat16", "float32"))
    text = at.session_state["prompt"]
    expected = replay(fp32, moeviz.capture(bf16, text), infer_model=bf16, ids_from=moeviz.capture(fp32, text))
    assert expected.mode == "gap" and expected.pairs_replayed > 0
    (table,) = [d.value for d in at.dataframe if "k3_kl" in d.value]
    assert table["gap"].tolist() == ["before replay", "after replay"]
    for row, values in zip(table.itertuples(), (expected.before, expected.after), strict=True):
        assert row.mean_delta == pytest.approx(values["mean_delta"], abs=1e-6)
        assert row.k3_kl == pytest.approx(values["k3_kl"], abs=1e-6)
        assert row.extreme_fraction == pytest.approx(values["extreme_fraction"])
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["k3 KL after replay"] == f"{expected.after['k3_kl']:.3g}"


# ---- at scale ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    return save_scale_model("deepseek-v3", tmp_path_factory.mktemp("scale") / "deepseek-v3")


def test_the_page_renders_at_deepseek_v3_scale(deepseek_v3, monkeypatch) -> None:
    monkeypatch.setenv("MOEVIZ_DEFAULT_MODEL", str(deepseek_v3))  # opened as a local folder ...
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(deepseek_v3.parent))  # ... from an allowed root
    at = run_page(PAGE, timeout_s=600)
    table = layer_table(at)
    assert len(table) == 58  # 61 blocks, the first 3 dense
    charts = at.get("vega_lite_chart")
    assert len(charts) >= 4
    for chart in charts:  # no view with a mark per expert: every axis is layers, positions or counts
        assert "expert" not in fields(json.loads(chart.proto.spec)), chart.proto.spec[:200]


def fields(node) -> set[str]:
    """Every field a Vega-Lite spec encodes."""
    if isinstance(node, dict):
        found = {node["field"]} if isinstance(node.get("field"), str) else set()
        return found.union(*(fields(value) for key, value in node.items() if key != "datasets"))
    if isinstance(node, list):
        return set().union(*(fields(value) for value in node))
    return set()
