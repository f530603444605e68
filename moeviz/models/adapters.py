"""PEFT LoRA adapters over a base model: read and check an adapter folder, then merge it into the loaded base
so that capture hooks see ordinary modules (`load_model(base, adapter=DIR)`).

An adapter folder holds `adapter_config.json` and `adapter_model.safetensors` (what `peft`'s
`save_pretrained` writes). Refused, each with one line and before the base's modules change for good: pickled
weights (`adapter_model.bin`: never unpickled), a corrupt safetensors file, a config that is not a LoRA config
(rank r ≤ 0, no targets, a value of the wrong type), a target the base lacks, a tensor whose shape differs
from what the base's module needs (an adapter trained on another base), and a rank above the layer's smaller
side. LoRA reaches a Linear through `target_modules` and any 2-D or 3-D `nn.Parameter` through
`target_parameters` (peft ≥ 0.17's `ParamWrapper`): the router weights of transformers 5's
`*TopKRouter` modules and the fused [E, ·, ·] expert tensors (`mlp.experts.gate_up_proj`).

`check_adapter` runs the cheap checks (config and file header) before the base loads; `merge_adapter` injects
the adapter into the loaded base, checks every tensor against the module it adapts, loads the weights and
merges them (`merge_and_unload`). `AdapterInfo` is what a trace records (`ModelInfo.adapter`, as JSON).
"""

from __future__ import annotations

import json
import math
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from moeviz.errors import (
    CorruptWeightsError,
    InvalidConfigError,
    ModelNotFoundError,
    ModelSourceError,
    NotAModelFolderError,
    UnsafeWeightsError,
)
from moeviz.models.checks import exception_line
from moeviz.models.safetensors_headers import read_safetensors_header

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
CONFIG_LIMIT = 1 << 20  # bytes of adapter_config.json (a few KB in practice)
ADAPTER_NAME = "default"  # the name peft gives the one adapter it loads
SUPPORTED_TYPES = ("LORA",)
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_LAYER_PREFIX = re.compile(r"^.*?\.(?:layers|blocks|block|h)\.\d+\.")  # "model.layers.3." before a name


