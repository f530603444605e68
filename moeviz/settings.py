"""Every `MOEVIZ_*` setting, read in one place (documented in the README's "Settings" table).

Read on each call, not at import: a test or a launcher may change the environment between calls, and
importing moeviz never changes the process environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SETTINGS_HELP = {
    "MOEVIZ_MODEL_DIRS": "folders (os.pathsep-separated) the app may open models from; unset = any folder",
    "MOEVIZ_STORE_DIRS": "folders (os.pathsep-separated) the app may open corpus stores from; unset = any",
    "MOEVIZ_DEFAULT_MODEL": "the model the app opens first (a `sample:NAME` or a folder)",
    "MOEVIZ_SAMPLE_MODELS": "where the bundled sample models live (default: the installed sample_models/)",
    "MOEVIZ_LAB_MAX_RUNS": "lab trainings the server runs at once (a positive integer; default 2)",
    "MOEVIZ_VLLM_PYTHON": "the python of the vLLM environment live captures run in (default: .venv-vllm)",
}


def _roots(raw: str) -> tuple[Path, ...] | None:
    roots = tuple(Path(part).expanduser().resolve() for part in raw.split(os.pathsep) if part.strip())
    return roots or None


@dataclass(frozen=True)
class Settings:
    """The `MOEVIZ_*` environment, parsed. None for a folder list = no restriction."""

    model_dirs: tuple[Path, ...] | None
    store_dirs: tuple[Path, ...] | None
    default_model: str | None
    sample_models: Path | None
    lab_max_runs: int | None  # None: unset or not a positive integer (the lab's default applies)
    vllm_python: Path | None = None  # None: the checkout's .venv-vllm (moeviz.engines.vllm)


def current_settings() -> Settings:
    """The settings as the environment holds them now."""
    env = os.environ
    default_model = env.get("MOEVIZ_DEFAULT_MODEL", "").strip()
    samples = env.get("MOEVIZ_SAMPLE_MODELS", "").strip()
    vllm_python = env.get("MOEVIZ_VLLM_PYTHON", "").strip()
    return Settings(
        model_dirs=_roots(env.get("MOEVIZ_MODEL_DIRS", "")),
        store_dirs=_roots(env.get("MOEVIZ_STORE_DIRS", "")),
        default_model=default_model or None,
        sample_models=Path(samples).expanduser() if samples else None,
        lab_max_runs=_positive_int(env.get("MOEVIZ_LAB_MAX_RUNS", "")),
        vllm_python=Path(vllm_python).expanduser() if vllm_python else None,
    )


def _positive_int(raw: str) -> int | None:
    try:
        value = int(raw.strip())
    except ValueError:
        return None
    return value if value > 0 else None
