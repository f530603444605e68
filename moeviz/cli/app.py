"""`moeviz app [STREAMLIT ARGS...]`: start the Streamlit app, with the Streamlit flags it needs."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

# Streamlit runs a full gc.collect(2) after every script run; with torch and transformers loaded that adds
# 0.2-0.4 s to every click (Python's generational collector still runs on its own). Uploads are prompt
# files: 1 MB is far beyond any context (the app checks the size again).
# server.maxUploadSize is in MB: the server takes 2**20 bytes per unit, the browser 10**6 (2**20 on Windows)
# and refuses a larger file itself, without a word. 2 lets through any file the prompt form may refuse with
# its own message (over 1 MiB, `PROMPT_FILE_LIMIT` in app/components/prompt.py).
# The app is a local tool: no usage statistics leave the machine, and the toolbar has no Deploy button.
# No page writes by "magic" (a bare expression shown as st.write: tests/unit/test_cli_flags.py checks), and
# its AST rewrite cost ~0.1 s of each page's first run on a new server.
APP_FLAGS = (
    *("--runner.postScriptGC", "false", "--server.maxUploadSize", "2"),
    *("--browser.gatherUsageStats", "false", "--client.toolbarMode", "minimal"),
    *("--runner.magicEnabled", "false"),
)


def add_parser(commands: Any) -> None:
    """Only for `moeviz app --help`: `moeviz.cli.main` hands everything after `app` to Streamlit."""
    app = commands.add_parser(
        "app", help="start the Streamlit app; extra arguments go to `streamlit run` (e.g. --server.port 8502)"
    )
    app.add_argument("streamlit_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    app.set_defaults(run=lambda args: run_app(args.streamlit_args))


def run_app(streamlit_args: Sequence[str]) -> int:
    """Replace this process with `streamlit run <app>/serve.py ...` (Streamlit's env config applies): the
    pages of streamlit_app.py, served with what every page imports loaded as the server starts; the app is
    the checkout's app/ or, installed from a wheel, the copy inside the package."""
    from moeviz.resources import bundled_path
    from moeviz.settings import current_settings

    current_settings()  # a MOEVIZ_* value the app cannot use stops here (exit 2), not on a page later
    extra = list(streamlit_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    script = bundled_path("app") / "serve.py"
    argv = [sys.executable, "-m", "streamlit", "run", str(script), *APP_FLAGS, *extra]
    os.execv(sys.executable, argv)
    return 0  # not reached
