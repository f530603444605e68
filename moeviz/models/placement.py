"""Where and at what precision a model loads: dtype and device choice, the memory check made before any weight
is read, quantised checkpoints, and loading progress (bytes read)."""

from __future__ import annotations

import functools
import itertools
import json
import math
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moeviz.errors import (
    CorruptWeightsError,
    InsufficientMemoryError,
    LoadOptionError,
    UnsupportedQuantizationError,
)
from moeviz.models.config_keys import EXPERT_COUNT_KEYS, LAYER_COUNT_KEYS, TOP_K_KEYS, config_int

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
_SAFETENSORS_ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1, "F4": 0.5, "C64": 8,
    "F6_E2M3": 0.75, "F6_E3M2": 0.75,
}  # fmt: skip
_MAX_HEADER_BYTES = 100_000_000  # what the safetensors library itself accepts
ACTIVATION_TOKENS = 2048  # input size the load-time memory check budgets activations for


# ---- dtype and device -----------------------------------------------------------------------------------
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
    by_dtype: dict[torch.dtype, float] = {}
    for entry in safetensors_entries(folder).values():
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is not None:
            by_dtype[dtype] = by_dtype.get(dtype, 0) + _entry_bytes(entry)
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


# ---- memory ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryEstimate:
    """What loading a model on one device needs, worked out on a meta-device skeleton (no weights read)."""

    parameter_bytes: int  # parameters and buffers at the load dtype
    activation_bytes: int  # a forward over `activation_tokens` tokens (hidden states, experts, logits)
    activation_tokens: int
    available_bytes: int | None  # free memory on the device; None = unknown
    device: str
    dtype: str

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.total_bytes <= self.available_bytes


def parameter_bytes(skeleton: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of `skeleton`'s parameters and buffers once loaded at `dtype` (floating parameters take `dtype`;
    buffers, e.g. rotary frequencies and balancing biases, keep their own type). Tied weights count once."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    params = {id(p): p for p in skeleton.parameters()}
    buffers = {id(b): b for b in skeleton.buffers() if id(b) not in params}
    total = sum(
        p.numel() * (itemsize if p.is_floating_point() else p.element_size()) for p in params.values()
    )
    return total + sum(b.numel() * b.element_size() for b in buffers.values())


@dataclass(frozen=True)
class ActivationShape:
    """The sizes of a model that its activation memory depends on, read from its (text) config once: a
    transformers config attribute costs ~5 µs to read, a fixed cost per capture that shows on small models."""

    hidden: int
    intermediate: int  # the widest MLP/expert intermediate over the selected experts
    experts: int
    layers: int
    heads: int
    vocab: int

    @classmethod
    def of(cls, config) -> ActivationShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config

        def first(*keys: str, default: int = 0) -> int:
            return config_int(text, keys) or default

        return cls(
            hidden=first("hidden_size", "d_model", default=1024),
            intermediate=max(
                first("intermediate_size", "ffn_dim", "d_ff"),
                first("moe_intermediate_size", "expert_intermediate_size") * first(*TOP_K_KEYS, default=2),
            ),
            experts=first(*EXPERT_COUNT_KEYS, default=8),
            layers=first(*LAYER_COUNT_KEYS, default=1),
            heads=first("num_attention_heads", "n_head", default=8),
            vocab=first("vocab_size", default=32000),
        )

    def bytes(self, dtype: torch.dtype, tokens: int) -> int:
        """A generous estimate of one forward's working memory over `tokens` tokens: a dozen hidden-state-
        sized buffers, the widest MLP/expert intermediate for every selected expert, attention scores per head
        over a block, fp32 router logits kept for every MoE layer, and fp32 next-token logits."""
        itemsize = dtype.itemsize
        per_token = itemsize * (12 * self.hidden + 3 * self.intermediate + self.heads * min(tokens, 1024))
        per_token += 4 * (2 * self.experts * self.layers + self.vocab)
        return int(tokens * per_token)


def activation_bytes(config, dtype: torch.dtype, tokens: int) -> int:
    """`ActivationShape.bytes` for `config`'s model."""
    return ActivationShape.of(config).bytes(dtype, tokens)


# device → (when, free bytes): `available_memory`'s last reading
_readings: dict[str, tuple[float, int | None]] = {}


def available_memory(device: torch.device, max_age: float = 0.0) -> int | None:
    """Free memory on `device`, in bytes: CUDA's free memory; for the CPU (and MPS, which shares it) the
    smaller of the OS's available memory and what the process's cgroup limit leaves. None if unknown.

    A reading at most `max_age` seconds old is reused (reading costs ~0.3 ms on the CPU: procfs and cgroup
    files); the default reads now."""
    key, now = str(device), time.monotonic()
    last = _readings.get(key)
    if last is not None and now - last[0] <= max_age:
        return last[1]
    free = _read_available(device)
    _readings[key] = (now, free)
    return free


