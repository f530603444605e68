"""The `moeviz` command: capture output, summary numbers, exit codes, no partial files, app passthrough."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import moeviz
from moeviz import cli
from moeviz.models.loading import DEFAULT_SAMPLE as MODEL
from moeviz.trace import Trace


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moeviz.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )


def test_capture_writes_table_and_prints_summary(tmp_path):
    out = tmp_path / "trace.parquet"
    text = "The quick brown fox jumps over the lazy dog."
    result = run_cli("capture", "--model", MODEL, "--text", text, "--out", str(out))
    assert result.returncode == 0, result.stderr
    trace = Trace.from_parquet(out)
    expected = moeviz.capture(moeviz.load_model(MODEL), text)
    for got, want in zip(trace.layers, expected.layers, strict=True):
        np.testing.assert_array_equal(got.experts, want.experts)
    # The summary's numbers, recomputed here from the published definitions.
    lines = [line.split() for line in result.stdout.splitlines()[2:]]
    for row, routing in zip(lines, expected.layers, strict=True):
        counts = np.bincount(routing.experts.ravel(), minlength=routing.num_experts)
        share = counts / counts.sum()
        entropy = -(share[share > 0] * np.log(share[share > 0])).sum() / np.log(routing.num_experts)
        assert int(row[0]) == routing.layer and int(row[2]) == len(routing.token_rows)
        assert float(row[5]) == pytest.approx(entropy, abs=1e-3)
        assert float(row[6]) == pytest.approx(share.max(), abs=1e-3)
        assert int(row[7]) == int((counts == 0).sum())


def test_capture_with_token_ids_and_generate(tiny_model_dir, tmp_path):
    out = tmp_path / "gen.parquet"
    folder = tiny_model_dir("qwen3_moe")
    result = run_cli(
        "capture", "--model", str(folder), "--token-ids", "5,6,7", "--out", str(out), "--generate", "3"
    )
    assert result.returncode == 0, result.stderr
    frame = Trace.from_parquet(out).routing_frame()
    assert set(frame.phase) == {"prompt", "generated"}
    assert sorted(frame[frame.phase == "generated"].step.unique()) == [1, 2]


def test_text_file_input(tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("hello world from a file")
    out = tmp_path / "f.parquet"
    result = run_cli("capture", "--model", MODEL, "--text-file", str(source), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "".join(Trace.from_parquet(out).tokens.token) == "hello world from a file"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "sample:nope", "--text", "hi"], "unknown sample model 'nope'"),
        (["--model", "/no/such/folder", "--text", "hi"], "does not exist"),
        (["--model", MODEL, "--token-ids", "1,x"], "comma-separated integers"),
        (["--model", MODEL, "--text", "   "], "--text is empty"),
        (["--model", MODEL, "--text-file", "/no/such.txt"], "does not exist"),
        (["--model", MODEL, "--token-ids", "1,99999"], "out of range"),
        (["--model", MODEL, "--text", "hi", "--generate", "-1"], "--generate must be >= 0"),
        (["--model", MODEL, "--text", "x " * 40000], "exceeds the model's context length"),
    ],
)
def test_bad_input_exits_nonzero_and_writes_nothing(tmp_path, args, message):
    out = tmp_path / "out.parquet"
    result = run_cli("capture", *args, "--out", str(out))
    assert result.returncode == 2
    assert message in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args",
    [
        ["capture", "--text", "hi", "--out", "x.parquet"],  # no --model
        ["capture", "--model", "m", "--text", "a", "--token-ids", "1", "--out", "x.parquet"],  # two inputs
        ["capture", "--model", "m", "--text", "a", "--out", "x.parquet", "--generate", "many"],
        ["frobnicate"],
    ],
)
def test_bad_flags(tmp_path, args):
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2 and "usage:" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_bad_output_path(tmp_path):
    result = run_cli(
        "capture",
        "--model",
        MODEL,
        "--text",
        "hi",
        "--out",
        str(tmp_path / "no" / "x.parquet"),
    )
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = run_cli("capture", "--model", MODEL, "--text", "hi", "--out", str(tmp_path / "x.csv"))
    assert result.returncode == 2 and ".parquet" in result.stderr


def test_app_passes_arguments_to_streamlit(monkeypatch):
    """`moeviz app ARGS` becomes `python -m streamlit run app/streamlit_app.py APP_FLAGS ARGS` (execv
    isolated; the user's flags come last, so they win)."""
    seen = {}
    monkeypatch.setattr(os, "execv", lambda path, argv: seen.update(path=path, argv=argv))
    cli.main(["app", "--server.port", "8765", "--server.headless", "true"])
    assert seen["argv"][1:4] == ["-m", "streamlit", "run"]
    assert seen["argv"][4].endswith("app/streamlit_app.py") and os.path.isfile(seen["argv"][4])
    assert seen["argv"][5:] == [*cli.APP_FLAGS, "--server.port", "8765", "--server.headless", "true"]


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"moeviz {version('moeviz')}"


def test_report_checkpoints_is_a_branch_of_the_one_parser(monkeypatch, tmp_path):
    """`report --checkpoints` goes through the main parser: report's shared flags, with the same defaults."""
    from moeviz.cli import checkpoints as checkpoints_cli

    seen = {}

    def run_checkpoints(args):
        seen["args"] = args
        return 0

    monkeypatch.setattr(checkpoints_cli, "run_checkpoints", run_checkpoints)
    one = cli.build_parser().parse_args(["report", "--model", MODEL, "--corpus", str(tmp_path)])
    assert cli.main(["report", "--checkpoints", "runs/series", "--corpus", str(tmp_path)]) == 0
    series = seen["args"]
    assert series.command == one.command == "report" and series.model is None
    assert series.checkpoints == "runs/series" and series.corpus == one.corpus
    for flag in ("chunk_tokens", "batch_size", "format", "trust_remote_code"):
        assert getattr(series, flag) == getattr(one, flag), flag
    assert one.chunk_tokens == cli.REPORT_CHUNK_TOKENS


def test_checkpoints_verb_is_report_checkpoints(monkeypatch, tmp_path):
    """`moeviz checkpoints SERIES` and its alias `report --checkpoints SERIES` run the same function with the
    same timeline flags; the verb needs --corpus."""
    from moeviz.cli import checkpoints as checkpoints_cli

    seen = []
    monkeypatch.setattr(checkpoints_cli, "run_checkpoints", lambda args: seen.append(args) or 0)
    flags = ["--corpus", str(tmp_path), "--chunk-tokens", "64", "--max-batches", "2", "--format", "json"]
    assert cli.main(["checkpoints", "runs/series", *flags, "--store", str(tmp_path / "s")]) == 0
    assert cli.main(["report", "--checkpoints", "runs/series", *flags, "--store", str(tmp_path / "s")]) == 0
    verb, alias = seen
    assert verb.command == "checkpoints" and alias.command == "report"
    for flag in ("checkpoints", "corpus", "chunk_tokens", "batch_size", "max_batches", "store", "format"):
        assert getattr(verb, flag) == getattr(alias, flag), flag
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["checkpoints", "runs/series"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--checkpoints", "s", "--text", "hi"], "--checkpoints needs --corpus"),
        (["--checkpoints", "s", "--corpus", "c", "--fail-on", "warning"], "--fail-on only applies to one"),
        (["--checkpoints", "s", "--corpus", "c", "--max-chunks", "3"], "--max-chunks only applies to one"),
        (["--checkpoints", "s", "--corpus", "c", "--format", "markdown"], "--format markdown is for one"),
        (["--model", "m", "--text", "hi", "--store", "x"], "--store only applies to --checkpoints"),
        (["--model", "m", "--corpus", "c", "--max-batches", "2"], "--max-batches only applies to --checkp"),
        (["--model", "m", "--checkpoints", "s", "--corpus", "c"], "not allowed with argument"),
        (["--corpus", "c"], "one of the arguments --checkpoints --model is required"),
        (["--checkpoints", "s", "--corpus", "c", "--chunk-tokens", "many"], "invalid int value"),
    ],
)
def test_bad_report_branch_flags(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "usage: moeviz report" in err and message in err
