"""`moeviz capture` in-process on the sample and a tiny model: the table it writes against the library's
capture and the independent routing oracle, its summary recomputed from the published definitions, and the
bad inputs only the model can refuse (exit 2, nothing written). Flag parsing: tests/unit/test_cli_flags.py;
real processes (signals, the console script): tests/system/test_cli_process.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moeviz
from moeviz.models.loading import DEFAULT_SAMPLE as MODEL
from moeviz.trace import Trace
from tests.support.cli import run_cli
from tests.support.reference_routing import canonical_order, reference_routing


def test_capture_writes_table_and_prints_summary(tmp_path, capsys):
    out = tmp_path / "trace.parquet"
    text = "The quick brown fox jumps over the lazy dog."
    result = run_cli(capsys, "capture", "--model", MODEL, "--text", text, "--out", str(out))
    assert result.code == 0, result.err
    trace = Trace.from_parquet(out)
    expected = moeviz.capture(moeviz.load_model(MODEL), text)
    for got, want in zip(trace.layers, expected.layers, strict=True):
        np.testing.assert_array_equal(got.experts, want.experts)
    # The summary's numbers, recomputed here from the published definitions.
    lines = [line.split() for line in result.out.splitlines()[2:]]
    for row, routing in zip(lines, expected.layers, strict=True):
        counts = np.bincount(routing.experts.ravel(), minlength=routing.num_experts)
        share = counts / counts.sum()
        entropy = -(share[share > 0] * np.log(share[share > 0])).sum() / np.log(routing.num_experts)
        assert int(row[0]) == routing.layer and int(row[2]) == len(routing.token_rows)
        assert float(row[5]) == pytest.approx(entropy, abs=1e-3)
        assert float(row[6]) == pytest.approx(share.max(), abs=1e-3)
        assert int(row[7]) == int((counts == 0).sum())


def test_capture_with_token_ids_and_generate(tiny_model_dir, tmp_path, capsys):
    """The tokens generated are transformers' own greedy ones, and every routed token (prompt and fed-back
    generated ones) went to the experts the oracle recomputes from one forward over the whole sequence."""
    out = tmp_path / "gen.parquet"
    folder = tiny_model_dir("qwen3_moe")
    result = run_cli(
        capsys,
        "capture",
        "--model",
        str(folder),
        "--token-ids",
        "5,6,7",
        "--out",
        str(out),
        "--generate",
        "3",
    )
    assert result.code == 0, result.err
    trace = Trace.from_parquet(out)
    frame = trace.routing_frame()
    assert set(frame.phase) == {"prompt", "generated"}
    assert sorted(frame[frame.phase == "generated"].step.unique()) == [1, 2]  # the last one is not fed back

    model = moeviz.load_model(folder).model
    with torch.no_grad():
        greedy = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)[0].tolist()
    assert trace.tokens.token_id.tolist() == greedy
    fed = torch.tensor([greedy[:-1]])  # the tokens whose forward routed them
    reference = reference_routing(model, "qwen3_moe", input_ids=fed)
    for routing in trace.layers:
        positions = trace.tokens.iloc[routing.token_rows].pos.to_numpy()
        assert positions.tolist() == list(range(len(greedy) - 1))
        ref = reference[routing.key]
        ref_experts, ref_weights = canonical_order(ref.experts[positions], ref.weights[positions])
        np.testing.assert_array_equal(routing.experts, ref_experts, err_msg=str(routing.key))
        np.testing.assert_allclose(routing.weights, ref_weights, atol=1e-5, err_msg=str(routing.key))


def test_text_file_input(tmp_path, capsys):
    """--text-file captures exactly what --text with the file's contents captures."""
    text = "hello world from a file"
    source = tmp_path / "in.txt"
    source.write_text(text)
    from_file, from_text = tmp_path / "f.parquet", tmp_path / "t.parquet"
    result = run_cli(capsys, "capture", "--model", MODEL, "--text-file", str(source), "--out", str(from_file))
    assert result.code == 0, result.err
    assert run_cli(capsys, "capture", "--model", MODEL, "--text", text, "--out", str(from_text)).code == 0
    trace = Trace.from_parquet(from_file)
    assert "".join(trace.tokens.token) == text
    assert trace.routing_frame().equals(Trace.from_parquet(from_text).routing_frame())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "sample:nope", "--text", "hi"], "unknown sample model 'nope'"),
        (["--model", "/no/such/folder", "--text", "hi"], "does not exist"),
        (["--model", MODEL, "--token-ids", "1,99999"], "out of range"),
        (["--model", MODEL, "--text", "x " * 40000], "exceeds the model's context length"),
    ],
    ids=["unknown-sample", "missing-folder", "token-out-of-range", "too-long"],
)
def test_bad_input_found_by_the_loader_exits_2_and_writes_nothing(tmp_path, capsys, args, message):
    """Refusals that need the model (its name, vocabulary or context length); the ones before any load:
    tests/unit/test_cli_flags.py."""
    out = tmp_path / "out.parquet"
    result = run_cli(capsys, "capture", *args, "--out", str(out))
    assert result.code == 2
    result.one_line(message)
    assert list(tmp_path.iterdir()) == []
