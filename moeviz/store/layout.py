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
Every `.parquet` file under the store must be a listed part with the recorded size: anything else (a
foreign or corrupt file, a part of an interrupted batch) is reported by `validate_store`, never read.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeviz.errors import MoevizError

STORE_FORMAT = "moeviz.store/1"
STORE_FILE = "store.json"
RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.jsonl"
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


class StoreError(MoevizError):
    """The store folder is unusable: not a store, corrupt or foreign files, or a mismatched resume."""


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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def init_store(root: Path) -> Path:
    """Create the store folder (or check that an existing, non-empty folder is a store)."""
    root = Path(root)
    marker = root / STORE_FILE
    if root.exists() and not root.is_dir():
        raise StoreError(f"store {root} exists and is not a folder")
    if root.is_dir() and not marker.is_file() and any(root.iterdir()):
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


def read_manifest(path: Path) -> dict[int, dict[str, Any]]:
    """Completed batches {batch: entry}; a torn last line (a kill mid-append) is ignored."""
    done: dict[int, dict[str, Any]] = {}
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
        done[int(entry["batch"])] = entry
    return done


def append_manifest(path: Path, entry: dict[str, Any]) -> None:
    """Append one completed batch (one `write` of one line with O_APPEND; fsynced)."""
    data = (json.dumps(entry, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        # a torn line left by a kill must not glue onto this one
        if os.fstat(fd).st_size and not _ends_with_newline(path):
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
    run_json = folder / RUN_FILE
    try:
        config = json.loads(run_json.read_text())
    except json.JSONDecodeError as exc:
        raise StoreError(f"{run_json} is not valid JSON: {exc}") from exc
    model = folder.parent.name.removeprefix("model=")
    checkpoint = folder.name.removeprefix("checkpoint=")
    return RunInfo(model, checkpoint, folder, config, read_manifest(folder / MANIFEST_FILE))


def validate_store(root: Path, check_schema: bool = True) -> list[str]:
    """Problems that make the store unsafe to query, one sentence each (empty list = clean).

    Every `.parquet` file must be a part listed in its run's manifest with the recorded size, and (with
    `check_schema`) have a readable Parquet footer carrying this store's schema tag."""
    import pyarrow.parquet as pq

    from moeviz.store.schema import SCHEMA_TAG

    root = Path(root)
    runs = list_runs(root)
    listed: dict[Path, tuple[RunInfo, dict[str, Any]]] = {}
    problems = []
    for run in runs:
        for entry in run.parts.values():
            listed[(run.path / entry["file"]).resolve()] = (run, entry)
    for path in sorted(root.rglob("*.parquet")):
        if path.name.startswith("."):
            continue
        hit = listed.pop(path.resolve(), None)
        if hit is None:
            problems.append(
                f"{path.relative_to(root)}: not part of any run in the store (a foreign file, or the part "
                "of a batch an interrupted run did not finish: resume that run with --resume or remove it)"
            )
            continue
        run, entry = hit
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append(
                f"{path.relative_to(root)}: {size} bytes, the manifest recorded {entry['bytes']} (corrupt "
                "or replaced)"
            )
            continue
        if check_schema:
            try:
                meta = pq.read_metadata(path).metadata or {}
            except Exception as exc:  # pyarrow raises several types for a damaged footer
                problems.append(f"{path.relative_to(root)}: not a readable Parquet file ({exc})")
                continue
            if meta.get(b"moeviz.store") != SCHEMA_TAG.encode():
                problems.append(f"{path.relative_to(root)}: a Parquet file without this store's schema tag")
    for path, (_run, _entry) in listed.items():
        problems.append(f"{path.relative_to(root.resolve())}: listed in the manifest but missing")
    return problems
