"""The example prompt's routing shipped with the bundled sample models (`sample_models/examples/`): a new
install draws the app's first page from it without torch, a model load or a capture, as a later start does
from a kept trace (`moeviz.trace.kept`).

`sample_models/examples/manifest.json` maps a sample's name to its Trace Parquet file (routing, no
attention) and the key it was captured under (`content_key`): the SHA-256 of the text, the load options, the
versions of torch and transformers, the machine's architecture, the trace format, and the name, size and
SHA-256 of every file in the sample's folder. Content, not modification times: a fresh clone's files are
new but the same. Any of these that differs here reads as absent (the app then captures), so a bundled trace
is only shown where this install reads the same files with the same libraries. That the current code
captures the same routing (experts exactly, scores within float32 rounding: sums may run in another order on
another machine) is the suite's check (tests/models/test_bundled_examples.py);
`scripts/samples/bundle_examples.py` writes them. Read only when keeping is on (`MOEVIZ_CACHE_DIR` not set
empty: set empty, every example is captured). No torch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
from pathlib import Path

from moeviz.errors import TraceFormatError
from moeviz.models.sources import sample_models_dir
from moeviz.settings import current_settings
from moeviz.trace.atomic import writing_atomically
from moeviz.trace.kept import folder_files, installed
from moeviz.trace.model import Trace
from moeviz.trace.parquet import TRACE_FORMAT

EXAMPLES = "examples"  # the folder under sample_models/
MANIFEST = "manifest.json"


def examples_dir() -> Path:
    return sample_models_dir() / EXAMPLES


def content_facts(folder: str | Path, text: str, options: str = "") -> dict:
    """Everything a bundled example's routing depends on (see the module docstring), as JSON-able facts."""
    return {
        "format": TRACE_FORMAT,
        "versions": {"torch": installed("torch"), "transformers": installed("transformers")},
        "machine": platform.machine(),
        "options": options,
        "files": _file_digests(Path(folder).resolve(), tuple(folder_files(Path(folder)))),
        "text": text,
    }


def content_key(folder: str | Path, text: str, options: str = "") -> str:
    """The hex SHA-256 of `content_facts`."""
    return _key(content_facts(folder, text, options))


def _key(facts: dict) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


@functools.lru_cache(maxsize=16)
def _file_digests(folder: Path, files: tuple[tuple[str, int, int], ...]) -> list[list]:
    """[path, size, SHA-256] of each of `files` (`folder_files`: their stat facts key the cache, so a
    file is hashed again only after it changed); lists, as JSON reads them back."""
    digests = []
    for name, size, _ in files:
        with open(folder / name, "rb") as handle:
            digests.append([name, size, hashlib.file_digest(handle, "sha256").hexdigest()])
    return digests


def _manifest() -> dict[str, dict]:
    try:
        manifest = json.loads((examples_dir() / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def bundled_trace(folder: str | Path, text: str, options: str = "") -> Trace | None:
    """The bundled routing of `text` by the sample model in `folder` loaded with `options`, or None: not a
    bundled sample, none shipped for it, a key that differs here, keeping turned off, or a file that does
    not read (left in place: it is the package's)."""
    if current_settings().cache_dir is None:
        return None
    folder = Path(folder).resolve()
    if folder.parent != sample_models_dir().resolve():
        return None
    entry = _manifest().get(folder.name)
    if not isinstance(entry, dict) or entry.get("key") != content_key(folder, text, options):
        return None
    try:
        return Trace.from_parquet(examples_dir() / str(entry.get("file")))
    except (TraceFormatError, OSError):
        return None


def bundle_trace(folder: str | Path, text: str, options: str, trace: Trace) -> Path:
    """Write `trace` (its routing) as the bundled example of the sample in `folder`, and its manifest entry
    with the key and the facts it was made from (both files atomically). → the Parquet file."""
    folder = Path(folder).resolve()
    if folder.parent != sample_models_dir().resolve():
        raise ValueError(f"{folder} is not a bundled sample model (a folder of {sample_models_dir()})")
    examples_dir().mkdir(exist_ok=True)
    path = trace.to_parquet(examples_dir() / f"{folder.name}.parquet")
    facts = content_facts(folder, text, options)
    manifest = {**_manifest(), folder.name: {"file": path.name, "key": _key(facts), "facts": facts}}
    with writing_atomically(examples_dir() / MANIFEST) as handle:
        handle.write((json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return path
