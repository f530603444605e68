"""Which models and stores this server may open: model sources and the allowed folders
(`MOEVIZ_MODEL_DIRS`, `MOEVIZ_STORE_DIRS`, read through `moeviz.settings`). No Streamlit here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import moeviz
from moeviz.errors import ModelSourceError
from moeviz.models.sources import DEFAULT_SAMPLE, SAMPLE_PREFIX
from moeviz.settings import current_settings

LOCAL_FOLDER = "Local folder…"
LAB_PREFIX = "lab: "  # a model trained on the Lab page, in its session's picker only

# Folders the Lab page saved its trained models in (this server made them): opened wherever
# MOEVIZ_MODEL_DIRS points, like the bundled samples.
_LAB_FOLDERS: set[Path] = set()

Kind = Literal["model", "store"]


class FolderNotAllowedError(ModelSourceError):
    """The folder lies outside the roots this server was told to serve (`MOEVIZ_MODEL_DIRS` for models,
    `MOEVIZ_STORE_DIRS` for stores)."""


def allowed_roots(kind: Kind) -> list[Path] | None:
    """The folders `kind` ("model" or "store") may be opened from (resolved); None = any folder."""
    settings = current_settings()
    roots = settings.model_dirs if kind == "model" else settings.store_dirs
    return None if roots is None else list(roots)


def folder_inside(text: str, kind: Kind) -> Path:
    """`text` resolved (symlinks followed); FolderNotAllowedError unless inside `allowed_roots(kind)`, and
    unless every file and folder under it resolves inside them too (`check_links`)."""
    folder = Path(text).expanduser().resolve()
    roots = allowed_roots(kind)
    if roots is None or (kind == "model" and folder in _LAB_FOLDERS):
        return folder
    if not roots:
        variable = "MOEVIZ_MODEL_DIRS" if kind == "model" else "MOEVIZ_STORE_DIRS"
        raise FolderNotAllowedError(
            f"this server opens no local {kind} folders ({variable} is set but names none)"
        )
    if not _inside(folder, roots):
        allowed = ", ".join(str(root) for root in roots)
        raise FolderNotAllowedError(f"{folder} is outside the {kind} folders this server may open: {allowed}")
    check_links(folder, kind)
    return folder


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path.is_relative_to(root) for root in roots)


def check_links(folder: Path, kind: Kind) -> None:
    """FolderNotAllowedError if a link anywhere under `folder` (a model's config, tokenizer or weight file,
    a checkpoint of a series, a store's run folder or file) leads outside `allowed_roots(kind)`: loads and
    stores open the files under the folder, so the allowlist must hold for each. Only links are resolved
    (a plain entry lies where its folder lies); linked folders inside the roots are walked too, once. The
    message names the link, never what it points to."""
    roots = allowed_roots(kind)
    if roots is None or not folder.is_dir():
        return
    pending, seen = [folder], {folder}
    while pending:
        current = pending.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:
            continue  # unreadable: the load or store reports it
        for entry in entries:
            path = Path(entry.path)
            if entry.is_symlink():
                target = path.resolve()
                if not _inside(target, roots):
                    name = path.relative_to(folder) if path.is_relative_to(folder) else path
                    raise FolderNotAllowedError(
                        f"{name} in {folder} links outside the {kind} folders this server may open: refused"
                    )
                if target.is_dir() and target not in seen:
                    seen.add(target)
                    pending.append(target)
            elif entry.is_dir(follow_symlinks=False):
                pending.append(path)


def check_series(text: str) -> str:
    """A checkpoint series typed in the app, each part checked like a model folder: one folder of checkpoint
    folders, or checkpoint folders separated by commas. Split first: as one path, `ALLOWED/x,OUTSIDE/s`
    lies inside ALLOWED, but the series reads OUTSIDE/s."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise ModelSourceError("enter the path of a folder of checkpoint folders (or A,B,C)")
    return ",".join(str(folder_inside(part, "model")) for part in parts)


def allow_lab_folder(folder: Path) -> None:
    """Let the app open `folder`, a model the Lab page trained and saved, whatever MOEVIZ_MODEL_DIRS says."""
    _LAB_FOLDERS.add(Path(folder).resolve())


def roots_hint(kind: Kind) -> str:
    """A widget help text: where folders of `kind` may be opened from."""
    roots = allowed_roots(kind)
    if roots is None:
        return "Any local folder."
    return "Inside: " + ", ".join(map(str, roots)) if roots else "No local folder: this server opens none."


def default_model() -> str:
    """`MOEVIZ_DEFAULT_MODEL` if set, else the healthy Mixtral sample."""
    return current_settings().default_model or DEFAULT_SAMPLE


def check_source(source: str) -> str:
    """Normalise a model source; a folder must resolve (symlinks followed) inside `MOEVIZ_MODEL_DIRS`."""
    text = source.strip()
    if text.startswith(SAMPLE_PREFIX):
        return text
    if not text:
        raise ModelSourceError("enter the path of a local Hugging Face model folder")
    return str(folder_inside(text, "model"))


def sample_sources() -> list[str]:
    """The model sources of the bundled samples (`sample:<name>`)."""
    return [f"{SAMPLE_PREFIX}{name}" for name in moeviz.list_samples()]
