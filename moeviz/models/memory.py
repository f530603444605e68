"""Memory before a load or a capture: what a model needs (sized on a meta-device skeleton, no weight read),
what the device has free, and the refusals, with the numbers and the ways out, when it does not fit."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moeviz.errors import InsufficientMemoryError
from moeviz.models.config_keys import EXPERT_COUNT_KEYS, LAYER_COUNT_KEYS, TOP_K_KEYS, config_int
from moeviz.models.placement import DTYPES

ACTIVATION_TOKENS = 2048  # input size the load-time memory check budgets activations for


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
