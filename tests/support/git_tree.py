"""A test run never writes a tracked file: the check the session hook in tests/conftest.py runs.

`tracked_state(repo)` is a snapshot of every tracked file that differs from the index or HEAD: its
`git status` code and a hash of its content (`git status` alone says " M" before and after a run that
rewrote a file already modified, so the content is compared, not only the status). `changed_files(before,
after)` lists what changed between two snapshots. Untracked files, ignored or not, are not tracked and do not
count (tests write to tmp and output folders). Unit-tested on a temporary repository:
tests/unit/test_git_tree.py."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

ABSENT = "absent"  # the content of a tracked file deleted from the working tree


def _content_hash(path: Path) -> str:
    """sha-256 of a file's bytes (of a link: of its target's name); ABSENT when there is nothing there."""
    if path.is_symlink():
        return "link:" + hashlib.sha256(os.readlink(path).encode()).hexdigest()
    if path.is_file():
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()
    return ABSENT


def tracked_state(repo: Path) -> dict[str, str] | None:
    """Path → "<XY status> <content hash>" of every tracked file that `git status` lists as changed (staged
    or not); None outside a git checkout (e.g. an sdist) or without git."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain=v1", "-z", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            timeout=30,
            check=True,
        ).stdout.decode("utf-8", "surrogateescape")
    except (OSError, subprocess.SubprocessError):
        return None
    state: dict[str, str] = {}
    entries = iter(out.split("\0"))
    for entry in entries:
        if not entry:
            continue
        status, path = entry[:2], entry[3:]
        if "R" in status or "C" in status:  # a rename or copy: the source path follows as its own entry
            next(entries, None)
        state[path] = f"{status} {_content_hash(repo / path)}"
    return state


def changed_files(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The paths whose status or content differs between two `tracked_state` snapshots (also a file the run
    put back as it is in HEAD), sorted."""
    return sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))


def change_line(path: str, before: dict[str, str], after: dict[str, str]) -> str:
    """One changed file for a report: "<path> (<status before> → <status after>)", "clean" for a file that
    `git status` does not list (as in HEAD)."""

    def status(state: dict[str, str]) -> str:
        return repr(state[path][:2]) if path in state else "clean"

    return f"{path} ({status(before)} → {status(after)})"
