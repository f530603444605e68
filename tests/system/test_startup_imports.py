"""What starting up costs, each check in a fresh interpreter where nothing has been imported yet: every
`moeviz` command's `--help` (and `--version`) loads none of the heavy libraries, nor importlib.metadata
unless the version is asked for; `moeviz report` imports torch once and starts no other process; the app
draws the page's title before it imports torch. The figures are benchmarks/bench_startup.py's."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from moeviz.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "pandas", "numpy", "streamlit", "altair", "pyarrow", "safetensors")


def _fresh(code: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
    )


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[list[str]]:
    """Every command path of the parser, sub-commands included (`whatif ep`, ...)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append([*prefix, name])
                found += _commands(sub, (*prefix, name))
    return found


def test_every_help_and_the_version_load_no_heavy_library():
    """One interpreter runs each command's `--help` in turn and lists, after each, the heavy libraries
    loaded so far: the first command that loads one is the one named."""
    commands = [["--version"], ["--help"], *([*c, "--help"] for c in _commands(build_parser()))]
    assert ["whatif", "quant", "--help"] in commands and len(commands) > 10  # the walk found the sub-commands
    code = (
        "import contextlib, io, json, sys\n"
        "from moeviz.cli import main\n"
        "loaded = {}\n"
        f"for argv in {commands!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        f"    loaded[' '.join(argv)] = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "    if argv == ['--version']:\n"
        "        loaded['version printed'] = out.getvalue().strip()\n"
        "print(json.dumps(loaded))\n"
    )
    result = _fresh(code)
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert loaded.pop("version printed") == f"moeviz {version('moeviz')}"
    assert {command: heavy for command, heavy in loaded.items() if heavy} == {}


def test_help_does_not_look_up_the_version():
    """importlib.metadata (with the email package it imports) is imported for `--version` only."""
    code = (
        "import sys\n"
        "from moeviz.cli import main\n"
        "for argv in (['--help'], ['report', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('importlib.metadata' in sys.modules, file=sys.stderr)\n"
    )
    result = _fresh(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1] == "False"


def test_report_imports_torch_once_and_starts_no_process():
    """`moeviz report` on a short prompt runs the modules of torch and transformers once each (their
    loaders count it; a second run means one was dropped from sys.modules and imported again), and starts
    no process (an audit hook sees every subprocess, exec, spawn and fork)."""
    code = (
        "import json, sys\n"
        "executed, started = [], []\n"
        "class CountExecutions:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name not in ('torch', 'transformers'):\n"
        "            return None\n"
        "        others = [f for f in sys.meta_path if f is not self and hasattr(f, 'find_spec')]\n"
        "        spec = next(filter(None, (f.find_spec(name, path, target) for f in others)), None)\n"
        "        if spec is not None:\n"
        "            run = spec.loader.exec_module\n"
        "            spec.loader.exec_module = lambda module: (executed.append(name), run(module))\n"
        "        return spec\n"
        "sys.meta_path.insert(0, CountExecutions())\n"
        "STARTS = ('subprocess.Popen', 'os.exec', 'os.posix_spawn', 'os.spawn', 'os.fork', 'os.system')\n"
        "sys.addaudithook(lambda event, args: started.append(event) if event in STARTS else None)\n"
        "from moeviz.cli import main\n"
        "status = main(['report', '--model', 'sample:mixtral-healthy', '--text', 'The quick brown fox.'])\n"
        "print(json.dumps({'status': status, 'executed': executed, 'started': started}))\n"
    )
    result = _fresh(code, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["status"] == 0 and sorted(seen["executed"]) == ["torch", "transformers"]
    assert seen["started"] == []


def test_the_app_draws_the_page_title_before_importing_torch():
    """The app's first run with torch made unimportable and nothing kept on disk: what it drew before the
    import failed (where the page needs the model) includes the page's title."""
    code = (
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ImportError('torch is blocked by the test')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        f"sys.path.insert(0, {str(REPO / 'app')!r})\n"
        "from streamlit.testing.v1 import AppTest\n"
        f"at = AppTest.from_file({str(REPO / 'app' / 'streamlit_app.py')!r}, default_timeout=120).run()\n"
        "print([e.value for e in at.exception][:1], file=sys.stderr)\n"
        "print([t.value for t in at.title])\n"
    )
    result = _fresh(code, MOEVIZ_DEFAULT_MODEL="sample:mixtral-healthy")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch is blocked by the test" in result.stderr  # the run did reach the import
    assert result.stdout.splitlines()[-1] == "['Routing']"
