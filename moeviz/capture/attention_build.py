"""Turn what the attention recorder saw into an `AttentionCapture` (torch → numpy, once, after the run).

Lives next to the recorder (`moeviz.capture.attention`): capture builds the `moeviz.attention` data objects,
and `moeviz.attention` never imports capture.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from moeviz.attention import AttentionCapture, AttentionLayer, LinearAttentionLayer
from moeviz.capture.attention import AttentionRecorder
from moeviz.models.attention import kv_geometry, no_map_reason


def _fp32_copy(tensor: torch.Tensor) -> np.ndarray:
    """An fp32, C-contiguous numpy copy of a tensor, always a copy (one): the AttentionCapture owns its
    arrays, whatever the model does with its tensors after the run. The model's tensors may be bf16/fp16 or
    strided views; the attention kernels need neither. Its twin `moeviz.capture.forward._numpy_view` is the
    other contract: a view of the tensor wherever it can be."""
    return tensor.detach().to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True).numpy()


def build_attention(
    model: nn.Module, recorder: AttentionRecorder, num_layers: int, offsets: np.ndarray, lengths: np.ndarray
) -> AttentionCapture:
    """One AttentionLayer per softmax-attention layer seen (exactly one call each: a single forward), a
    reason for every other decoder layer. offsets/lengths [B]: column of position 0 and real tokens."""
    by_layer: dict[int, list] = {}
    for call in recorder.calls:
        by_layer.setdefault(call.layer, []).append(call)
    # the recorded tensors are the model's (references): each is let go once its layer is copied, so the
    # copies hold one layer's query and key twice at a time, not every layer's
    recorder.calls.clear()
    layers, no_map = {}, {}
    config = model.config
    for layer in list(by_layer):
        calls = by_layer.pop(layer)
        if len(calls) != 1:  # a looped block (Inkling-2-Loop) or two attentions in one block: no one map
            modules = ", ".join(sorted({c.module for c in calls}))
            no_map[layer] = f"attention ran {len(calls)} times in one forward ({modules}): no map"
            continue
        call = calls[0]
        layers[layer] = AttentionLayer(
            layer=layer,
            module=call.module,
            query=_fp32_copy(call.query),
            key=_fp32_copy(call.key),
            lo=call.lo.numpy().astype(np.int64),
            hi=call.hi.numpy().astype(np.int64),
            scaling=call.scaling,
            value_dim=call.value_dim,
            sinks=None if call.sinks is None else call.sinks.numpy().astype(np.float32),
            softcap=call.softcap,
            sliding_window=call.sliding_window,
            implementation=call.implementation,
        )
    linear = _linear_layers(recorder, layers, no_map)
    for layer in range(num_layers):
        if layer not in layers and layer not in linear and layer not in no_map:
            no_map[layer] = no_map_reason(config, layer)
    for layer, error in recorder.errors:
        no_map[layer] = f"mask not representable as key intervals ({error})"
    dtype = next(model.parameters()).dtype
    return AttentionCapture(
        layers=layers,
        no_map=no_map,
        offsets=np.asarray(offsets, dtype=np.int64),
        lengths=np.asarray(lengths, dtype=np.int64),
        dtype_bytes=torch.empty(0, dtype=dtype).element_size(),
        geometry=kv_geometry(config),
        linear=linear,
    )


def _linear_layers(
    recorder: AttentionRecorder, softmax: dict, no_map: dict
) -> dict[int, LinearAttentionLayer]:
    """Decode what the linear-attention hooks kept (one call per layer) into LinearAttentionLayer."""
    by_layer: dict[int, list] = {}
    for name, layer, thunk in recorder.linear:
        by_layer.setdefault(layer, []).append((name, thunk))
    out = {}
    for layer, calls in by_layer.items():
        if layer in softmax:
            continue
        if len(calls) != 1:
            no_map[layer] = f"linear-attention layer ran {len(calls)} times in one forward: no map"
            continue
        name, thunk = calls[0]
        try:
            parts = thunk()
        except ValueError as exc:
            no_map[layer] = f"{name}: {exc}"
            continue
        out[layer] = LinearAttentionLayer(
            layer=layer,
            module=name,
            kind=parts["kind"],
            query=_fp32_copy(parts["query"]),
            key=_fp32_copy(parts["key"]),
            value=_fp32_copy(parts["value"]),
            log_decay=_fp32_copy(parts["log_decay"]),
            beta=None if parts["beta"] is None else _fp32_copy(parts["beta"]),
        )
    recorder.linear.clear()
    return out
