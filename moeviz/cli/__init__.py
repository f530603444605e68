"""The `moeviz` command: one argparse tree over every verb, and `main`, the console entry point.

One module per verb, each with `add_parser(commands)` and the run function it binds as `args.run`:
`capture` (moeviz.cli.capture), `report` (moeviz.cli.report), `checkpoints` (moeviz.cli.checkpoints; also
`report --checkpoints`), `trace` (moeviz.cli.trace), `whatif` (moeviz.cli.whatif), `import`
(moeviz.cli.engine_import), `diff` (moeviz.cli.diff), `finetune-diff` (moeviz.cli.finetune_diff) and `app`
(moeviz.cli.app). Shared flags: moeviz.cli.flags; what is printed: moeviz.cli.output; exit codes and one-line
failures: moeviz.cli.exits.

Nothing heavy loads with the parser: torch, transformers and pandas are imported inside the run functions,
so `moeviz --version` and `--help` answer at once, and Ctrl-C while they load exits with one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from moeviz.cli import app, capture, checkpoints, diff, engine_import, finetune_diff, report, trace, whatif
from moeviz.cli.app import APP_FLAGS, run_app
from moeviz.cli.capture import format_summary
from moeviz.cli.exits import (
    ENVIRONMENT_ERRNOS,
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_VERDICT,
    environment_message,
    one_line,
)
from moeviz.cli.flags import REPORT_CHUNK_TOKENS
from moeviz.errors import MoevizError

__all__ = [
    "APP_FLAGS",
    "EXIT_BAD_INPUT",
    "EXIT_INTERRUPTED",
    "EXIT_VERDICT",
    "REPORT_CHUNK_TOKENS",
    "build_parser",
    "format_summary",
    "main",
    "one_line",
    "package_version",
    "run_app",
]
# in the order `moeviz --help` lists them
VERBS = (capture, report, checkpoints, trace, whatif, engine_import, diff, finetune_diff, app)


def package_version() -> str:
    """The version `moeviz --version` prints: `moeviz.__version__`."""
    import moeviz

    return moeviz.__version__


class _VersionAction(argparse.Action):
    """`--version`, looking the version up only when asked: importlib.metadata (and the email package it
    imports) would otherwise be a good part of every command's start-up."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        kwargs.setdefault("help", "show the version of moeviz and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(f"moeviz {package_version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeviz", description="A microscope for Mixture-of-Experts models.")
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for verb in VERBS:
        verb.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the CLI never downloads; the library leaves env alone
    if argv[:1] == ["app"] and not {"-h", "--help"} & set(argv[1:2]):
        return run_app(argv[1:])  # everything after `app` belongs to Streamlit, flags included
    args = None
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "check", None) is not None:
            args.check(args)
        return args.run(args)
    except MoevizError as exc:
        print(f"moeviz: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # `trace` handles its own (its completed batches are kept)
        written = "; nothing was written" if getattr(args, "command", None) == "capture" else ""
        print(f"moeviz: interrupted{written}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        if exc.errno not in ENVIRONMENT_ERRNOS:
            raise
        print(f"moeviz: error: {environment_message(args, exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
