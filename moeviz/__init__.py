"""moeviz: a microscope for Mixture-of-Experts language models.

import moeviz
loaded = moeviz.load_model("sample:mixtral-healthy")
trace = moeviz.capture(loaded, "The quick brown fox")
trace.routing_frame()  # one row per (seq, pos, layer, rank)

The public names load on first use (PEP 562), so `import moeviz` is light: torch and transformers arrive
with `moeviz.capture` or `moeviz.load_model`, never with the package itself. `moeviz.__version__` is the
installed distribution's version (pyproject.toml's in a checkout that is not installed).
"""

from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time `__getattr__` imports each name on first use
    from moeviz.capture import capture
    from moeviz.errors import MoevizError
    from moeviz.models.loading import LoadedModel, load_model
    from moeviz.models.sources import list_samples
    from moeviz.trace import LayerRouting, ModelInfo, Trace

__all__ = [
    "LayerRouting",
    "LoadedModel",
    "ModelInfo",
    "MoevizError",
    "Trace",
    "capture",
    "list_samples",
    "load_model",
]
_HOMES = {  # public name -> the module that defines it
    "LayerRouting": "moeviz.trace",
    "LoadedModel": "moeviz.models.loading",
    "ModelInfo": "moeviz.trace",
    "MoevizError": "moeviz.errors",
    "Trace": "moeviz.trace",
    "capture": "moeviz.capture",
    "list_samples": "moeviz.models.sources",
    "load_model": "moeviz.models.loading",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _version()
    elif name in _HOMES:
        value = getattr(import_module(_HOMES[name]), name)
    else:
        raise AttributeError(f"module 'moeviz' has no attribute {name!r}")
    globals()[name] = value  # the next lookup finds it without `__getattr__`
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})


def _version() -> str:
    """The installed distribution's version; in a checkout that is not installed, pyproject.toml's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moeviz")
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "0+unknown"


class _Package(types.ModuleType):
    """The type of the `moeviz` module. The import system binds every subpackage it loads on its parent;
    `moeviz.capture` names the function, so the `moeviz.capture` package must not replace it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
