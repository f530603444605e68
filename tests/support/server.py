"""Start the checkout's Streamlit app on a free port and drive it with Debian's Chromium: shared by the
browser tests and the in-browser benchmark (test code: it needs the repository and a browser)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moeviz.cli import APP_FLAGS

REPO = Path(__file__).resolve().parents[2]
# Debian's chromium (`make chromium` installs it); CHROMIUM overrides the binary.
CHROMIUM = Path(os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium")
# Without the background-networking flags Chromium keeps calling home on a closed network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class AppDidNotStart(RuntimeError):
    """The server exited or never answered its health check; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_app(model: str, start_timeout_s: float = 90) -> Iterator[str]:
    """`streamlit run app/serve.py` (what `moeviz app` runs) on a free local port with `model` as the
    default; yields its URL once healthy and always stops the server."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MOEVIZ_DEFAULT_MODEL": model}
    env.pop("MOEVIZ_MODEL_DIRS", None)
    command = [
        *(sys.executable, "-m", "streamlit", "run", "app/serve.py"),
        *("--server.headless", "true", "--server.port", str(port), "--server.address", "127.0.0.1"),
        *("--server.fileWatcherType", "none", "--browser.gatherUsageStats", "false", *APP_FLAGS),
    ]
    with tempfile.TemporaryFile(mode="w+") as log:
        server = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, server, log, start_timeout_s)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _wait_healthy(url: str, server: subprocess.Popen, log, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise AppDidNotStart(f"streamlit exited with {server.returncode}:\n{log.read()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.status == 200 and response.read().strip() == b"ok":
                    return
        except OSError:
            pass
        time.sleep(0.3)
    log.seek(0)
    raise AppDidNotStart(f"streamlit not healthy after {timeout_s}s:\n{log.read()[-4000:]}")
