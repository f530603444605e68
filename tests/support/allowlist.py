"""The allowed folders of the hardening tests (`MOEVIZ_MODEL_DIRS`, `MOEVIZ_STORE_DIRS`): an allowed folder
and one outside it holding a secret file, and copies of a tiny model to put in either."""

from __future__ import annotations

import shutil
from pathlib import Path

SECRET = "hunter2-SECRET-TOKEN"


def make_roots(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """(allowed, outside): MOEVIZ_MODEL_DIRS and MOEVIZ_STORE_DIRS = allowed; outside/secret.txt = SECRET."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(allowed))
    monkeypatch.setenv("MOEVIZ_STORE_DIRS", str(allowed))
    return allowed, outside


def model_copier(tiny_model_dir):
    """`make(parent, name="m")` -> a copy of the tiny Mixtral folder at parent/name."""

    def make(parent: Path, name: str = "m") -> Path:
        return shutil.copytree(tiny_model_dir("mixtral"), parent / name)

    return make
