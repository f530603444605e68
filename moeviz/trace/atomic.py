"""Atomic trace files: a write goes to a hidden `.NAME.PID-TOKEN.partial` next to its target, is fsynced and
renamed into place, so a reader never sees half a file; the partials a dead writer left are removed by the
next write to the same file. `pid_alive` tells a live writer's temp files from a dead one's (the corpus
store's temp files carry the pid too)."""

from __future__ import annotations

import glob
import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

_PARTIAL = re.compile(r"^\.(?P<name>.+?)(?:\.(?P<pid>\d+)(?:-[0-9a-f]+)?)?\.partial$")


def remove_stale_partials(path: str | Path) -> list[Path]:
    """Remove the hidden `.NAME.PID-TOKEN.partial` files next to `path` that a dead writer left (killed during
    `Trace.to_parquet`), and unnumbered ones of older versions; a live writer's are kept. Returns them."""
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}*.partial"):
        match = _PARTIAL.match(tmp.name)
        if match is None or match["name"] != path.name:
            continue
        if match["pid"] is not None and pid_alive(int(match["pid"])):
            continue
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host is running (the temp files of a writer carry its pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0  # another user's process (or nonsense)
    return True


@contextmanager
def writing_atomically(path: Path, temp: Path | None = None) -> Iterator[BinaryIO]:
    """A binary handle whose bytes become `path` only once the block ends without error: written to a hidden
    temp file next to it, fsynced, renamed over `path`. On an error the temp file is removed and `path` is
    untouched. `temp` None: this process's `.NAME.PID-TOKEN.partial` (stale partials of dead writers are
    removed first); the corpus store passes its own `.NAME.PID.tmp` names."""
    if temp is None:
        remove_stale_partials(path)
        temp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")
    try:
        with open(temp, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())  # the bytes are on disk before the name says the file is complete
        temp.replace(path)
    finally:
        temp.unlink(missing_ok=True)