@dataclass(frozen=True)
class AdapterInfo:
    """What a merged adapter is: its folder, PEFT type, rank r, alpha (the update is alpha/r · B·A), the
    modules (`target_modules`) and parameters (`target_parameters`) it adapts, the base it declares, and the
    module paths it changed (`adapted`, in the base's names)."""

    path: str
    peft_type: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...] = ()
    target_parameters: tuple[str, ...] = ()
    base_model: str = ""  # the config's base_model_name_or_path ("" when it names none)
    adapted: tuple[str, ...] = ()

    @property
    def targets(self) -> list[str]:
        """Every target the config names, modules first."""
        return [*self.target_modules, *self.target_parameters]

    def describe(self) -> str:
        """E.g. 'LoRA r=8, alpha=16 on q_proj, mlp.gate.weight (24 tensors adapted) from /ad'."""
        kind = "LoRA" if self.peft_type == "LORA" else self.peft_type
        alpha = f"{self.alpha:g}"
        return (
            f"{kind} r={self.rank}, alpha={alpha} on {', '.join(self.targets)} "
            f"({len(self.adapted)} adapted) from {self.path}"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AdapterInfo | None:
        """The info `to_json` wrote (None for "": no adapter; ModelSourceError for anything else)."""
        if not text:
            return None
        try:
            raw = json.loads(text)
            return cls(
                path=str(raw["path"]),
                peft_type=str(raw["peft_type"]),
                rank=int(raw["rank"]),
                alpha=float(raw["alpha"]),
                target_modules=tuple(map(str, raw.get("target_modules", ()))),
                target_parameters=tuple(map(str, raw.get("target_parameters", ()))),
                base_model=str(raw.get("base_model", "")),
                adapted=tuple(map(str, raw.get("adapted", ()))),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelSourceError(f"the recorded adapter is not readable: {exception_line(exc)}") from None


@dataclass
class CheckedAdapter:
    """An adapter folder that passed the checks made before the base loads (`check_adapter`)."""

    folder: Path
    config: dict[str, Any]  # adapter_config.json as read
    headers: dict[str, dict[str, Any]]  # {tensor: safetensors header entry}
    info: AdapterInfo
    notes: list[str] = field(default_factory=list)


def check_adapter(adapter: str | Path, base_source: str, base_model_type: str) -> CheckedAdapter:
    """The refusals that need no model: the folder, its weight files (safetensors only, header sound,
    floating-point tensors), and adapter_config.json (a LoRA config of the right types, r > 0)."""
    folder = Path(adapter).expanduser()
    if not folder.exists():
        raise ModelNotFoundError(f"adapter folder {folder} does not exist (adapters load from local folders)")
    if not folder.is_dir():
        raise NotAModelFolderError(f"adapter {folder} is a file; give the folder that holds {ADAPTER_CONFIG}")
    config = _read_config(folder)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.exists():
        pickled = [name for name in PICKLED_WEIGHTS if (folder / name).exists()]
        if pickled:
            raise UnsafeWeightsError(
                f"adapter {folder} holds {pickled[0]} (pickled weights, never unpickled): moeviz reads "
                f"adapter weights only from {ADAPTER_WEIGHTS} (save with safe_serialization=True)"
            )
        raise NotAModelFolderError(f"adapter {folder} has no {ADAPTER_WEIGHTS}")
    try:
        headers = read_safetensors_header(weights)
    except CorruptWeightsError as exc:
        raise CorruptWeightsError(f"adapter {folder}: {exc}") from None
    if not headers:
        raise CorruptWeightsError(f"adapter {folder}: {ADAPTER_WEIGHTS} holds no tensor")
    for name, entry in headers.items():
        if entry["dtype"] not in _FLOAT_DTYPES:
            raise CorruptWeightsError(
                f"adapter {folder}: tensor {name!r} is {entry['dtype']}; LoRA weights are floating point"
            )
    info = AdapterInfo(
        path=str(folder),
        peft_type=config["peft_type"],
        rank=config["r"],
        alpha=float(config["lora_alpha"]),
        target_modules=_names(config.get("target_modules")),
        target_parameters=_names(config.get("target_parameters")),
        base_model=config.get("base_model_name_or_path") or "",
    )
    notes = []
    declared = info.base_model.rstrip("/").rsplit("/", 1)[-1]
    base_name = str(base_source).removeprefix("sample:").rstrip("/").rsplit("/", 1)[-1]
    if declared and declared.lower() != base_name.lower():
        notes.append(
            f"adapter {folder.name} declares base {info.base_model!r}, loaded over {base_source} "
            f"({base_model_type}): its tensors match this base's shapes"
        )
    return CheckedAdapter(folder, config, headers, info, notes)


def _read_config(folder: Path) -> dict[str, Any]:
    """adapter_config.json as a dict whose LoRA fields have the types peft needs; InvalidConfigError (one
    line naming the field) otherwise."""
    path = folder / ADAPTER_CONFIG
    where = f"adapter {folder}: {ADAPTER_CONFIG}"
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise NotAModelFolderError(f"adapter {folder} has no {ADAPTER_CONFIG} (not a PEFT adapter)") from None
    if not stat.S_ISREG(mode):
        raise NotAModelFolderError(f"{where} is not a regular file (a FIFO, device or folder): not read")
    if path.stat().st_size > CONFIG_LIMIT:
        raise InvalidConfigError(f"{where} is over {CONFIG_LIMIT // 1024} KiB: not an adapter config")
    try:
        config = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise InvalidConfigError(f"{where} is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(config, dict):
        raise InvalidConfigError(f"{where} is a JSON {type(config).__name__}, not an object")
    peft_type = config.get("peft_type")
    if peft_type not in SUPPORTED_TYPES:
        raise InvalidConfigError(
            f"{where}: peft_type is {str(peft_type)[:40]!r}; moeviz merges LoRA adapters (peft_type 'LORA')"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise InvalidConfigError(f"{where}: the LoRA rank r must be a positive integer, got {rank!r:.40}")
    alpha = config.get("lora_alpha")
    if not _is_number(alpha):
        raise InvalidConfigError(f"{where}: lora_alpha must be a finite number, got {alpha!r:.40}")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict):
            raise InvalidConfigError(f"{where}: {key} must be an object {{module: value}}")
        for module, value in pattern.items():
            valid = _is_int(value) and value > 0 if key == "rank_pattern" else _is_number(value)
            if not valid:
                raise InvalidConfigError(f"{where}: {key}[{module!r}] is {value!r:.40}; it must be positive")
    modules, parameters = config.get("target_modules"), config.get("target_parameters")
    if not (modules is None or isinstance(modules, str) or _is_str_list(modules)):
        raise InvalidConfigError(f"{where}: target_modules must be a list of names or a regular expression")
    if not (parameters is None or _is_str_list(parameters)):
        raise InvalidConfigError(f"{where}: target_parameters must be a list of parameter names")
    if not modules and not parameters:
        raise InvalidConfigError(f"{where}: it targets nothing (no target_modules, no target_parameters)")
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise InvalidConfigError(f"{where}: base_model_name_or_path must be a string")
    return config


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)) and math.isfinite(value)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(sorted(value))


# ---- merging into a loaded base ---------------------------------------------------------------------------
def merge_adapter(model: nn.Module, adapter: CheckedAdapter) -> tuple[nn.Module, AdapterInfo]:
    """`model` with `adapter`'s LoRA update merged into its weights (the same module objects: hooks and MoE
    sites found on it afterwards see ordinary modules), and the info with the module paths it changed.

    Before any weight changes, the targets are checked against the base (`_check_targets`) and, once peft
    has wrapped the targets (its LoRA tensors still on the meta device), every tensor of the file against
    the shape its module needs; on a refusal the wrappers are removed again."""
    from peft import LoraConfig, PeftModel
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    _check_targets(model, adapter)
    known = set(LoraConfig.__dataclass_fields__)
    kwargs = {k: v for k, v in adapter.config.items() if k in known and k not in ("peft_type", "task_type")}
    kwargs["inference_mode"] = True
    try:
        config = LoraConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidConfigError(
            f"adapter {adapter.folder}: {ADAPTER_CONFIG}: {exception_line(exc)}"
        ) from None
    try:
        wrapped = PeftModel(model, config, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=True)
    except (ValueError, TypeError, RuntimeError, KeyError) as exc:
        raise ModelSourceError(
            f"adapter {adapter.folder} cannot be applied to this base: {exception_line(exc)}"
            + _parameter_hint(model, adapter)
        ) from None
    try:
        expected = {
            k: tuple(v.shape)
            for k, v in get_peft_model_state_dict(wrapped, adapter_name=ADAPTER_NAME).items()
        }
        _check_tensors(adapter, expected)
        _check_ranks(wrapped, adapter)
        tensors = load_file(adapter.folder / ADAPTER_WEIGHTS)
        result = set_peft_model_state_dict(
            wrapped, tensors, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=True
        )
        unexpected = [k for k in getattr(result, "unexpected_keys", []) if k]
        if unexpected:
            raise ModelSourceError(f"adapter {adapter.folder}: tensor {unexpected[0]!r} was not loaded")
        adapted = sorted({name for name, module in wrapped.named_modules() if _is_lora_layer(module)})
        merged = wrapped.merge_and_unload()
    except BaseException:
        wrapped.unload()  # the base as it was: no LoRA wrapper left in the caller's model
        raise
    base_names = tuple(_base_module_name(name) for name in adapted)
    info = AdapterInfo(**{**asdict(adapter.info), "adapted": tuple(dict.fromkeys(base_names))})
    return merged, info


def _is_lora_layer(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def _base_module_name(name: str) -> str:
    """A wrapped module's path in the base's own names: without the PeftModel prefix and the `base_layer`
    steps of nested parameter wrappers."""
    name = name.removeprefix("base_model.model.")
    return re.sub(r"(\.base_layer)+$", "", name.replace(".base_layer.", "."))


def _check_targets(model: nn.Module, adapter: CheckedAdapter) -> None:
    """ModelSourceError naming each target of the config that no module (parameter) of the base matches,
    with what the base has instead where that explains it (fused expert tensors, a router weight)."""
    modules = adapter.config.get("target_modules")
    names = [name for name, _ in model.named_modules()]
    missing: list[str] = []
    if isinstance(modules, str):
        if not any(re.fullmatch(modules, name) for name in names):
            missing.append(modules)
    elif modules:
        missing += [t for t in modules if t != "all-linear" and not any(_matches(n, t) for n in names)]
    params = [
        f"{m}.{p}" for m, module in model.named_modules() for p, _ in module.named_parameters(recurse=False)
    ]
    for target in adapter.config.get("target_parameters") or []:
        if not any(_matches(p, target) for p in params):
            missing.append(target)
    if missing:
        raise ModelSourceError(
            f"adapter {adapter.folder} targets {', '.join(repr(m) for m in missing)}, which this base "
            f"({type(model).__name__}) does not have" + _parameter_hint(model, adapter)
        )


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _parameter_hint(model: nn.Module, adapter: CheckedAdapter) -> str:
    """Where a module-level target cannot reach the weights it means, what `target_parameters` names them:
    fused 3-D expert tensors (and a router that is not a Linear, transformers 5's `*TopKRouter`)."""
    fused = {
        _LAYER_PREFIX.sub("", f"{name}.{param}")
        for name, module in model.named_modules()
        for param, value in module.named_parameters(recurse=False)
        if value.ndim == 3
    }
    if not fused:
        return ""
    shown = ", ".join(sorted(fused)[:3])
    return (
        f" (its experts are fused 3-D tensors, {shown}: LoRA reaches them, and a router that is not a "
        "Linear, through target_parameters)"
    )


def _check_tensors(adapter: CheckedAdapter, expected: dict[str, tuple[int, ...]]) -> None:
    """ModelSourceError naming the first tensor of the file that adapts no module of the base, that the
    base needs but the file lacks, or whose shape differs from the one its module needs (both shapes)."""
    stored = {name: tuple(entry["shape"]) for name, entry in adapter.headers.items()}
    where = f"adapter {adapter.folder}"
    extra = sorted(set(stored) - set(expected))
    if extra:
        raise ModelSourceError(
            f"{where}: tensor {extra[0]!r} adapts no module of this base ({len(extra)} such tensors): "
            "an adapter for another model"
        )
    missing = sorted(set(expected) - set(stored))
    if missing:
        raise ModelSourceError(
            f"{where}: {ADAPTER_WEIGHTS} lacks tensor {missing[0]!r} its config's targets need "
            f"({len(missing)} missing)"
        )
    for name in sorted(stored):
        if stored[name] != expected[name]:
            raise ModelSourceError(
                f"{where}: tensor {name!r} is {list(stored[name])} in the adapter, this base's module needs "
                f"{list(expected[name])}: an adapter for another base (hidden size, experts or rank differ)"
            )


def _check_ranks(wrapped: nn.Module, adapter: CheckedAdapter) -> None:
    """ModelSourceError when a rank exceeds the smaller side of the (per-expert) matrix it updates: such an
    update is not low-rank and the adapter was not made for this layer."""
    for name, module in wrapped.named_modules():
        if not _is_lora_layer(module) or ADAPTER_NAME not in module.r:
            continue
        rank, rows, cols = module.r[ADAPTER_NAME], module.out_features, module.in_features
        if isinstance(rows, int) and isinstance(cols, int) and rank > min(rows, cols):
            raise ModelSourceError(
                f"adapter {adapter.folder}: LoRA rank {rank} is larger than the layer "
                f"{_base_module_name(name)} ({rows} × {cols})"
            )


def adapted_modules_frame(info: AdapterInfo, model: nn.Module, sites: list[Any]) -> Any:
    """One row per module the adapter changed: module (the base's path) and what it is to the routing, kind
    "router" (a MoE layer's router: the fine-tune moves the routing directly), "experts" (a MoE layer's
    experts module, fused or not), "attention" or "other"."""
    import pandas as pd

    routers = {site.name for site in sites}
    experts = {id(site.experts) for site in sites if site.experts is not None}
    expert_names = {name for name, module in model.named_modules() if id(module) in experts}

    def kind(name: str) -> str:
        if name in routers or any(name.startswith(r + ".") for r in routers):
            return "router"
        if name in expert_names or any(name.startswith(e + ".") for e in expert_names):
            return "experts"
        return "attention" if re.search(r"attn|attention", name) else "other"

    return pd.DataFrame({"module": list(info.adapted), "kind": [kind(n) for n in info.adapted]})
