"""The version is written once, in pyproject.toml: `moeviz --version` and `moeviz.__version__` read it back
through the installed distribution's metadata."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

import moeviz
from moeviz.cli import main

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def pyproject_version() -> str:
    return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["version"]


def test_moeviz_version_flag_prints_pyproject_s_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"moeviz {pyproject_version()}"


def test_package_version_is_pyproject_s():
    assert moeviz.__version__ == pyproject_version()


def test_the_number_is_written_only_in_pyproject():
    """No module of moeviz spells the version out (a second copy would drift from pyproject's)."""
    version = re.escape(pyproject_version())
    literal = re.compile(rf"""["']{version}["']""")
    package = PYPROJECT.parent / "moeviz"
    copies = [str(path) for path in package.rglob("*.py") if literal.search(path.read_text(encoding="utf-8"))]
    assert copies == []
