"""Every `MOEVIZ_*` setting, read in one place (documented in the README's "Settings" table).

Read on each call, not at import: a test or a launcher may change the environment between calls, and
importing moeviz never changes the process environment.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from moeviz.errors import SettingsError

SETTINGS_HELP = {
    "MOEVIZ_MODEL_DIRS": "folders (os.pathsep-separated) the app may open models from; unset = any folder, "
    "set but empty = none",
    "MOEVIZ_STORE_DIRS": "folders (os.pathsep-separated) the app may open corpus stores from; unset = any, "
    "set but empty = none",
    "MOEVIZ_DEFAULT_MODEL": "the model the app opens first (a `sample:NAME` or a folder)",
    "MOEVIZ_SAMPLE_MODELS": "where the bundled sample models live (default: the installed sample_models/)",
    "MOEVIZ_LAB_MAX_RUNS": "lab trainings the server runs at once (a whole number, default 2; 0: no Lab)",
    "MOEVIZ_LAB_MEMORY_GIB": "memory all lab trainings may hold together, in GiB (default: a quarter of "
    "the machine's, at most 4)",
    "MOEVIZ_RASTER_ABOVE": "heatmaps with more cells are drawn as one image (default 4000)",
    "MOEVIZ_VLLM_PYTHON": "the python of the vLLM environment live captures run in (default: .venv-vllm)",
    "MOEVIZ_CACHE_DIR": "where the app keeps the example prompt's routing between servers (default: "
    "$XDG_CACHE_HOME/moeviz, else ~/.cache/moeviz); set but empty = kept nowhere, and the bundled samples'"
    " examples not read either",
}


def _roots(raw: str | None) -> tuple[Path, ...] | None:
    """None when the variable is unset (any folder); otherwise its folders, which may be none: a variable set
    to "", ":" or " " allows no folder rather than every one (a setting must not fail open)."""
    if raw is None:
        return None
    return tuple(Path(part.strip()).expanduser().resolve() for part in raw.split(os.pathsep) if part.strip())


@dataclass(frozen=True)
class Settings:
    """The `MOEVIZ_*` environment, parsed. None for a folder list = no restriction."""

    model_dirs: tuple[Path, ...] | None
    store_dirs: tuple[Path, ...] | None
    default_model: str | None
    sample_models: Path | None
    lab_max_runs: int | None  # None: unset (the Lab's default applies); 0: the Lab is disabled
    vllm_python: Path | None = None  # None: the checkout's .venv-vllm (moeviz.engines.vllm)
    lab_memory_gib: float | None = None  # None: unset (moeviz.lab.budget's default)
    raster_above: int | None = None  # None: unset (moeviz.charts.raster's default)
    cache_dir: Path | None = None  # None: nothing kept or read on disk (`MOEVIZ_CACHE_DIR` set but empty)


def current_settings() -> Settings:
    """The settings as the environment holds them now; SettingsError for a value that cannot be used."""
    env = os.environ
    default_model = env.get("MOEVIZ_DEFAULT_MODEL", "").strip()
    samples = env.get("MOEVIZ_SAMPLE_MODELS", "").strip()
    vllm_python = env.get("MOEVIZ_VLLM_PYTHON", "").strip()
    return Settings(
        model_dirs=_roots(env.get("MOEVIZ_MODEL_DIRS")),
        store_dirs=_roots(env.get("MOEVIZ_STORE_DIRS")),
        default_model=default_model or None,
        sample_models=Path(samples).expanduser() if samples else None,
        lab_max_runs=_whole_number(
            "MOEVIZ_LAB_MAX_RUNS", env.get("MOEVIZ_LAB_MAX_RUNS", ""), "lab trainings at once (0: no Lab)"
        ),
        vllm_python=Path(vllm_python).expanduser() if vllm_python else None,
        lab_memory_gib=_gibibytes("MOEVIZ_LAB_MEMORY_GIB", env.get("MOEVIZ_LAB_MEMORY_GIB", "")),
        raster_above=_whole_number("MOEVIZ_RASTER_ABOVE", env.get("MOEVIZ_RASTER_ABOVE", ""), "cells"),
        cache_dir=_cache_dir(env.get("MOEVIZ_CACHE_DIR"), env.get("XDG_CACHE_HOME", "").strip()),
    )


def _cache_dir(raw: str | None, xdg_cache: str) -> Path | None:
    """`MOEVIZ_CACHE_DIR` (None when set but blank: keep nothing), else the XDG cache folder's moeviz/."""
    if raw is not None:
        return Path(raw.strip()).expanduser() if raw.strip() else None
    return (Path(xdg_cache).expanduser() if xdg_cache else Path.home() / ".cache") / "moeviz"


def _whole_number(name: str, raw: str, what: str) -> int | None:
    """A whole number ≥ 0, or unset/blank (None)."""
    text = raw.strip()
    if not text:
        return None
    if not text.isdigit():
        raise SettingsError(f"{name}={raw!r}: expected a whole number of {what}")
    return int(text)


def _gibibytes(name: str, raw: str) -> float | None:
    """A positive, finite number of GiB, or unset/blank (None)."""
    text = raw.strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise SettingsError(f"{name}={raw!r}: expected a positive number of GiB")
    return value
