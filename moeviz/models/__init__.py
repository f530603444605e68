"""Model loading and per-family adapters: the only code that knows model internals."""

from moeviz.models.loading import LoadedModel, list_samples, load_model
from moeviz.models.sites import SUPPORTED_FAMILIES, MoESite, find_moe_sites

__all__ = ["SUPPORTED_FAMILIES", "LoadedModel", "MoESite", "find_moe_sites", "list_samples", "load_model"]