def _read_available(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    candidates = [value for value in (_os_available(), _cgroup_available()) if value is not None]
    return min(candidates) if candidates else None


def _os_available() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_available() -> int | None:
    """Limit minus usage of this process's memory cgroup (v2, then v1); None when unlimited or unknown."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 1 << 60:
            return None
        return max(0, int(limit_text) - usage)
    return None


def estimate_memory(
    skeleton: nn.Module,
    config,
    dtype: torch.dtype,
    device: torch.device,
    tokens: int = ACTIVATION_TOKENS,
    stored_bytes: int | None = None,
) -> MemoryEstimate:
    """Memory a model needs on `device` at `dtype` (from its meta skeleton) and what the device has free.
    `stored_bytes` replaces the parameter bytes for weights that stay quantised (as stored) in memory."""
    return MemoryEstimate(
        parameter_bytes=parameter_bytes(skeleton, dtype) if stored_bytes is None else stored_bytes,
        activation_bytes=activation_bytes(config, dtype, tokens),
        activation_tokens=tokens,
        available_bytes=available_memory(device),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
    )


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def refuse_if_too_large(estimate: MemoryEstimate, what: str) -> None:
    """Raise InsufficientMemoryError, with the numbers and the ways out, when the estimate does not fit."""
    if estimate.fits:
        return
    assert estimate.available_bytes is not None
    remedies = []
    itemsize = torch.empty((), dtype=DTYPES[estimate.dtype]).element_size() if estimate.dtype in DTYPES else 2
    if itemsize > 2:
        half = format_bytes(estimate.parameter_bytes / itemsize * 2)
        remedies.append(f"load at a lower precision (dtype='bfloat16' needs {half} of parameters)")
    remedies.append(
        "spread it over devices and disk: device_map='auto' with offload_folder=<a folder with room> and "
        "max_memory={'cpu': '<budget>'} (CLI: --device-map auto --offload-folder DIR --max-memory cpu=BUDGET)"
    )
    remedies.append("free memory, or use a machine with more")
    params, activations = format_bytes(estimate.parameter_bytes), format_bytes(estimate.activation_bytes)
    raise InsufficientMemoryError(
        f"{what} needs about {format_bytes(estimate.total_bytes)} on {estimate.device} at {estimate.dtype} "
        f"({params} of parameters + {activations} of activations for {estimate.activation_tokens:,} tokens), "
        f"but only {format_bytes(estimate.available_bytes)} is free. Nothing was loaded. To load it: "
        + "; or ".join(remedies)
        + " (check_memory=False skips this check)."
    )


def refuse_if_input_too_large(
    shape: ActivationShape, dtype: torch.dtype, device: torch.device, sequences: int, width: int, what: str
) -> None:
    """Before a capture runs: refuse (InsufficientMemoryError) when the activations of `sequences` padded to
    `width` tokens would not fit in the memory `device` has free now (a reading under a second old while the
    need is below a quarter of it: captures in a row read it once)."""
    need = shape.bytes(dtype, sequences * width)
    free = available_memory(device, max_age=1.0)
    if free is not None and 4 * need > free:  # near the limit: read it now
        free = available_memory(device)
    if free is None or need <= free:
        return
    raise InsufficientMemoryError(
        f"{what} ({sequences} sequence{'s' if sequences != 1 else ''} × {width:,} tokens) needs about "
        f"{format_bytes(need)} of activations on {device}, but only {format_bytes(free)} is free. Nothing "
        "was run. Capture fewer sequences at a time or shorter inputs, or free memory."
    )


# ---- quantised checkpoints ------------------------------------------------------------------------------
RUNS_QUANTISED = "weights run quantised"  # how check_quantization's note starts when nothing is dequantised


def quantization_method(config) -> str | None:
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method)) if method is not None else "unknown"


def _describe(qc: Any, method: str) -> str:
    get = qc.get if isinstance(qc, dict) else lambda k, d=None: getattr(qc, k, d)
    if method == "fp8":
        block = get("weight_block_size")
        blocks = f" in {block[0]}×{block[1]} blocks" if block else " per tensor"
        return f"FP8 ({get('fmt', 'e4m3')}) block-quantised{blocks}"
    if method == "mxfp4":
        return "MXFP4 (4-bit, 32-element blocks with shared exponents)"
    return f"{method}-quantised"


def check_quantization(
    config, folder: Path, device: torch.device, device_map: Any, dtype: torch.dtype = torch.bfloat16
) -> str | None:
    """For a quantised checkpoint, ask transformers' quantizer (before any weight is read) whether it can run
    here: returns a note for the model card ("dequantised to bfloat16 on load", ...) or raises
    UnsupportedQuantizationError with the method, the reason and what to do. None for unquantised models."""
    method = quantization_method(config)
    if method is None:
        return None
    qc = config.quantization_config
    described = _describe(qc, method)
    try:
        from transformers.quantizers.auto import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(qc, pre_quantized=True)
    except ImportError as exc:
        raise UnsupportedQuantizationError(
            f"{folder} is {described}; loading it needs a package that is not installed here: {exc}. Nothing "
            "was loaded. Install it (on a machine where that quantisation runs), or use a dequantised "
            "(bfloat16) copy of the checkpoint."
        ) from exc
    except (ValueError, KeyError) as exc:
        raise UnsupportedQuantizationError(
            f"{folder} is {described}, which this transformers cannot load: {exc}. Nothing was loaded. Use a "
            "dequantised (bfloat16) copy of the checkpoint, or a transformers version that supports it."
        ) from exc
    place = device_map if device_map is not None else ({"": str(device)} if device.type != "cpu" else None)
    try:
        quantizer.validate_environment(device_map=place, dtype=None, weights_only=True)
    except (ImportError, RuntimeError, ValueError, NotImplementedError) as exc:
        where = "a CUDA GPU" if device.type == "cpu" else "the kernels it needs"
        raise UnsupportedQuantizationError(
            f"{folder} is {described}; transformers cannot run or dequantise it on {device}: {exc}. Nothing "
            f"was loaded. Run it where it is supported ({where}; install the package the message names), or "
            "use a dequantised (bfloat16) copy of the checkpoint."
        ) from exc
    if getattr(quantizer.quantization_config, "dequantize", False) or (
        method == "mxfp4" and device.type == "cpu"
    ):
        dtype_name = str(dtype).removeprefix("torch.")
        return (
            f"weights are {described}; transformers cannot run them on {device.type}, so it dequantised them "
            f"to {dtype_name} on load: the routing shown is what the dequantised model computed"
        )
    return f"{RUNS_QUANTISED}: {described}, on {device}"


# ---- safetensors headers and loading progress ----------------------------------------------------------
def stored_bytes(folder: Path) -> int:
    """Bytes of tensor data in the folder's safetensors files (what `progress` counts)."""
    return sum(_entry_bytes(entry) for entry in safetensors_entries(folder).values())


def safetensors_entries(folder: Path) -> dict[str, dict[str, Any]]:
    """{tensor name: header entry (dtype, shape, data_offsets)} over every safetensors file in `folder`
    (files whose header does not check out are skipped: `read_safetensors_header` says why)."""
    entries: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            entries.update(read_safetensors_header(path))
        except (OSError, CorruptWeightsError):
            continue
    return entries


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """{tensor name: entry} of one safetensors file, after checking the whole header (CorruptWeightsError,
    one line, never echoing the file's bytes): a regular file; a header length that fits the file; a JSON
    object of {dtype, shape, data_offsets} entries with a known dtype; each tensor's bytes (shape × dtype)
    equal to its offsets' span, inside the file; no two tensors sharing bytes."""
    info = path.stat()  # follows links; never opens (a FIFO would block the open)
    if not stat.S_ISREG(info.st_mode):
        raise CorruptWeightsError(
            f"{path.name} is not a regular file (a FIFO, device or folder): refusing to read it"
        )
    name, size = path.name, info.st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CorruptWeightsError(f"{name} is truncated ({size} bytes): not a safetensors file")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise CorruptWeightsError(f"{name} is not a safetensors file: header length invalid")
        raw = handle.read(header_len)
    return dict(_parse_header(name, raw, size - 8 - header_len))


# One load reads each header several times (validation, memory estimate, progress): the bytes are read
# every time (cheap, and a rewritten file is never missed), the JSON parsed and checked once.
@functools.lru_cache(maxsize=16)
def _parse_header(name: str, raw: bytes, data_size: int) -> dict[str, dict[str, Any]]:
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise CorruptWeightsError(f"{name} has a corrupt header (not JSON: {reason})") from exc
    if not isinstance(header, dict):
        raise CorruptWeightsError(f"{name} has a corrupt header: the header is not a JSON object")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    spans = []
    for key, entry in entries.items():
        _check_entry(name, key, entry, data_size)
        if entry["data_offsets"][1] > entry["data_offsets"][0]:  # empty tensors hold no bytes
            spans.append((*entry["data_offsets"], key))
    spans.sort()
    for (_, end, before), (start, _, after) in itertools.pairwise(spans):
        if start < end:
            raise CorruptWeightsError(
                f"{name} is corrupt: the data of tensors {before!r} and {after!r} overlap"
            )
    return entries


def _check_entry(name: str, key: str, entry: Any, data_size: int) -> None:
    """One header entry: known dtype, shape of non-negative ints, offsets inside the data, span = bytes."""

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CorruptWeightsError(f"{name} has a malformed header entry for {key!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _SAFETENSORS_ITEMSIZE:
        shown = dtype if isinstance(dtype, str) and len(dtype) <= 16 else "?"
        raise CorruptWeightsError(f"{name}: tensor {key!r} has an unknown dtype {shown!r}")
    if not isinstance(shape, list) or not all(map(is_int, shape)):
        raise CorruptWeightsError(f"{name} has a malformed header entry for {key!r} (shape)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_int, offsets)):
        raise CorruptWeightsError(f"{name} has a malformed header entry for {key!r} (data_offsets)")
    start, end = offsets
    if start > end:
        raise CorruptWeightsError(
            f"{name} is corrupt: tensor {key!r} has data_offsets that end before they start"
        )
    if end > data_size:
        raise CorruptWeightsError(
            f"{name} is truncated or corrupt: tensor {key!r} ends at data byte {end}, past the end of the "
            f"file ({data_size} bytes of data)"
        )
    bits = math.prod(shape) * int(_SAFETENSORS_ITEMSIZE[dtype] * 8)
    if bits != (end - start) * 8:
        raise CorruptWeightsError(
            f"{name} is corrupt: tensor {key!r} of shape {shape} ({dtype}) needs {bits // 8} bytes, its "
            f"data_offsets span {end - start}"
        )


def _entry_bytes(entry: dict[str, Any]) -> int:
    start, end = entry.get("data_offsets", (0, 0))
    if end > start:
        return int(end - start)
    itemsize = _SAFETENSORS_ITEMSIZE.get(entry.get("dtype", ""), 4)
    return int(math.prod(entry.get("shape", [])) * itemsize)


class _Progress:
    def __init__(self, callback: Callable[[int, int], None], sizes: dict[str, int], total: int) -> None:
        self.callback, self.sizes, self.total, self.done = callback, sizes, total, 0

    def track(self, items: Any) -> Iterator[Any]:
        for item in items:
            yield item  # the loader converts and places this entry's tensors before asking for the next
            mapping = item[1] if isinstance(item, tuple) and len(item) == 2 else None
            sources = getattr(mapping, "layer_targets", None) or {}
            self.done += sum(self.sizes.get(key, 0) for keys in sources.values() for key in keys)
            self.callback(min(self.done, self.total), self.total)


_progress_local = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0


def _tracking_tqdm(original: Callable[..., Any]) -> Callable[..., Any]:
    def tqdm(iterable: Any = None, *args: Any, **kwargs: Any) -> Any:
        state = getattr(_progress_local, "state", None)
        if state is None or kwargs.get("desc") != "Loading weights":
            return original(iterable, *args, **kwargs)
        return state.track(iterable)

    tqdm.moeviz_original = original  # type: ignore[attr-defined]
    return tqdm


@contextmanager
def reporting_progress(callback: Callable[[int, int], None] | None, folder: Path) -> Iterator[None]:
    """Call `callback(bytes_read, total_bytes)` as transformers materialises the checkpoint's tensors (total
    = the safetensors data bytes; pickled weights report only start and end). transformers' own "Loading
    weights" bar is replaced by the callback on this thread; other threads' loads are untouched."""
    if callback is None:
        yield
        return
    global _patch_users
    sizes = {name: _entry_bytes(entry) for name, entry in safetensors_entries(folder).items()}
    total = sum(sizes.values()) or sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    try:
        from transformers import core_model_loading as loader
    except ImportError:
        loader = None
    with _patch_lock:
        if loader is not None and hasattr(loader, "tqdm"):
            if _patch_users == 0:
                loader.tqdm = _tracking_tqdm(loader.tqdm)
            _patch_users += 1
        else:
            loader = None
    previous = getattr(_progress_local, "state", None)
    _progress_local.state = _Progress(callback, sizes, total)
    try:
        callback(0, total)
        yield
        callback(total, total)
    finally:
        _progress_local.state = previous
        if loader is not None:
            with _patch_lock:
                _patch_users -= 1
                if _patch_users == 0:
                    loader.tqdm = getattr(loader.tqdm, "moeviz_original", loader.tqdm)


# ---- where a loaded model runs --------------------------------------------------------------------------
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
