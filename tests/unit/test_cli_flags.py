"""The `moeviz` command's flags, in-process and without a model: usage errors, refusals that come before any
load (exit 2, nothing written, the model never loaded), `--version`, the `app` passthrough and the one parser
behind `report --checkpoints` and `checkpoints`. With a model: tests/models/test_cli.py."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

from moeviz import cli
from moeviz.models.loading import DEFAULT_SAMPLE as MODEL
from moeviz.samples import eval_dir
from tests.support.app import APP_DIR
from tests.support.cli import no_load, run_cli


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", MODEL, "--token-ids", "1,x"], "comma-separated integers"),
        (["--model", MODEL, "--text", "   "], "--text is empty"),
        (["--model", MODEL, "--text-file", "/no/such.txt"], "does not exist"),
        (["--model", MODEL, "--text", "hi", "--generate", "-1"], "--generate must be >= 0"),
    ],
    ids=["token-ids", "empty-text", "missing-text-file", "negative-generate"],
)
def test_bad_input_exits_2_before_the_model_loads(tmp_path, monkeypatch, capsys, args, message):
    no_load(monkeypatch)
    result = run_cli(capsys, "capture", *args, "--out", str(tmp_path / "out.parquet"))
    assert result.code == 2
    result.one_line(message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args",
    [
        ["capture", "--text", "hi", "--out", "x.parquet"],  # no --model
        ["capture", "--model", "m", "--text", "a", "--token-ids", "1", "--out", "x.parquet"],  # two inputs
        ["capture", "--model", "m", "--text", "a", "--out", "x.parquet", "--generate", "many"],
        ["frobnicate"],
    ],
    ids=["no-model", "two-inputs", "generate-not-int", "unknown-verb"],
)
def test_bad_flags(tmp_path, monkeypatch, capsys, args):
    monkeypatch.chdir(tmp_path)
    no_load(monkeypatch)
    result = run_cli(capsys, *args)
    assert result.code == 2 and "usage:" in result.err
    assert list(tmp_path.iterdir()) == []


def test_bad_output_path(tmp_path, monkeypatch, capsys):
    no_load(monkeypatch)
    base = ["capture", "--model", MODEL, "--text", "hi", "--out"]
    result = run_cli(capsys, *base, str(tmp_path / "no" / "x.parquet"))
    assert result.code == 2
    result.one_line("does not exist")
    result = run_cli(capsys, *base, str(tmp_path / "x.csv"))
    assert result.code == 2
    result.one_line(".parquet")
    assert list(tmp_path.iterdir()) == []


def test_bad_ray_and_device_map_flags_exit_2(tmp_path, capsys, monkeypatch):
    no_load(monkeypatch)
    base = ["trace", "--model", MODEL, "--corpus", str(eval_dir()), "--out", str(tmp_path / "s")]
    run_cli(capsys, *base, "--workers", "3").one_line("--workers needs --ray")
    run_cli(capsys, *base, "--device-map", "{not json").one_line("--device-map is not valid JSON")
    assert run_cli(capsys, *base, "--offload-folder", str(tmp_path / "off")).code == 2
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    result = run_cli(capsys, *base, "--ray")
    assert result.code == 2
    result.one_line("pip install 'moeviz[ray]'")
    assert list(tmp_path.iterdir()) == []


def test_app_passes_arguments_to_streamlit(monkeypatch):
    """`moeviz app ARGS` becomes `python -m streamlit run app/serve.py APP_FLAGS ARGS` (execv
    isolated; the user's flags come last, so they win)."""
    seen = {}
    monkeypatch.setattr(os, "execv", lambda path, argv: seen.update(path=path, argv=argv))
    cli.main(["app", "--server.port", "8765", "--server.headless", "true"])
    assert seen["path"] == sys.executable and seen["argv"][0] == sys.executable
    assert seen["argv"][1:4] == ["-m", "streamlit", "run"]
    assert seen["argv"][4].endswith("app/serve.py") and os.path.isfile(seen["argv"][4])
    assert seen["argv"][5:] == [*cli.APP_FLAGS, "--server.port", "8765", "--server.headless", "true"]


def magic_expressions(script: Path) -> list[int]:
    """Lines of `script` that Streamlit's magic would show with st.write: expression statements that are
    neither calls, docstrings, yields nor awaits (streamlit/runtime/scriptrunner/magic.py)."""
    tree = ast.parse(script.read_text(encoding="utf-8"))
    lines = []
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            statements = getattr(node, field, None)  # a lambda's or an if-expression's body is one node
            for i, statement in enumerate(statements if isinstance(statements, list) else []):
                if not isinstance(statement, ast.Expr):
                    continue
                value = statement.value
                docstring = i == 0 and isinstance(value, ast.Constant) and isinstance(value.value, str)
                if not docstring and not isinstance(value, ast.Call | ast.Yield | ast.YieldFrom | ast.Await):
                    lines.append(statement.lineno)
    return lines


def test_no_app_script_relies_on_magic_which_the_app_turns_off(tmp_path):
    """`APP_FLAGS` turns Streamlit's magic off: a page's bare expression would silently show nothing."""
    assert "--runner.magicEnabled" in cli.APP_FLAGS
    assert cli.APP_FLAGS[cli.APP_FLAGS.index("--runner.magicEnabled") + 1] == "false"
    scripts = [APP_DIR / "streamlit_app.py", APP_DIR / "serve.py", *sorted((APP_DIR / "pages").glob("*.py"))]
    found = {script.name: magic_expressions(script) for script in scripts}
    assert {name: lines for name, lines in found.items() if lines} == {}
    shown = tmp_path / "shown.py"  # the check finds what magic would show
    shown.write_text('"""Docstring."""\nimport streamlit as st\nx = 1\nx\n"text"\nst.write(x)\n')
    assert magic_expressions(shown) == [4, 5]


def test_version(capsys):
    from importlib.metadata import version

    result = run_cli(capsys, "--version")
    assert result.code == 0
    assert result.out.strip() == f"moeviz {version('moeviz')}"


def test_cli_sets_hf_offline_for_itself(monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert run_cli(capsys, "--version").out.startswith("moeviz ")
    assert os.environ["HF_HUB_OFFLINE"] == "1"


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


def test_checkpoints_verb_is_report_checkpoints(monkeypatch, tmp_path, capsys):
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
    result = run_cli(capsys, "checkpoints", "runs/series")
    assert result.code == 2 and "--corpus" in result.err


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
