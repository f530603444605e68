"""On-disk layout of a routing store: many runs (model × checkpoint) in one folder of Parquet part files.

    STORE/
      store.json                                   {"format": "moeviz.store/1"}
      model=<model>/checkpoint=<checkpoint>/
        run.json                                   what was traced: model source, corpus, chunking, schema
        manifest.jsonl                             one line per completed batch (appended after its part)
        part-000000.parquet ...                    one file per batch, written to a hidden temp name first

A batch counts as done only when its line is in the manifest; the line is appended after the part file was
renamed into place, so a run killed at any instant leaves either a complete, listed part, an unlisted part
(rewritten on resume), a hidden temp file (removed on resume) or a torn last manifest line (ignored).
Every `.parquet` file under the store must be a listed part with the recorded size and content hash:
anything else (a foreign, corrupt or symlinked file, a part of an interrupted batch) is reported by
`validate_store`, never read.

Integrity: each manifest entry records the part's size and sha256 (of the file bytes, computed when the
part is finalised). `validate_store` checks size and hash of every part; a `StoreQuery` checks size and
hash of the parts of the runs it opens (even with `validate=False`), each part hashed once per process
while its size, mtime and inode stay the same; `--resume` re-traces a listed part that fails the check.
Entries written before hashes were recorded are checked by size and Parquet footer only ("unverified").
Manifest entries are trusted only as far as: complete (every field of `PART_FIELDS`), a plain `.parquet`
file name in the run folder (no separator, no `..`, not hidden), a regular file (not a symlink), no batch
or file listed twice.

Writers: one per run. The writer holds an exclusive `flock` on `.lock` in the run folder from
`prepare_run` to `finish_run` (`run_lock`); a second writer is refused at once with the holder's pid.
Temp files carry their writer's pid (`.NAME.PID.tmp`); only those of dead pids are removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeviz.errors import StoreError
from moeviz.store.run_file import read_run_file
from moeviz.trace import pid_alive, writing_atomically

STORE_FORMAT = "moeviz.store/1"
STORE_FILE = "store.json"
RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.jsonl"
LOCK_FILE = ".lock"
# what a manifest entry must hold (plus "sha256" since content hashes are recorded; older entries lack it)
PART_FIELDS = {"batch": int, "file": str, "rows": int, "bytes": int, "tokens": int, "token_hash": str}
_PART_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*\.parquet$")
_TEMP_PID = re.compile(r"^\..+\.(\d+)\.tmp$")
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def check_label(label: str, what: str) -> str:
    """A model or checkpoint label: letters, digits and ._+- (it names a folder)."""
    if not _LABEL.match(label):
        raise StoreError(
            f"{what} label {label!r} is not usable as a folder name: use letters, digits and . _ + - "
            "(at most 128 characters, starting with a letter or digit)"
        )
    return label


def slug(text: str) -> str:
    """A label made from any text (a model path, a sample name): unsafe characters become '-'."""
    cleaned = re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-._+") or "model"
    return cleaned[:128]


def run_dir(root: Path, model: str, checkpoint: str) -> Path:
    return root / f"model={model}" / f"checkpoint={checkpoint}"


def part_name(batch: int) -> str:
    return f"part-{batch:06d}.parquet"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a hidden temp file + rename (readers never see half a file)."""
    with writing_atomically(path, temp=path.with_name(f".{path.name}.{os.getpid()}.tmp")) as handle:
        handle.write(data)


def init_store(root: Path) -> Path:
    """Create the store folder (or check that an existing, non-empty folder is a store)."""
    root = Path(root)
    marker = root / STORE_FILE
    if root.exists() and not root.is_dir():
        raise StoreError(f"store {root} exists and is not a folder")
    # another writer creating the same store has made the folder and is writing the marker's temp file
    marker_temp = f".{STORE_FILE}."
    foreign = [p for p in root.iterdir() if not p.name.startswith(marker_temp)] if root.is_dir() else []
    if not marker.is_file() and foreign:
        raise StoreError(f"{root} is a non-empty folder that is not a moeviz store (no {STORE_FILE})")
    root.mkdir(parents=True, exist_ok=True)
    if not marker.is_file():
        atomic_write_bytes(marker, json.dumps({"format": STORE_FORMAT}).encode())
    check_store_marker(root)
    return root


def check_store_marker(root: Path) -> None:
    marker = Path(root) / STORE_FILE
    if not marker.is_file():
        raise StoreError(f"{root} is not a moeviz store (no {STORE_FILE}); create one with `moeviz trace`")
    try:
        fmt = json.loads(marker.read_text()).get("format")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise StoreError(f"{marker} is not valid JSON: {exc}") from exc
    if fmt != STORE_FORMAT:
        raise StoreError(f"{root}: store format {fmt!r}, expected {STORE_FORMAT!r}")


