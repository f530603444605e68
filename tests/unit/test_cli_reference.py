"""The site's CLI reference (docs/cli.md) is the one scripts/cli_reference.py generates from the parser, and
it documents every command and every flag the parser has."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from moeviz.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "cli.md"


def _cli_reference():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import cli_reference
    finally:
        sys.path.pop(0)
    return cli_reference


def _every_command(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                yield from _every_command(command)


def test_the_cli_page_is_fresh():
    check = [sys.executable, str(ROOT / "scripts" / "cli_reference.py"), "--check"]
    result = subprocess.run(check, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_command_and_flag_is_on_the_page():
    page = PAGE.read_text(encoding="utf-8")
    for command in _every_command(build_parser()):
        assert f"# {command.prog}\n" in page, command.prog
        for action in command._actions:
            for flag in action.option_strings:
                assert flag in page, (command.prog, flag)


def test_a_stale_page_is_caught(tmp_path, monkeypatch):
    cli_reference = _cli_reference()
    stale = tmp_path / "cli.md"
    stale.write_text("# CLI reference\n\nmoeviz capture --old-flag\n", encoding="utf-8")
    monkeypatch.setattr(cli_reference, "PAGE", stale)
    assert cli_reference.main(["--check"]) == 1
    assert cli_reference.main([]) == 0 and stale.read_text(encoding="utf-8") == cli_reference.render()
    assert cli_reference.main(["--check"]) == 0
    monkeypatch.setattr(cli_reference, "PAGE", tmp_path / "missing.md")
    assert cli_reference.main(["--check"]) == 1


def test_the_page_does_not_depend_on_the_terminal_width(monkeypatch):
    cli_reference = _cli_reference()
    monkeypatch.setenv("COLUMNS", "40")
    narrow = cli_reference.render()
    monkeypatch.setenv("COLUMNS", "250")
    assert cli_reference.render() == narrow == PAGE.read_text(encoding="utf-8")


def test_the_readme_command_lines_parse():
    """Every `moeviz ...` line of the README's command-line block is one the parser accepts."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("## The command line", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line)[1:] for line in block.splitlines() if line.startswith("moeviz ")]
    assert len(lines) >= 6
    parser = build_parser()
    for args in lines:
        parser.parse_args(args)  # a stale flag exits 2 here (SystemExit fails the test)
