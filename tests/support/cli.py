"""The `moeviz` command run in-process (`moeviz.cli.main(argv)`), as the CLI tests of tests/unit and
tests/models run it, and how they read what it printed. A real process (tests/system) is only for what
only one can show: a real signal, the console script's exit codes, a fresh interpreter."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Result:
    """What one `moeviz` command did: its exit code and what it printed."""

    code: int
    out: str
    err: str

    @property
    def messages(self) -> list[str]:
        return messages(self.err)

    def one_line(self, *needles: str) -> str:
        """The one `moeviz:` line of stderr (asserted: exactly one, no traceback), containing `needles`."""
        return one_line(self.err, *needles)


def exit_code(exc: SystemExit) -> int:
    """The status a process ending with `exc` exits with (argparse: 2 for a usage error, 0 for --help)."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Result:
    """`moeviz ARGV` in this process; the exit code it would have (argparse's SystemExit included) and its
    stdout and stderr. A KeyboardInterrupt escaping `main` fails the test: `main` must turn it into 130."""
    capsys.readouterr()  # what earlier steps of the test printed is not this command's
    with _transformers_logs_to_stderr():
        try:
            code = main_code(list(argv))
        except KeyboardInterrupt:
            pytest.fail("KeyboardInterrupt escaped moeviz.cli.main")
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


def main_code(argv: Sequence[str]) -> int:
    """`moeviz.cli.main(argv)`, argparse's SystemExit turned into the code it exits with."""
    from moeviz.cli import main

    try:
        return main(list(argv))
    except SystemExit as exc:
        return exit_code(exc)


@contextmanager
def _transformers_logs_to_stderr() -> Iterator[None]:
    """Point transformers' log handler at this test's stderr while a command runs, as in a process of its own.

    transformers binds its handler to whatever `sys.stderr` was when it first logged; under pytest that may be
    an earlier test's capture, closed since (a log line then prints a "--- Logging error ---" traceback).
    Afterwards it writes to the real stderr (fd 2, which pytest captures per test)."""

    def point(stream: Any) -> None:
        hf_logging = sys.modules.get("transformers.utils.logging")
        handler = getattr(hf_logging, "_default_handler", None)
        if handler is not None:
            handler.setStream(stream)
            handler.flush = stream.flush  # transformers binds the flush of the stream it first saw

    point(sys.stderr)
    try:
        yield
    finally:
        point(sys.__stderr__)


def messages(err: str) -> list[str]:
    """The `moeviz:` lines of stderr (a progress bar redraws with \\r: only a line's last redraw counts)."""
    lines = (line.split("\r")[-1].strip() for line in err.splitlines())
    return [line for line in lines if line.startswith("moeviz:")]


def one_line(err: str, *needles: str) -> str:
    """The one `moeviz:` line of `err`: no traceback, exactly one such line, and it contains `needles`."""
    assert "Traceback" not in err, err
    found = messages(err)
    assert len(found) == 1, err
    for needle in needles:
        assert needle in found[0], found[0]
    return found[0]


def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a model is loaded (a refusal that must come before any load or forward): every name
    the commands load through (`moeviz.load_model`, `moeviz.models.load_model` and the function itself)."""
    import moeviz
    import moeviz.models
    import moeviz.models.loading

    def load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded before the refusal")

    for module in (moeviz, moeviz.models, moeviz.models.loading):
        monkeypatch.setattr(module, "load_model", load)
