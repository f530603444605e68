"""`moeviz report --trace` and `moeviz whatif ep --trace` on routing without router scores, run in-process
(tests/support/cli.py): a trace imported from an engine (ids only) and a load table of expert counts
(`ExpertLoad.to_parquet`). The same routing captured by moeviz gives bitwise the same load numbers; what
needs scores is null, what needs tokens is refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

import moeviz
from moeviz.engines.layout import routing_layout
from moeviz.engines.routed import RoutedSequence, routed_trace
from moeviz.report import BIAS_KEYS, LAYER_KEYS, SCORE_KEYS
from moeviz.trace import ExpertLoad
from tests.support.cli import no_load, run_cli

MODEL = "sample:mixtral-healthy"  # 4 MoE layers, 8 experts, top-2
TEXTS = [
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up and barks.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "In the beginning God created the heaven and the earth. And the earth was without form, and void.",
]
EP = ["--gpus", "4", "--gpus-per-node", "2", "--redundant", "4", "--placement", "eplb"]
LOAD_KEYS = [key for key in LAYER_KEYS if key not in [*SCORE_KEYS, *BIAS_KEYS]]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same routing three ways: captured by moeviz (a trace with logits), imported as an engine writes
    it (each sequence's expert ids [T, L, k] → `routed_trace`, no logits or weights), and as a load table
    (the counts per sequence). → {"ids": token ids per sequence, "captured", "imported", "load": paths}."""
    folder = tmp_path_factory.mktemp("imported")
    loaded = moeviz.load_model(MODEL)
    ids = [loaded.tokenizer(text)["input_ids"] for text in TEXTS]
    captured = moeviz.capture(loaded, token_ids=ids)
    seq = captured.tokens["seq"].to_numpy()
    sequences, counts = [], []
    for s, token_ids in enumerate(ids):
        rows = [np.flatnonzero(seq[r.token_rows] == s) for r in captured.layers]
        experts = np.stack([r.experts[i] for r, i in zip(captured.layers, rows, strict=True)], axis=1)
        sequences.append(RoutedSequence(experts.astype(np.int32), np.asarray(token_ids)))
        counts.append([np.bincount(experts[:, layer].ravel(), minlength=8) for layer in range(4)])
    imported = routed_trace(routing_layout(MODEL), sequences, source="vllm-routed")
    load = ExpertLoad(
        model=captured.model,
        counts=np.asarray(counts),
        layers=[r.layer for r in captured.layers],
        top_k=2,
        source="moe-infinity",  # one step per sequence, as the trace's sequences
    )
    return {
        "ids": ids,
        "captured": captured.to_parquet(folder / "captured.parquet"),
        "imported": imported.to_parquet(folder / "imported.parquet"),
        "load": load.to_parquet(folder / "load.parquet"),
    }


def report(capsys, path, *args) -> dict:
    result = run_cli(capsys, "report", "--trace", str(path), "--format", "json", *args)
    assert result.code == 0, result.err
    assert "moeviz: warning" not in result.err  # no warning flood for the absent logits
    return json.loads(result.out)


def test_an_import_and_a_load_table_report_the_captured_load_bitwise(capsys, files, monkeypatch):
    no_load(monkeypatch)  # --trace runs no model
    captured = report(capsys, files["captured"], "--devices", "2")
    for name in ("imported", "load"):
        got = report(capsys, files[name], "--devices", "2")
        assert got["verdict"] == captured["verdict"] and got["reasons"] == captured["reasons"], name
        assert got["ep_balancedness_over_layers"] == captured["ep_balancedness_over_layers"], name
        for row, want in zip(got["layers"], captured["layers"], strict=True):
            assert {key: row[key] for key in LOAD_KEYS} == {key: want[key] for key in LOAD_KEYS}, name
            assert row["ep_balancedness"] == want["ep_balancedness"]
            assert all(row[key] is None for key in SCORE_KEYS), (name, row)
        assert any("need router" in note for note in got["notes"]), name
    assert all(row[key] is not None for row in captured["layers"] for key in SCORE_KEYS)
    assert captured["notes"] == []


def test_the_file_report_equals_the_model_report(capsys, files):
    """`report --trace` of a capture is `report --model` on the same tokens (one sequence)."""
    ids = ",".join(map(str, files["ids"][0]))
    result = run_cli(capsys, "report", "--model", MODEL, "--token-ids", ids, "--format", "json")
    assert result.code == 0
    by_model = json.loads(result.out)
    loaded = moeviz.load_model(MODEL)
    trace = moeviz.capture(loaded, token_ids=[files["ids"][0]])
    tmp = files["captured"].parent / "one.parquet"
    trace.to_parquet(tmp)
    out = report(capsys, tmp)
    assert out == by_model


