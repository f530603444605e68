"""Thread-aware attention recording at the attention-function boundary transformers exposes.

Every softmax-attention module in transformers 5.x resolves its kernel through
`ALL_ATTENTION_FUNCTIONS.get_interface(impl, default_eager)` and calls it with the post-RoPE query and key,
the mask, `scaling`, `sliding_window` and (GPT-OSS) `s_aux` sinks. While at least one attention capture
runs, `get_interface` is wrapped: on a thread with an active recorder it returns a thin wrapper that keeps
*references* to the query and key, reduces the mask to one allowed key interval per query row, then calls
the original function (sdpa stays sdpa, eager stays eager). On any other thread it returns the original
function untouched, so concurrent sessions neither mix nor pay. Nothing recorded grows with T²: queries and
keys are [B, H, T, D], intervals [B, T].

Linear-attention layers (MiniMax lightning attention, Qwen3-Next gated DeltaNet, Kimi Linear KDA) have no
softmax call; for
them, hooks installed only for the capture keep references to the layer's own projections / kernel inputs
(see `_linear_hooks`), from which `moeviz.capture.attention_build` decodes what `moeviz.attention` needs to
recompute an exact attention-like map.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from moeviz.hooks import Restore, active_on_thread, shared_hooks
from moeviz.models import attention as attention_models
from moeviz.models.config_keys import layer_index

_active = threading.local()
_ROW_CHUNK = 1024  # query rows per step when reducing a [B, 1, T, S] mask to intervals (bounded temp memory)
_SCRATCH_BYTES = 16 << 20  # at most this much scratch per step of that reduction (fewer rows for long keys)


@dataclass
class AttentionCall:
    """One call of one attention module, as the attention function received it.

    query [B, H, T, Dk] and key [B, Hkv, S, Dk] post-RoPE (references, not copies); lo/hi [B, T] inclusive
    allowed key columns per query row (hi < lo: nothing allowed); sinks [H] logits or None.
    """

    module: str
    layer: int
    query: torch.Tensor
    key: torch.Tensor
    value_dim: int
    lo: torch.Tensor
    hi: torch.Tensor
    scaling: float
    sinks: torch.Tensor | None
    softcap: float | None
    sliding_window: int | None
    implementation: str


@dataclass
class AttentionRecorder:
    """Attention calls seen on this thread, in call order, for the modules of one model."""

    modules: dict[int, tuple[str, int]]
    calls: list[AttentionCall] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)  # (layer, "module: why it was not recorded")
    # Linear-attention layers: (module name, layer, thunk -> decoded tensors) per call; decoded after the run.
    linear: list[tuple[str, int, Callable[[], dict]]] = field(default_factory=list)
    _current_delta: tuple[str, int] | None = None
    _mask_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _layer_of(name: str, module: nn.Module) -> int:
    index = getattr(module, "layer_idx", None)
    if isinstance(index, int):
        return index
    index = layer_index(name)
    return -1 if index is None else index


@dataclass(frozen=True)
class _Layout:
    """What attention recording needs from a model's module tree: id(module) -> (qualified name, decoder
    layer index) for every module, and its linear-attention modules as (name, layer, module)."""

    modules: dict[int, tuple[str, int]]
    lightning: list[tuple[str, int, nn.Module]]
    delta_rule: list[tuple[str, int, nn.Module]]


# Walked once per model and kept while it lives: three walks over every module cost ~5 ms per capture.
_layouts: weakref.WeakKeyDictionary[nn.Module, _Layout] = weakref.WeakKeyDictionary()


def _layout(model: nn.Module) -> _Layout:
    layout = _layouts.get(model)
    if layout is None:
        modules = {id(m): (name, _layer_of(name, m)) for name, m in model.named_modules()}
        layout = _layouts[model] = _Layout(
            modules,
            attention_models.lightning_modules(model),
            attention_models.delta_rule_modules(model),
        )
    return layout


def mask_intervals(
    mask: torch.Tensor | None, batch: int, q_len: int, k_len: int, causal_if_none: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce an attention mask to one allowed key interval per query row.

    `mask` is None or [B|1, 1, T, S] (bool: True = attend; float: 0 = attend, large negative = blocked).
    Returns lo, hi [B, T] int64 (inclusive). Causal, sliding-window, chunked and padding masks are all
    intervals per row; anything else (e.g. a position bias folded into the mask) raises ValueError.
    """
    if mask is None:
        rows = torch.arange(q_len)
        # Causal rows are bottom-right aligned, as sdpa/eager do with a cache prefix.
        hi = rows + (k_len - q_len) if causal_if_none else torch.full((q_len,), k_len - 1)
        return torch.zeros(batch, q_len, dtype=torch.long), hi.expand(batch, q_len).clone()
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"attention mask of shape {list(mask.shape)}; expected [B, 1, T, S]")
    lo = torch.empty(mask.shape[0], q_len, dtype=torch.long)
    hi = torch.empty_like(lo)
    cols = mask.shape[-1]
    # Per row: count = number of allowed keys, hi = max over allowed keys of col, lo = cols - max over allowed
    # keys of (cols - col); the row is one interval iff count == hi - lo + 1. Each is a vectorised sum/max
    # over one reused integer scratch (no float or int64 copies of the mask); int16 holds weights and
    # counts below 32,768 keys.
    dtype = torch.int16 if cols <= torch.iinfo(torch.int16).max else torch.int32
    up = torch.arange(cols, dtype=dtype, device=mask.device)
    down = cols - up
    step = max(1, min(_ROW_CHUNK, _SCRATCH_BYTES // max(1, mask.shape[0] * cols * up.element_size())))
    scratch = None
    for start in range(0, q_len, step):
        part = mask[:, 0, start : start + step]
        if part.dtype == torch.bool:
            allowed = part
        else:
            allowed = part == 0
            if bool(((~allowed) & (part > -1e4)).any()):
                raise ValueError("additive attention mask carries a bias, not only 0/-inf: not an interval")
        if scratch is None or scratch.shape != allowed.shape:
            scratch = torch.empty(allowed.shape, dtype=dtype, device=mask.device)  # [B, rows, S], reused
        flags = scratch.copy_(allowed)  # 0/1
        count = flags.sum(-1, dtype=dtype)
        last = flags.mul_(up).amax(-1)
        first = cols - scratch.copy_(allowed).mul_(down).amax(-1)
        empty = count == 0
        if not bool((empty | (count == last - first + 1)).all()):
            raise ValueError("attention mask rows are not contiguous key intervals")
        lo[:, start : start + part.shape[1]] = first.masked_fill_(empty, 0)
        hi[:, start : start + part.shape[1]] = last.masked_fill_(empty, -1)
    if lo.shape[0] != batch:
        lo, hi = lo.expand(batch, -1).clone(), hi.expand(batch, -1).clone()
    return lo, hi


def _wrap(original: Callable, implementation: str, recorder: AttentionRecorder) -> Callable:
    is_sdpa_like = implementation != "eager"

    def recording_attention(module: nn.Module, query, key, value, attention_mask, *args, **kwargs):
        where = recorder.modules.get(id(module))
        if where is not None:
            try:
                _record(recorder, where, module, query, key, value, attention_mask, is_sdpa_like, kwargs)
            except ValueError as exc:  # record why, never break the model's forward
                recorder.errors.append((where[1], f"{where[0]}: {exc}"))
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    return recording_attention


def _record(recorder, where, module, query, key, value, mask, is_sdpa_like, kwargs) -> None:
    batch, _, q_len, _ = query.shape
    k_len = key.shape[2]
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    # With no mask, sdpa/flash apply `is_causal` (only for T > 1); eager applies no mask at all.
    causal_if_none = bool(is_sdpa_like and is_causal and q_len > 1)
    if mask is not None and not torch.is_tensor(mask):
        raise ValueError(f"mask of type {type(mask).__name__} (flex/paged attention) is not supported")
    # Layers share one mask object per forward: reduce each once.
    cache_key = (
        (None, batch, q_len, k_len, causal_if_none)
        if mask is None
        else (id(mask), mask.data_ptr(), tuple(mask.shape), batch)
    )
    intervals = recorder._mask_cache.get(cache_key)
    if intervals is None:
        intervals = mask_intervals(mask, batch, q_len, k_len, causal_if_none)
        recorder._mask_cache[cache_key] = intervals
    sinks = kwargs.get("s_aux")
    softcap = kwargs.get("softcap")
    window = kwargs.get("sliding_window")
    recorder.calls.append(
        AttentionCall(
            module=where[0],
            layer=where[1],
            query=query.detach(),
            key=key.detach(),
            value_dim=int(value.shape[-1]),
            lo=intervals[0],
            hi=intervals[1],
            scaling=float(
                kwargs.get("scaling") if kwargs.get("scaling") is not None else query.shape[-1] ** -0.5
            ),
            sinks=None if sinks is None else sinks.detach().float().reshape(-1).clone(),
            softcap=None if softcap is None else float(softcap),
            sliding_window=None if window is None else int(window),
            implementation="sdpa" if is_sdpa_like else "eager",
        )
    )


def _patched_get_interface(self, attn_implementation: str, default: Callable) -> Callable:
    original = type(self).get_interface(self, attn_implementation, default)
    recorder = getattr(_active, "recorder", None)
    if recorder is None:
        return original
    return _wrap(original, attn_implementation or "eager", recorder)


def _interface():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


@contextmanager
def recording_attention(model: nn.Module) -> Iterator[AttentionRecorder]:
    """Record every attention-function call of `model` on this thread for the duration of the block.

    The wrapper on `ALL_ATTENTION_FUNCTIONS.get_interface` is shared by concurrent captures and removed by
    the last one, also when the block raises.
    """
    layout = _layout(model)
    recorder = AttentionRecorder(modules=layout.modules)
    registry = _interface()

    def install() -> list[Restore]:
        # An instance attribute shadows the class method for this (shared, global) registry only.
        registry.get_interface = _patched_get_interface.__get__(registry)
        return [Restore(lambda: registry.__dict__.pop("get_interface", None))]

    with (
        shared_hooks(registry, "attention-interface", install),
        active_on_thread(_active, "recorder", recorder),
    ):
        try:
            with _linear_hooks(layout, recorder):
                yield recorder
        finally:
            recorder._mask_cache.clear()


# ---- linear-attention layers ----------------------------------------------------------------------------
def _delta_kernel_wrapper(original: Callable, kind: str) -> Callable:
    def recording_delta_rule(query, key, value, g, beta, *args, **kwargs):
        recorder = getattr(_active, "recorder", None)
        where = None if recorder is None else recorder._current_delta
        if where is not None:
            recorder._current_delta = None  # one kernel call per module call
            initial_state = kwargs.get("initial_state", args[1] if len(args) > 1 else None)
            l2 = bool(kwargs.get("use_qk_l2norm_in_kernel", False))
            refs = (query.detach(), key.detach(), value.detach(), g.detach(), beta.detach())
            recorder.linear.append(
                (where[0], where[1], lambda: attention_models.decode_delta(*refs, initial_state, l2, kind))
            )
        return original(query, key, value, g, beta, *args, **kwargs)

    # a function takes any attribute; typeshed types only those every function has
    recording_delta_rule.__wrapped__ = original  # type: ignore[attr-defined]
    return recording_delta_rule


@contextmanager
def _linear_hooks(layout: _Layout, recorder: AttentionRecorder) -> Iterator[None]:
    """Hooks on the model's linear-attention layers, recording only on the recorder's own thread; always
    removed. MiniMax: a forward hook on `qkv_proj` keeps a reference to its output. Qwen3-Next DeltaNet and
    Kimi Linear KDA: a pre-hook marks the running module and the (reference-counted, thread-checked) wrapper
    of its chunked kernel keeps references to the q, k, v, g, beta the kernel receives."""
    handles = []

    def mine() -> bool:
        return getattr(_active, "recorder", None) is recorder

    for name, layer, module in layout.lightning:

        def keep(_mod, _inputs, output, name=name, layer=layer, module=module):
            if mine():
                out = output.detach()
                recorder.linear.append((name, layer, lambda: attention_models.decode_lightning(module, out)))

        handles.append(module.qkv_proj.register_forward_hook(keep))
    kernels = {}  # (id(python module), global name) -> (python module, global name, kind)
    for name, layer, module in layout.delta_rule:
        owner, fname, kind = attention_models.delta_rule_kernel(module)
        kernels[(id(owner), fname)] = (owner, fname, kind)

        def enter(_mod, _inputs, name=name, layer=layer):
            if mine():
                recorder._current_delta = (name, layer)

        def leave(_mod, _inputs, _output):
            if mine():
                recorder._current_delta = None

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))

    def wrap_kernel(owner, fname: str, kind: str) -> Callable[[], list[Restore]]:
        def install() -> list[Restore]:
            original = getattr(owner, fname)
            setattr(owner, fname, _delta_kernel_wrapper(original, kind))
            return [Restore(lambda: setattr(owner, fname, original))]

        return install

    with ExitStack() as stack:
        # Registered first, so the module hooks go also when wrapping a kernel fails.
        stack.callback(lambda: [handle.remove() for handle in handles])
        for owner, fname, kind in kernels.values():
            stack.enter_context(shared_hooks(owner, f"kernel:{fname}", wrap_kernel(owner, fname, kind)))
        yield


def patch_active() -> bool:
    """True while some capture has the attention-function wrapper installed (for tests)."""
    return "get_interface" in _interface().__dict__


__all__ = ["AttentionCall", "AttentionRecorder", "mask_intervals", "patch_active", "recording_attention"]
