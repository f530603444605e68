"""Where a model source points: `sample:NAME` (a bundled sample) or a local folder, resolved to the folder
with a specific error for each way it can fail. No torch: the app resolves sources before it loads torch."""

from __future__ import annotations

from pathlib import Path

from moeviz.errors import ModelNotFoundError, NotAModelFolderError, UnknownSampleError
from moeviz.resources import bundled_path
from moeviz.settings import current_settings

SAMPLE_PREFIX = "sample:"
DEFAULT_SAMPLE = "sample:mixtral-healthy"  # the app's and the docs' default model


def sample_models_dir() -> Path:
    """Where bundled sample models live: `MOEVIZ_SAMPLE_MODELS` if set, else the installed (or checkout's)
    sample_models/."""
    return current_settings().sample_models or bundled_path("sample_models")


def list_samples() -> list[str]:
    """Sample model names: folders under sample_models/ with a config.json, and the checkpoints of a
    series one level down (`SERIES/STEP`)."""
    root = sample_models_dir()
    if not root.is_dir():
        return []
    configs = list(root.glob("*/config.json")) + list(root.glob("*/*/config.json"))
    return sorted(path.parent.relative_to(root).as_posix() for path in configs)


def resolve_source(source: str | Path) -> Path:
    """Map `sample:NAME` or a path to a model folder, with a specific error for each way it can fail."""
    text = str(source)
    if text.startswith(SAMPLE_PREFIX):
        name = text[len(SAMPLE_PREFIX) :]
        available = list_samples()
        if name not in available:
            listing = ", ".join(available) or "none are installed"
            raise UnknownSampleError(f"unknown sample model {name!r}; available samples: {listing}")
        return sample_models_dir() / name
    folder = Path(text).expanduser()
    if not folder.exists():
        raise ModelNotFoundError(
            f"model folder {folder} does not exist (models load from local folders only)"
        )
    if not folder.is_dir():
        raise NotAModelFolderError(
            f"{folder} is a file; give the folder that holds config.json and the weights"
        )
    config = folder / "config.json"
    if config.exists() and not config.is_file():  # follows links: a link to a FIFO is not a regular file
        raise NotAModelFolderError(f"{config} is not a regular file (a FIFO, device or folder): not read")
    if not config.is_file():
        raise NotAModelFolderError(f"{folder} is not a Hugging Face model folder: it has no config.json")
    return folder