def test_fail_on_gates_a_collapsed_load_table(capsys, tmp_path):
    counts = np.zeros((3, 4, 8), np.int64)
    counts[:, :, :2] = 300  # every token on experts 0 and 1
    info = moeviz.trace.ModelInfo(source=MODEL, model_type="mixtral", architecture="x", num_layers=4)
    path = ExpertLoad(info, counts, [0, 1, 2, 3], 2, "sglang-dump").to_parquet(tmp_path / "collapsed.parquet")
    result = run_cli(capsys, "report", "--trace", str(path), "--fail-on", "collapsed")
    assert result.code == 3 and "verdict: COLLAPSED" in result.out
    assert (
        "6 of 8 experts received no token" in result.out and "note: a load table of sglang-dump" in result.out
    )
    markdown = run_cli(capsys, "report", "--trace", str(path), "--format", "markdown")
    assert markdown.code == 0 and "| layer | site | verdict |" in markdown.out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "/no/such.parquet"], "--trace /no/such.parquet is not a file"),
        (["--trace", "{load}", "--devices", "3"], "split evenly over the devices"),
        (["--trace", "{text}"], "not a readable Parquet file"),
    ],
)
def test_bad_report_files_exit_2_with_one_line(capsys, files, tmp_path, args, message):
    (tmp_path / "t.parquet").write_text("text")
    args = [a.format(load=files["load"], text=tmp_path / "t.parquet") for a in args]
    result = run_cli(capsys, "report", *args)
    assert result.code == 2
    result.one_line(message)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--text", "hi"], "--text does not apply to --trace"),
        (["--dtype", "float32"], "--dtype does not apply to --trace"),
        (["--model", MODEL], "not allowed with argument"),
    ],
)
def test_report_trace_flag_misuse_is_a_usage_error(capsys, files, extra, message):
    result = run_cli(capsys, "report", "--trace", str(files["load"]), *extra)
    assert result.code == 2 and message in result.err and "usage: moeviz report" in result.err


# ---- whatif ep ---------------------------------------------------------------------------------------------
def whatif(capsys, *args) -> dict:
    result = run_cli(capsys, "whatif", *args, "--format", "json")
    assert result.code == 0, result.err
    return json.loads(result.out)


def test_ep_on_a_load_table_equals_ep_on_the_capture(capsys, files, monkeypatch):
    captured = whatif(capsys, "ep", "--model", MODEL, "--trace", str(files["captured"]), *EP)
    imported = whatif(capsys, "ep", "--model", MODEL, "--trace", str(files["imported"]), *EP)
    assert imported["layers"] == captured["layers"] and imported["totals"] == captured["totals"]
    no_load(monkeypatch)  # a load table needs only the model's config
    load = whatif(capsys, "ep", "--model", MODEL, "--trace", str(files["load"]), *EP)
    assert load["ep_balancedness_over_layers"] == captured["ep_balancedness_over_layers"]
    for row, want in zip(load["layers"], captured["layers"], strict=True):
        for key in ("layer", "ep_balancedness", "max_gpu_load", "mean_gpu_load", "gpu_load"):
            assert row[key] == want[key], key
        assert row["dispatch_bytes_inter"] is None and row["a2a_time_s"] is None
    assert any("All-to-All bytes and times (null)" in note for note in load["notes"])
    text = run_cli(capsys, "whatif", "ep", "--model", MODEL, "--trace", str(files["load"]), *EP)
    assert text.code == 0 and "ep_balancedness_over_layers" in text.out and "max_load" in text.out
    split = whatif(
        capsys, "ep", "--model", MODEL, "--trace", str(files["load"]), *EP, "--fit-fraction", "0.5"
    )
    assert split["same_data"] is False and "fitted on 2 of 3 steps" in split["fit"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ep", *EP[:-2], "--placement", "traffic"], "--placement traffic needs each token's set of experts"),
        (["ep", *EP, "--replica", "vllm"], "--replica vllm needs each token's set of experts"),
        (["ep", *EP, "--nvlink-gbps", "100"], "--nvlink-gbps sets the All-to-All time model"),
        (["offload", "--cache", "2"], "whatif offload replays each token's experts"),
        (["capacity"], "whatif capacity replays each token's experts"),
    ],
)
def test_what_needs_tokens_is_refused_on_a_load_table(capsys, files, monkeypatch, args, message):
    no_load(monkeypatch)
    result = run_cli(capsys, "whatif", args[0], "--model", MODEL, "--trace", str(files["load"]), *args[1:])
    assert result.code == 2
    result.one_line(message)


def test_capacity_on_an_import_without_weights_needs_the_position_policy(capsys, files):
    result = run_cli(capsys, "whatif", "capacity", "--model", MODEL, "--trace", str(files["imported"]))
    assert result.code == 2
    result.one_line(
        "--policy probs keeps an over-full expert's largest combination weights", "--policy position"
    )
    by_position = ["--model", MODEL, "--cf", "1.0", "--policy", "position"]
    imported = whatif(capsys, "capacity", *by_position, "--trace", str(files["imported"]))
    captured = whatif(capsys, "capacity", *by_position, "--trace", str(files["captured"]))
    assert imported["layers"] == captured["layers"]


def test_offload_on_an_import_equals_offload_on_the_capture(capsys, files):
    args = ["--model", MODEL, "--cache", "3", "--policy", "lru"]
    imported = whatif(capsys, "offload", *args, "--trace", str(files["imported"]))
    captured = whatif(capsys, "offload", *args, "--trace", str(files["captured"]))
    assert imported["layers"] == captured["layers"]
