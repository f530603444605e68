"""`moeviz import` and `moeviz trace --import`, in-process: the file written is the routing the engine's file
encodes (compared with the ids the test encoded), a refusal exits 2 with one line and writes nothing, a
counts format writes a load table, and an imported store run holds the same rows as the import. The
formats themselves are tested in tests/models/test_engines_*.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeviz.engines.layout import routing_layout
from moeviz.trace import ExpertLoad, Trace, read_routing_file
from tests.support.cli import run_cli
from tests.support.sglang_files import (
    generate_response,
    make_request,
    returned_rows,
    save_stat_dump,
    write_json,
    write_jsonl,
)

MODEL = "sample:deepseek-v3-bias"  # 4 hidden layers, dense layer 0, 16 experts, top-4


@pytest.fixture(scope="module")
def layout():
    return routing_layout(MODEL)


def _requests(layout, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        make_request(rng, 5 + i, 4, layout.num_hidden_layers, layout.top_k, layout.num_experts)
        for i in range(n)
    ]


def _responses(layout, requests) -> list[dict]:
    dense = list(layout.dense_layers)
    return [
        generate_response(r, returned_rows(r, layout.num_hidden_layers, dense), with_prompt_ids=True)
        for r in requests
    ]


def test_import_writes_the_routing_the_responses_encode(tmp_path, capsys, layout):
    requests = _requests(layout, 3)
    source = write_jsonl(tmp_path / "rollouts.jsonl", _responses(layout, requests))
    out = tmp_path / "routes.parquet"
    result = run_cli(capsys, "import", "sglang-routed", str(source), "--model", MODEL, "--out", str(out))
    assert result.code == 0, result.err
    assert f"-> {out}" in result.out and "3 MoE layers" in result.out
    trace = read_routing_file(out)
    assert isinstance(trace, Trace)
    for i, routing in enumerate(trace.layers):
        layer = layout.moe_layers[i]
        expected = np.concatenate([r.experts[:, layer] for r in requests])
        np.testing.assert_array_equal(routing.experts, expected)
        assert routing.decision_source == "sglang-routed" and not routing.has_logits
    ids = np.concatenate([r.token_ids for r in requests])
    np.testing.assert_array_equal(trace.tokens["token_id"], ids)


def test_a_refused_import_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, layout):
    request = _requests(layout, 1)[0]
    rows = returned_rows(request, layout.num_hidden_layers, list(layout.dense_layers))
    rows[2, 1, 1] = rows[2, 1, 0]  # a repeated expert: no router does that
    source = write_json(tmp_path / "bad.json", generate_response(request, rows, with_prompt_ids=True))
    out = tmp_path / "routes.parquet"
    result = run_cli(capsys, "import", "sglang-routed", str(source), "--model", MODEL, "--out", str(out))
    assert result.code == 2
    result.one_line("bad.json", "position 2", "distinct expert ids")
    assert not out.exists() and not list(tmp_path.glob("*.partial*"))


def test_token_ids_that_disagree_with_the_response_are_refused(tmp_path, capsys, layout):
    request = _requests(layout, 1)[0]
    source = write_json(tmp_path / "r.json", _responses(layout, [request])[0])
    wrong = request.token_ids.copy()
    wrong[3] += 1
    ids_file = write_json(tmp_path / "ids.json", wrong.tolist())
    result = run_cli(
        capsys,
        *("import", "sglang-routed", str(source), "--model", MODEL),
        *("--token-ids", str(ids_file), "--out", str(tmp_path / "o.parquet")),
    )
    assert result.code == 2
    result.one_line("position 3")


def test_counts_import_as_a_load_table(tmp_path, capsys, layout):
    rng = np.random.default_rng(1)
    counts = torch.zeros((6, layout.num_hidden_layers, layout.num_experts), dtype=torch.int32)
    for layer in layout.moe_layers:
        counts[:4, layer] = torch.as_tensor(
            rng.integers(0, 9, size=(4, layout.num_experts)), dtype=torch.int32
        )
    source = save_stat_dump(tmp_path / "expert_distribution_recorder_1.pt", counts)  # 2 ring rows unfilled
    out = tmp_path / "load.parquet"
    result = run_cli(capsys, "import", "sglang-dump", str(source), "--model", MODEL, "--out", str(out))
    assert result.code == 0, result.err
    load = read_routing_file(out)
    assert isinstance(load, ExpertLoad)
    np.testing.assert_array_equal(load.counts, counts[:4, list(layout.moe_layers)].numpy())
    assert "4 steps" in result.out


def test_trace_import_writes_one_store_run_with_the_imported_rows(tmp_path, capsys, layout):
    from moeviz.whatif.routes import routes_from_store, routes_from_trace

    requests = _requests(layout, 2, seed=3)
    source = write_jsonl(tmp_path / "rollouts.jsonl", _responses(layout, requests))
    store = tmp_path / "store"
    result = run_cli(
        capsys,
        *("trace", "--import", "sglang-routed", str(source), "--model", MODEL),
        *("--out", str(store), "--label", "rollouts", "--checkpoint", "step-7"),
    )
    assert result.code == 0, result.err
    assert "rollouts/step-7" in result.out and "complete" in result.out
    imported = routes_from_trace(Trace.from_parquet(_import(tmp_path, capsys, source)))
    stored = routes_from_store(store)
    for a, b in zip(imported.layers, stored.layers, strict=True):
        np.testing.assert_array_equal(a.experts, b.experts)
        np.testing.assert_array_equal(a.seq, b.seq)
        np.testing.assert_array_equal(a.pos, b.pos)


def _import(tmp_path, capsys, source):
    out = tmp_path / "same.parquet"
    assert (
        run_cli(capsys, "import", "sglang-routed", str(source), "--model", MODEL, "--out", str(out)).code == 0
    )
    return out


def test_trace_import_refuses_counts_and_run_flags(tmp_path, capsys, layout):
    counts = torch.zeros((2, layout.num_hidden_layers, layout.num_experts), dtype=torch.int32)
    counts[:, 1:, :4] = 1
    source = save_stat_dump(tmp_path / "d.pt", counts)
    store = tmp_path / "store"
    result = run_cli(
        capsys, "trace", "--import", "sglang-dump", str(source), "--model", MODEL, "--out", str(store)
    )
    assert result.code == 2
    result.one_line("expert counts, not per-token routing")
    result = run_cli(
        capsys,
        "trace",
        "--import",
        "sglang-dump",
        str(source),
        "--model",
        MODEL,
        "--out",
        str(store),
        "--resume",
    )
    result.one_line("--resume does not apply to --import")
    assert not store.exists()
