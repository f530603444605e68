"""The `moeviz` console script as a real process, for what only a process shows: a real Ctrl-C (SIGINT) and
a SIGKILL mid-run, and the exit status the shell sees. Everything else about the command runs in-process
(tests/unit/test_cli_flags.py, tests/models/test_cli.py, tests/models/test_trace_cli.py).

Each signal is sent at a step the test waits for (a progress line, a batch recorded in the manifest), never
after a fixed time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from moeviz.samples import eval_dir
from moeviz.store import StoreQuery, list_runs
from tests.support.cli import REPO, main_code, messages

SAMPLE = "sample:mixtral-healthy"
TRACE = ["--batch-size", "4", "--chunk-tokens", "128", "--max-batches", "12"]
PROMPT = "def f(x): return x + 1. In the beginning God created the heaven and the earth."
INTERRUPT_AT = 3  # the batch a trace is interrupted in: signalled once batches 0-2 are in the manifest
DEADLINE_S = 180


def _console_script() -> Path:
    """The installed `moeviz` entry point (`[project.scripts]`), next to this interpreter."""
    script = Path(sys.executable).with_name("moeviz")
    if not script.is_file():
        pytest.fail(f"{script} not found: install the package (make setup) so that its console script exists")
    return script


class Process:
    """`moeviz ARGV` started from the console script, its stderr read as it comes (tqdm redraws lines with
    \\r and no newline, so a line reader would wait for the end)."""

    def __init__(self, *argv: str, cwd: Path = REPO) -> None:
        self.proc = subprocess.Popen(
            [str(_console_script()), *argv],
            cwd=cwd,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._err = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := self.proc.stderr.read1(65536):
            self._err.extend(chunk)

    @property
    def err(self) -> str:
        return bytes(self._err).decode(errors="replace")

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        """Poll `condition` until it holds (the process still running), or fail at the deadline."""
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            assert self.proc.poll() is None, (
                f"moeviz ended (exit {self.proc.returncode}) before {what}: {self.err}"
            )
            assert time.monotonic() < deadline, f"no {what} within {DEADLINE_S} s: {self.err[-2000:]}"
            time.sleep(0.01)
        assert self.proc.poll() is None, f"moeviz ended before it could be interrupted at {what}"

    def finish(self, sig: int | None = None) -> int:
        if sig is not None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=DEADLINE_S)
        self._reader.join(timeout=DEADLINE_S)
        return code


def test_ctrl_c_during_capture_is_one_line_exit_130_and_nothing_written(tmp_path):
    """A real SIGINT while the model generates: exit 130, one line, no traceback, no file (nor .partial)."""
    out = tmp_path / "t.parquet"
    run = Process(
        "capture", "--model", SAMPLE, "--text", "hello there", "--generate", "200", "--out", str(out)
    )
    run.wait_for(lambda: "generating 200 tokens" in run.err, "the generation step")
    assert run.finish(signal.SIGINT) == 130, run.err[-2000:]
    assert "Traceback" not in run.err, run.err
    assert messages(run.err) == ["moeviz: interrupted; nothing was written"]
    assert list(tmp_path.iterdir()) == []


def _trace_argv(store: Path, *extra: str) -> list[str]:
    return ["trace", "--model", SAMPLE, "--corpus", str(eval_dir()), "--out", str(store), *TRACE, *extra]


def _rows(store: Path):
    return StoreQuery(store).sql(
        "SELECT batch, doc, domain, seq, pos, token_id, layer, rank, expert, weight, score, lse FROM rows "
        "ORDER BY seq, pos, layer, rank"
    )


def _recorded(store: Path) -> int:
    manifest = next(iter(store.glob("model=*/checkpoint=*/manifest.jsonl")), None)
    return 0 if manifest is None else manifest.read_text().count("\n")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    store = tmp_path_factory.mktemp("full") / "store"
    assert main_code(_trace_argv(store, "--quiet")) == 0
    return store


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_killed_trace_resumes_to_exactly_the_uninterrupted_rows(uninterrupted, tmp_path, capsys, sig):
    """Interrupted in batch 3 (SIGKILL: no handler runs; SIGINT: exit 130 and the line saying --resume),
    the run keeps its completed batches; without --resume the store is refused (exit 2), with it the run
    completes with exactly the rows of an uninterrupted one."""
    store = tmp_path / "store"
    run = Process(*_trace_argv(store, "--quiet"))
    run.wait_for(lambda: _recorded(store) >= INTERRUPT_AT, f"batch {INTERRUPT_AT - 1} in the manifest")
    code = run.finish(sig)
    state = list_runs(store)[0]
    assert not state.complete and set(range(INTERRUPT_AT)) <= set(state.parts), sorted(state.parts)
    assert len(state.parts) < 12
    if sig == signal.SIGINT:
        assert code == 130 and "Traceback" not in run.err, run.err[-2000:]
        (line,) = messages(run.err)
        assert "interrupted" in line and "--resume" in line
    else:
        assert code == -signal.SIGKILL
    assert main_code(_trace_argv(store, "--quiet")) == 2  # a partial run is refused without --resume
    assert "--resume" in capsys.readouterr().err
    assert main_code(_trace_argv(store, "--quiet", "--resume")) == 0
    assert list_runs(store)[0].complete
    got, want = _rows(store), _rows(uninterrupted)
    assert len(got) == len(want) > 0
    assert got.equals(want)


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--version"], 0),
        (["frobnicate"], 2),  # a usage error (argparse)
        (["capture", "--model", SAMPLE, "--text", "   ", "--out", "t.parquet"], 2),  # bad input
        (["report", "--model", "sample:mixtral-collapsed", "--text", PROMPT, "--fail-on", "collapsed"], 3),
    ],
    ids=["version", "usage", "bad-input", "verdict"],
)  # fmt: skip
def test_console_script_exits_with_what_main_returns(tmp_path, monkeypatch, argv, code):
    """The shell sees the documented exit codes (moeviz.cli.exits: 2 bad flags or input, 3 the --fail-on
    verdict reached), the ones `main` returns in-process."""
    monkeypatch.chdir(tmp_path)
    assert main_code(argv) == code
    run = Process(*argv, cwd=tmp_path)
    assert run.finish() == code, run.err[-2000:]
    assert "Traceback" not in run.err
    assert list(tmp_path.iterdir()) == []
