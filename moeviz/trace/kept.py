"""Captured traces kept on disk between processes: a capture's routing, filed under a key of everything it
depends on, so that a new process shows it without loading torch or the model (the app's first page).

The key (`trace_key`) is the SHA-256 of the text, the load options, the versions of moeviz (with its
newest source file's time), torch and transformers, the trace format, and the name, size and modification
time of every file in the model's folder: a changed weight file, another dtype or an upgrade files the
capture under another key, and a stale file is never read for a new one. Files are Trace Parquet files
(`Trace.to_parquet`, validated on read), written atomically under `MOEVIZ_CACHE_DIR`/traces; the newest
`KEPT_TRACES` are kept. A file that fails validation is removed and reads as absent; a folder that cannot be
written keeps nothing. No torch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

from moeviz.errors import TraceFormatError
from moeviz.settings import current_settings
from moeviz.trace.model import Trace
from moeviz.trace.parquet import TRACE_FORMAT

KEPT_TRACES = 16  # files kept; each model's example prompt is one


@functools.cache
def _versions() -> dict[str, str]:
    """The installed versions a capture's numbers depend on (read once: a running process does not
    re-import them)."""
    # a checkout's version stays put while its code changes: its newest source file stands in for a commit
    package = Path(__file__).resolve().parents[1]
    newest = max(path.stat().st_mtime_ns for path in package.rglob("*.py"))
    moeviz = f"{installed('moeviz')} (source {newest})"
    return {"moeviz": moeviz, "torch": installed("torch"), "transformers": installed("transformers")}


def installed(distribution: str) -> str:
    """The installed version of `distribution`, or "absent"."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def folder_files(folder: Path) -> list[tuple[str, int, int]]:
    """(path relative to `folder`, size, modification time in ns) of every file under it, sorted; hidden
    files and folders (caches, partial writes) left out."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.startswith("."):
                continue
            path = Path(root, name)
            stat = path.stat()
            found.append((path.relative_to(folder).as_posix(), stat.st_size, stat.st_mtime_ns))
    return sorted(found)


def trace_key(folder: str | Path, text: str, options: str = "") -> str:
    """The key of the capture of `text` by the model in `folder` loaded with `options` (any string that
    names the load options; "" the defaults): a hex SHA-256 (see the module docstring)."""
    facts = {
        "format": TRACE_FORMAT,
        "versions": _versions(),
        "options": options,
        "files": folder_files(Path(folder)),
        "text": text,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def _folder() -> Path | None:
    root = current_settings().cache_dir
    return None if root is None else root / "traces"


def kept_trace(key: str) -> Trace | None:
    """The trace kept under `key`, or None (none kept, keeping turned off, an unreadable file, or a damaged
    one, removed)."""
    folder = _folder()
    path = None if folder is None else folder / f"{key}.parquet"
    if path is None or not path.is_file():
        return None
    try:
        return Trace.from_parquet(path)
    except TraceFormatError:
        path.unlink(missing_ok=True)
        return None
    except OSError:  # unreadable (permissions, a disk error): as if nothing were kept, like a write
        return None


def keep_trace(key: str, trace: Trace) -> Path | None:
    """Write `trace`'s routing (not its attention) under `key`, atomically, and remove all but the newest
    `KEPT_TRACES` files; the path, or None when nothing could be written (keeping turned off, a folder
    that cannot be made or written): keeping is an optimisation, never an error."""
    folder = _folder()
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = trace.to_parquet(folder / f"{key}.parquet")
        kept = sorted(folder.glob("*.parquet"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in kept[KEPT_TRACES:]:
            old.unlink(missing_ok=True)
    except OSError:
        return None
    return path
