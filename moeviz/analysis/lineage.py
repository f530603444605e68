"""Do two models share a training lineage? Expert ids only correspond between checkpoints of one run.

Expert 3 of one model has nothing to do with expert 3 of a model trained separately, so routing agreement,
saturation or drift "by expert id" between unrelated models measures nothing. `lineage(a, b)` decides it
from the weights alone, without running the models:

1. Shape: model type, number of MoE layers, experts, top-k and hidden size (from each config) and the shapes
   of the router weights; any difference → unrelated, with the reason.
2. Closeness: for each MoE layer present in both, the cosine similarity of the flattened router (gate)
   weights and of the expert weights matched by id (a bounded sample of them: at most `MAX_EXPERT_TENSORS`
   tensors per layer, each cut to its first `MAX_ELEMENTS` elements, so that a 384-expert model reads
   megabytes, not its whole checkpoint). A layer's similarity is the smaller of the two; the models are
   related when every layer's similarity is at least `THRESHOLD`.

`THRESHOLD` = 0.25. Independently initialised weights are zero-mean random matrices: their cosine is about
0 with a spread of 1/sqrt(n) (n = E × hidden elements of a router: 0.03 for the 8 × 128 router of the
bundled samples, 0.044 for the 8 × 64 router of `moeviz.testing.tiny_models`), so 0.25 is 6-8 standard
deviations above chance. Checkpoints of one run stay far closer. Measured on the bundled samples (smallest
layer similarity): consecutive checkpoints of `mixtral-healthy-series` 0.750 (steps 200 → 400) to 0.996
(0 → 10); its first and last checkpoint (step 0 vs 1000, the widest span) 0.313, still related. The
separately trained samples share an initialisation (seed 0: see each sample's training.json) but their
routers diverged: `mixtral-healthy` vs `mixtral-collapsed` 0.004, vs `mixtral-unbalanced` 0.096,
`mixtral-collapsed` vs `mixtral-unbalanced` 0.061: unrelated, as their expert ids no longer name the same
experts. Independently initialised tiny models (`build_tiny_model` seeds 0 and 1): -0.08 to 0.04.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from moeviz.models.config_keys import (
    EXPERT_COUNT_KEYS,
    LAYER_COUNT_KEYS,
    ROUTER_NAMES,
    TOP_K_KEYS,
    layer_index,
)

if TYPE_CHECKING:  # torch is imported where weights are read: importing moeviz.analysis stays torch-free
    import torch

THRESHOLD = 0.25
MAX_EXPERT_TENSORS = 16  # expert weight tensors compared per layer (evenly spaced over the sorted names)
MAX_ELEMENTS = 1 << 16  # elements read from each compared tensor

# a router's weight: <the MoE block's prefix><router name>.weight; its layer: `layer_index` of the prefix
_ROUTER = re.compile(rf"^(?P<prefix>.+\.)(?:{'|'.join(ROUTER_NAMES)})\.weight$")
_CONFIG_KEYS = {
    "model type": ("model_type",),
    "experts": EXPERT_COUNT_KEYS,
    "top-k": TOP_K_KEYS,
    "layers": LAYER_COUNT_KEYS,
    "hidden size": ("hidden_size", "d_model"),
}


@dataclass(frozen=True)
class Lineage:
    """Whether two models share a training lineage (see the module docstring for the rule and threshold).

    `layers`: one row per MoE layer compared (layer, router_cosine, expert_cosine, similarity = the smaller
    of the two available; NaN where a weight is all zeros). `checked` is False when no MoE weights could be
    compared (then `related` is True: nothing says otherwise)."""

    related: bool
    reason: str
    threshold: float
    layers: pd.DataFrame
    checked: bool = True


class _Weights:
    """Named tensors read lazily (a safetensors folder) or from memory, plus the config if known."""

    def __init__(self, keys: list[str], get: Callable[[str, int], torch.Tensor], shape, config: dict | None):
        self.keys, self._get, self.shape, self.config = keys, get, shape, config

    def head(self, key: str, elements: int = MAX_ELEMENTS) -> torch.Tensor:
        import torch

        return self._get(key, elements).reshape(-1)[:elements].to(torch.float64)


def _from_folder(folder: Path) -> _Weights:
    from safetensors import safe_open

    config_path = folder / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    handles = {}
    for file in files:
        handle = safe_open(str(file), "pt")
        handles.update(dict.fromkeys(handle.keys(), handle))

    def shape(key: str) -> tuple[int, ...]:
        return tuple(handles[key].get_slice(key).get_shape())

    def get(key: str, elements: int) -> torch.Tensor:
        part = handles[key].get_slice(key)
        dims = part.get_shape()
        inner = math.prod(dims[1:]) if len(dims) > 1 else 1
        rows = max(1, min(dims[0], -(-elements // max(inner, 1)))) if dims else 1
        return part[:rows] if dims else part[:]

    return _Weights(sorted(handles), get, shape, config)


def _from_tensors(tensors: Mapping[str, torch.Tensor], config: dict | None) -> _Weights:
    return _Weights(
        sorted(tensors),
        lambda key, elements: tensors[key].detach().reshape(-1)[:elements].cpu(),
        lambda key: tuple(tensors[key].shape),
        config,
    )


def _weights(source: Any) -> _Weights:
    """A LoadedModel, an nn.Module, a state dict, or a model folder / source (`sample:<name>`)."""
    if isinstance(source, (str, Path)):
        from moeviz.models.loading import resolve_source

        return _from_folder(Path(resolve_source(source)))
    import torch

    model = source if isinstance(source, torch.nn.Module) else getattr(source, "model", source)  # LoadedModel
    if isinstance(model, torch.nn.Module):
        config: Any = getattr(model, "config", None)
        raw = config.to_dict() if hasattr(config, "to_dict") else None
        return _from_tensors(model.state_dict(), raw)
    if isinstance(source, Mapping):
        return _from_tensors(source, None)
    raise TypeError(f"lineage needs a model, a state dict or a model folder, got {type(source).__name__}")


def _config_value(config: dict, names: tuple[str, ...]) -> Any:
    text = config.get("text_config")
    if not isinstance(text, dict):
        text = {}
    for name in names:
        for where in (config, text):
            if where.get(name) is not None:
                return where[name]
    return None


def _routers(weights: _Weights) -> dict[str, tuple[int, str]]:
    """Router weight name → (layer index, the MoE block's prefix), for 2-D router weights."""
    found = {}
    for key in weights.keys:
        match = _ROUTER.match(key)
        if match is None:
            continue
        layer = layer_index(match["prefix"])
        if layer is not None and len(weights.shape(key)) == 2:
            found[key] = (layer, match["prefix"])
    return found


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    norm = float(a.norm() * b.norm())
    return float(a @ b) / norm if norm > 0 else math.nan


def _expert_keys(weights: _Weights, prefix: str) -> list[str]:
    keys = [k for k in weights.keys if k.startswith(prefix + "experts.") and k.endswith(("weight", "proj"))]
    keys.sort(key=lambda k: ([int(p) if p.isdigit() else -1 for p in k[len(prefix) :].split(".")], k))
    if len(keys) > MAX_EXPERT_TENSORS:
        picks = np.linspace(0, len(keys) - 1, MAX_EXPERT_TENSORS).round().astype(int)
        keys = [keys[i] for i in picks]
    return keys


def _unrelated(reason: str, layers: pd.DataFrame | None = None) -> Lineage:
    empty = pd.DataFrame(columns=["layer", "router_cosine", "expert_cosine", "similarity"])
    return Lineage(False, reason, THRESHOLD, empty if layers is None else layers)


def lineage(a: Any, b: Any, *, threshold: float = THRESHOLD) -> Lineage:
    """Whether models `a` and `b` share a training lineage, so that their expert ids name the same experts.

    `a`, `b`: `LoadedModel`s, `nn.Module`s, state dicts (name → tensor), or model folders / sources
    (`sample:<name>`; read lazily from the safetensors files). See the module docstring for the rule, and
    `THRESHOLD` (0.25) for why, with the values measured on the bundled samples.
    """
    wa, wb = _weights(a), _weights(b)
    if wa.config is not None and wb.config is not None:
        for what, names in _CONFIG_KEYS.items():
            va, vb = _config_value(wa.config, names), _config_value(wb.config, names)
            if va != vb:
                return _unrelated(f"different {what}: {va} vs {vb}")
    ra, rb = _routers(wa), _routers(wb)
    if sorted(ra.values()) != sorted(rb.values()) and ra and rb:
        layers_a, layers_b = sorted({v[0] for v in ra.values()}), sorted({v[0] for v in rb.values()})
        return _unrelated(f"different MoE layers or router names: {layers_a} vs {layers_b}")
    rows = []
    for key, (layer, prefix) in sorted(ra.items(), key=lambda item: item[1]):
        if key not in rb:
            continue
        if wa.shape(key) != wb.shape(key):
            return _unrelated(f"layer {layer}: router shapes differ, {wa.shape(key)} vs {wb.shape(key)}")
        router = _cosine(wa.head(key), wb.head(key))
        shared = [k for k in _expert_keys(wa, prefix) if k in set(wb.keys) and wa.shape(k) == wb.shape(k)]
        expert = math.nan
        if shared:
            import torch

            expert = _cosine(torch.cat([wa.head(k) for k in shared]), torch.cat([wb.head(k) for k in shared]))
        rows.append({"layer": layer, "router_cosine": router, "expert_cosine": expert})
    layers = pd.DataFrame(rows, columns=["layer", "router_cosine", "expert_cosine"])
    layers["similarity"] = layers[["router_cosine", "expert_cosine"]].min(axis=1, skipna=True)
    valid = layers.dropna(subset=["similarity"])
    if valid.empty:
        reason = "no MoE router or expert weights to compare: lineage not checked"
        return Lineage(True, reason, threshold, layers, checked=False)
    worst = valid.loc[valid["similarity"].idxmin()]
    if worst["similarity"] < threshold:
        reason = (
            f"MoE layer {int(worst['layer'])}: router/expert weight cosine {worst['similarity']:.3f} < "
            f"{threshold} (weights trained separately or initialised independently: about 0)"
        )
        return Lineage(False, reason, threshold, layers)
    reason = (
        f"same shape; router and expert weights of every MoE layer close (smallest cosine "
        f"{worst['similarity']:.3f} ≥ {threshold})"
    )
    return Lineage(True, reason, threshold, layers)
