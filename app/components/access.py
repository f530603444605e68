"""Which models and stores this server may open: model sources and the allowed folders
(`MOEVIZ_MODEL_DIRS`, `MOEVIZ_STORE_DIRS`, read through `moeviz.settings`). No Streamlit here."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import moeviz
from moeviz.errors import ModelSourceError
from moeviz.models.loading import DEFAULT_SAMPLE
from moeviz.settings import current_settings

SAMPLE_PREFIX = "sample:"
LOCAL_FOLDER = "Local folder…"

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
    """`text` resolved (symlinks followed); FolderNotAllowedError unless inside `allowed_roots(kind)`."""
    folder = Path(text).expanduser().resolve()
    roots = allowed_roots(kind)
    if roots is not None and not any(folder.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(root) for root in roots)
        raise FolderNotAllowedError(f"{folder} is outside the {kind} folders this server may open: {allowed}")
    return folder


def roots_hint(kind: Kind) -> str:
    """A widget help text: where folders of `kind` may be opened from."""
    roots = allowed_roots(kind)
    return "Any local folder." if roots is None else "Inside: " + ", ".join(map(str, roots))


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