def _check_entry(path: Path, number: int, entry: Any) -> None:
    """Refuse (StoreError) a manifest entry that is incomplete or names anything but a plain part file."""
    where = f"{path}: line {number}"
    if not isinstance(entry, dict):
        raise StoreError(f"{where} is not a manifest entry (a JSON object)")
    missing = [name for name in PART_FIELDS if name not in entry]
    if missing:
        raise StoreError(f"{where} is incomplete: missing {', '.join(missing)}")
    for name, kind in PART_FIELDS.items():
        value = entry[name]
        if not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, int) and value < 0):
            raise StoreError(f"{where}: {name} = {value!r} is not a valid {kind.__name__}")
    if "sha256" in entry and not re.fullmatch(r"[0-9a-f]{64}", str(entry["sha256"])):
        raise StoreError(f"{where}: sha256 = {entry['sha256']!r} is not a sha256 hex digest")
    name = entry["file"]
    if "/" in name or "\\" in name or ".." in name or not _PART_FILE.match(name):
        raise StoreError(
            f"{where}: file {name!r} is not a plain part file name in the run folder (no path separators, "
            "no '..', a .parquet name): refusing to read outside the run"
        )


def read_manifest(path: Path) -> dict[int, dict[str, Any]]:
    """Completed batches {batch: entry}; a torn last line (a kill mid-append) is ignored.

    Every entry is checked (`_check_entry`); a batch or file listed twice is refused (StoreError)."""
    done: dict[int, dict[str, Any]] = {}
    files: dict[str, int] = {}
    if not path.is_file():
        return done
    lines = path.read_text(encoding="utf-8").split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # the unterminated last line: the append was cut short
                continue
            raise StoreError(f"{path}: line {number} is not valid JSON") from None
        _check_entry(path, number, entry)
        batch, name = entry["batch"], entry["file"]
        if batch in done:
            raise StoreError(f"{path}: line {number} lists batch {batch} a second time (duplicate entry)")
        if name in files:
            raise StoreError(
                f"{path}: line {number} lists {name} a second time (duplicate entry; first: batch "
                f"{files[name]})"
            )
        done[batch] = entry
        files[name] = batch
    return done


def write_manifest(path: Path, entries: list[dict[str, Any]]) -> None:
    """Replace the manifest with `entries` atomically (resume drops the entries of damaged parts)."""
    atomic_write_bytes(path, b"".join((json.dumps(e, sort_keys=True) + "\n").encode() for e in entries))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# parts whose hash matched in this process: (path, size, mtime_ns, ctime_ns, inode, sha256)
_VERIFIED: set[tuple] = set()


def check_part(
    folder: Path, entry: dict[str, Any], *, cached: bool = False, content: bool = True
) -> str | None:
    """Why the listed part `entry` of the run in `folder` cannot be trusted (None: it can).

    Checks: a regular file (not a symlink) of the recorded size and, when the manifest records one, the
    recorded sha256. `cached`: skip re-hashing a part already verified in this process while its size,
    mtime and inode are unchanged (a query's cheap path; `validate_store` always hashes). `content=False`:
    the file checks only, no hash."""
    path = folder / entry["file"]
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return f"{entry['file']}: listed in the manifest but missing"
    if stat.S_ISLNK(info.st_mode):
        return f"{entry['file']}: a symlink, not a part file (refused: it may point outside the store)"
    if not stat.S_ISREG(info.st_mode):
        return f"{entry['file']}: not a regular file"
    if info.st_size != entry["bytes"]:
        recorded = entry["bytes"]
        return (
            f"{entry['file']}: {info.st_size} bytes, the manifest recorded {recorded} (corrupt or replaced)"
        )
    want = entry.get("sha256")
    if want is None or not content:
        return None
    key = (str(path), info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, want)
    if cached and key in _VERIFIED:
        return None
    got = sha256_file(path)
    if got != want:
        _VERIFIED.discard(key)
        return f"{entry['file']}: content hash differs from the manifest's sha256 (corrupt or modified)"
    _VERIFIED.add(key)
    return None


def remove_stale_temps(folder: Path) -> list[Path]:
    """Remove the hidden temp files of writers that are no longer running (their pid is in the name);
    returns them. Temp files of a live pid are left alone."""
    removed = []
    for tmp in folder.glob(".*.tmp"):
        match = _TEMP_PID.match(tmp.name)
        if match and pid_alive(int(match.group(1))):
            continue
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


class RunLock:
    """An exclusive, non-blocking writer lock on a run folder (`flock` on its `.lock` file).

    Held by an open file: released on `release()` or when the process dies (a kill leaves no stale lock).
    A second writer (another process, or another open in this one) gets a StoreError naming the holder."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            holder = self.path.read_text(errors="replace").strip() or "unknown"
            raise StoreError(
                f"run {self.folder} is being written by another writer ({holder}); one writer per run: "
                "wait for it to finish (or stop it), then continue with --resume"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the file drops the flock
            self.fd = None


@contextmanager
def run_lock(folder: Path) -> Iterator[RunLock]:
    """Hold the writer lock of the run in `folder` (created) for the block; see `RunLock`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = RunLock(folder).acquire()
    try:
        yield lock
    finally:
        lock.release()


