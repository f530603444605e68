"""Where and at what precision a model runs: the dtype and device it loads at, the `from_pretrained`
placement keywords (one device, or a device map over GPUs, CPU RAM and disk), and where a loaded model's
inputs go."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moeviz.errors import LoadOptionError, ModelSourceError
from moeviz.models.safetensors_headers import stored_bytes_by_dtype

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from a name ("bfloat16", "bf16", "float32", ...) or a torch dtype; None for "auto"."""
    if dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        return None
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise LoadOptionError(f"dtype must be a floating-point type, got {dtype}")
        return dtype
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name not in DTYPES:
        raise LoadOptionError(
            f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16 (or a torch dtype)"
        )
    return DTYPES[name]


def pick_device(device: str | torch.device | None = "auto") -> torch.device:
    """The device a model loads on: `"auto"` picks CUDA, then Apple's MPS, then the CPU; a named device must
    exist here."""
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise LoadOptionError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps") from exc
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise LoadOptionError(
                f"device {device!r}: this machine (or this torch build) has no CUDA GPU; use device='cpu'"
            )
        index = chosen.index if chosen.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise LoadOptionError(
                f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        return torch.device("cuda", index)
    if chosen.type == "mps" and not torch.backends.mps.is_available():
        raise LoadOptionError(f"device {device!r}: MPS is not available here; use device='cpu'")
    if chosen.type not in ("cpu", "cuda", "mps"):
        raise LoadOptionError(f"unsupported device {device!r}: use auto, cpu, cuda, cuda:N or mps")
    return chosen


def checkpoint_dtype(config, folder: Path) -> torch.dtype:
    """The dtype the checkpoint declares (config `dtype` / `torch_dtype`), else the dtype most of its
    safetensors bytes are stored in, else float32."""
    for attr in ("dtype", "torch_dtype"):
        value = getattr(config, attr, None)
        if isinstance(value, torch.dtype) and value.is_floating_point:
            return value
        if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
            return DTYPES[value.removeprefix("torch.")]
    by_dtype: dict[torch.dtype, int] = {}
    for name, stored in stored_bytes_by_dtype(folder).items():
        dtype = _SAFETENSORS_DTYPES.get(name)
        if dtype is not None:
            by_dtype[dtype] = by_dtype.get(dtype, 0) + stored
    return max(by_dtype, key=by_dtype.__getitem__) if by_dtype else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, config, folder: Path, device: torch.device) -> torch.dtype:
    """`"auto"`: the checkpoint's own dtype (bf16 stays bf16), except float16 on a CPU, which loads as float32
    (CPUs emulate fp16 arithmetic: ~3x slower than fp32 here; fp16 checkpoints are fp16 for storage)."""
    chosen = parse_dtype(dtype)
    if chosen is not None:
        return chosen
    own = checkpoint_dtype(config, folder)
    if own == torch.float16 and device.type == "cpu":
        return torch.float32
    return own


def placement_keywords(
    target: torch.device,
    device_map: str | int | dict[str, Any] | None,
    offload_folder: str | Path | None,
    max_memory: dict[int | str, int | str] | None,
) -> dict[str, Any]:
    """`from_pretrained` keywords that place the model: a device map (with its offload folder and memory caps;
    a clear error when accelerate is missing), the whole model on `target` when that is not the CPU, or none
    (the CPU)."""
    if device_map is None:
        return {"device_map": {"": str(target)}} if target.type != "cpu" else {}
    if importlib.util.find_spec("accelerate") is None:
        raise ModelSourceError(
            "device_map needs the accelerate package: pip install accelerate (or moeviz[ray])"
        )
    placement: dict[str, Any] = {"device_map": device_map}
    if offload_folder is not None:
        placement["offload_folder"] = str(offload_folder)
    if max_memory is not None:
        placement["max_memory"] = dict(max_memory)
    return placement


def align_inputs(model: nn.Module) -> None:
    """Capture feeds CPU tensors. Accelerate moves them (and the outputs back) only when it split the model
    over devices; a model placed whole on one accelerator gets the same top-level hook here."""
    if getattr(model, "_hf_hook", None) is not None:
        return
    devices = {p.device for p in model.parameters()} - {torch.device("meta")}
    if len(devices) != 1 or next(iter(devices)).type == "cpu":
        return
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    add_hook_to_module(model, AlignDevicesHook(execution_device=devices.pop(), io_same_device=True))


def input_device(model: nn.Module) -> torch.device:
    """Where the model's input ids must go: the device its embedding executes on (with a device map, the
    accelerate hook's execution device; disk- or CPU-offloaded weights are brought there)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    hook = getattr(embedding, "_hf_hook", None) or getattr(model, "_hf_hook", None)
    execution = getattr(hook, "execution_device", None)
    if execution is not None:
        return torch.device("cuda", execution) if isinstance(execution, int) else torch.device(execution)
    weight = getattr(embedding, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    for param in model.parameters():
        if param.device.type != "meta":
            return param.device
    return torch.device("cpu")


def placement_summary(model: nn.Module) -> str:
    """Where the weights are: one device ("cpu", "cuda:0"), or with a device map the devices in use with the
    share of modules on each ("cuda:0 (30 modules), cpu (2), disk (16)")."""
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, dict) and set(map(str, device_map.values())) == {"disk"}:
        return f"disk (runs on {input_device(model)})"
    if isinstance(device_map, dict) and len(set(map(str, device_map.values()))) > 1:
        counts: dict[str, int] = {}
        for where in device_map.values():
            name = f"cuda:{where}" if isinstance(where, int) else str(where)
            counts[name] = counts.get(name, 0) + 1
        parts = [f"{name} ({n} module{'s' if n != 1 else ''})" for name, n in counts.items()]
        return ", ".join(parts)
    return str(input_device(model))
