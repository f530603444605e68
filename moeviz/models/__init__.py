"""Model loading and per-family adapters: the only code that knows model internals.

The names below load on first use (PEP 562): importing a light submodule such as `moeviz.models.config_keys`
(config facts that analysis and architecture read) runs this file, and must not pull in torch with it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time `__getattr__` imports each name on first use
    from moeviz.models.loading import LoadedModel, load_model
    from moeviz.models.sites import SUPPORTED_FAMILIES, MoESite, find_moe_sites
    from moeviz.models.sources import list_samples

__all__ = ["SUPPORTED_FAMILIES", "LoadedModel", "MoESite", "find_moe_sites", "list_samples", "load_model"]
_HOMES = {  # public name -> the module that defines it
    "SUPPORTED_FAMILIES": "moeviz.models.sites",
    "MoESite": "moeviz.models.sites",
    "find_moe_sites": "moeviz.models.sites",
    "LoadedModel": "moeviz.models.loading",
    "list_samples": "moeviz.models.sources",
    "load_model": "moeviz.models.loading",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'moeviz.models' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value  # the next lookup finds it without `__getattr__`
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