def append_manifest(path: Path, entry: dict[str, Any], *, check_tail: bool = True) -> None:
    """Append one completed batch (one `write` of one line with O_APPEND; fsynced).

    `check_tail`: first make sure the file ends with a newline (a torn line left by a kill must not glue
    onto this one); a writer that appended the last line itself (under the run lock) may skip the look."""
    data = (json.dumps(entry, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if check_tail and os.fstat(fd).st_size and not _ends_with_newline(path):
            data = b"\n" + data
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"


@dataclass
class RunInfo:
    """One traced run in a store: its labels, what it was traced with, and its completed parts."""

    model: str
    checkpoint: str
    path: Path
    config: dict[str, Any]
    parts: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return (
            self.config.get("total_batches") is not None and len(self.parts) == self.config["total_batches"]
        )

    @property
    def checkpoint_index(self) -> int:
        return int(self.config.get("checkpoint_index", 0))

    @property
    def files(self) -> list[Path]:
        return [self.path / self.parts[b]["file"] for b in sorted(self.parts)]

    @property
    def rows(self) -> int:
        return sum(int(p["rows"]) for p in self.parts.values())

    @property
    def tokens(self) -> int:
        return sum(int(p["tokens"]) for p in self.parts.values())


def list_runs(root: Path) -> list[RunInfo]:
    """Every run in the store, ordered by model, then checkpoint index, then checkpoint label."""
    root = Path(root)
    check_store_marker(root)
    runs = [read_run(run_json.parent) for run_json in sorted(root.glob(f"model=*/checkpoint=*/{RUN_FILE}"))]
    return sorted(runs, key=lambda r: (r.model, r.checkpoint_index, r.checkpoint))


def read_run(folder: Path) -> RunInfo:
    """The run in `folder` (`run_dir(store, model, checkpoint)`): its run.json and completed parts."""
    config = read_run_file(folder / RUN_FILE)
    model = folder.parent.name.removeprefix("model=")
    checkpoint = folder.name.removeprefix("checkpoint=")
    return RunInfo(model, checkpoint, folder, config, read_manifest(folder / MANIFEST_FILE))


def validate_store(root: Path, check_schema: bool = True, *, notes: list[str] | None = None) -> list[str]:
    """Problems that make the store unsafe to query, one sentence each (empty list = clean).

    Every `.parquet` file must be a regular file (not a symlink) listed in its run's manifest with the
    recorded size and sha256 (every part is hashed: the full check), and (with `check_schema`) have a
    readable Parquet footer carrying this store's schema tag. A manifest that cannot be trusted (an entry
    outside the run folder, incomplete or duplicated) raises StoreError. Parts whose entry records no hash
    (written by an older moeviz) are checked by size and footer only; each is named, as "unverified", in
    `notes` when a list is given."""
    import pyarrow.parquet as pq

    from moeviz.store.schema import SCHEMA_TAG

    root = Path(root)
    runs = list_runs(root)
    listed: dict[Path, tuple[RunInfo, dict[str, Any]]] = {}
    problems = []
    for run in runs:
        for entry in run.parts.values():
            listed[run.path / entry["file"]] = (run, entry)
    for path in sorted(root.rglob("*.parquet")):
        if path.name.startswith("."):
            continue
        shown = path.relative_to(root)
        hit = listed.pop(path, None)
        if hit is None:
            problems.append(
                f"{shown}: not part of any run in the store (a foreign file, or the part "
                "of a batch an interrupted run did not finish: resume that run with --resume or remove it)"
            )
            continue
        run, entry = hit
        problem = check_part(run.path, entry, content=False)
        if problem is not None:
            problems.append(f"{shown.parent / problem}")
            continue
        if check_schema:
            try:
                meta = pq.read_metadata(path).metadata or {}
            except Exception as exc:  # pyarrow raises several types for a damaged footer
                problems.append(f"{shown}: not a readable Parquet file ({exc})")
                continue
            if meta.get(b"moeviz.store") != SCHEMA_TAG.encode():
                problems.append(f"{shown}: a Parquet file without this store's schema tag")
                continue
        problem = check_part(run.path, entry)  # the content hash, once the cheaper checks passed
        if problem is not None:
            problems.append(f"{shown.parent / problem}")
        elif "sha256" not in entry and notes is not None:
            notes.append(f"{shown}: unverified (its manifest entry records no content hash)")
    for path in listed:
        problems.append(f"{path.relative_to(root)}: listed in the manifest but missing")
    return problems
