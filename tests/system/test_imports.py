"""What importing moeviz costs: the modules that promise no torch keep it out, `import moeviz` and the
parser of the `moeviz` command load neither torch nor transformers, and one version is printed (each check
in a fresh interpreter, where nothing else has imported torch yet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers")


def _fresh(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def _heavy_after(statement: str) -> list[str]:
    """The heavy packages in sys.modules after `statement` runs in a fresh interpreter."""
    code = f"import json, sys\n{statement}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    result = _fresh(code)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "module", ["moeviz", "moeviz.trace", "moeviz.analysis", "moeviz.charts", "moeviz.cli", "moeviz.report"]
)
def test_importing_leaves_torch_and_transformers_out(module):
    assert _heavy_after(f"import {module}") == []


@pytest.mark.parametrize(
    "argv", [["--version"], ["--help"], ["whatif", "--help"], ["checkpoints", "--help"], ["report", "--help"]]
)
def test_version_and_help_do_not_import_torch(argv):
    statement = f"from moeviz.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    assert _heavy_after(statement) == []


def test_public_names_load_on_first_use():
    code = (
        "import sys, moeviz\n"
        "assert 'torch' not in sys.modules\n"
        "from moeviz import capture, load_model, LoadedModel, list_samples, Trace, LayerRouting, ModelInfo\n"
        "from moeviz import MoevizError\n"
        "import moeviz.capture\n"  # the subpackage must not replace the function of the same name
        "assert callable(moeviz.capture) and moeviz.capture is capture, moeviz.capture\n"
        "assert moeviz.load_model is load_model and moeviz.Trace is Trace\n"
        "assert set(moeviz.__all__) <= set(dir(moeviz)) and '__version__' in dir(moeviz)\n"
        "try:\n    moeviz.no_such_name\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n"
    )
    result = _fresh(code)
    assert result.returncode == 0, result.stderr[-2000:]


def test_ctrl_c_while_torch_loads_is_one_line_exit_130(tmp_path):
    """Ctrl-C during the heavy imports (simulated: importing transformers raises KeyboardInterrupt) reaches
    `main`'s handler: exit 130, one line, no traceback, nothing written."""
    code = (
        "import sys\n"
        "class CtrlC:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'):\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, CtrlC())\n"
        "from moeviz.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    out = tmp_path / "t.parquet"
    result = _fresh(code, "capture", "--model", "sample:mixtral-healthy", "--text", "hi", "--out", str(out))
    assert result.returncode == 130, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("moeviz:")] == [
        "moeviz: interrupted; nothing was written"
    ]
    assert list(tmp_path.iterdir()) == []


def test_version_is_pyproject_s():
    version = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    result = subprocess.run(
        [sys.executable, "-m", "moeviz.cli", "--version"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"moeviz {version}"
    assert _fresh("import moeviz; print(moeviz.__version__)").stdout.strip() == version
