"""Turn what the attention recorder saw into an `AttentionCapture` (torch → numpy, once, after the run)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from moeviz.attention.maps import AttentionCapture, AttentionLayer
from moeviz.capture.attention import AttentionRecorder
from moeviz.errors import CaptureError
from moeviz.models.attention import kv_geometry, no_map_reason


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    # fp32 contiguous copy: the model's tensors may be bf16/fp16 or strided views; numpy needs neither.
    return tensor.detach().to(torch.float32).contiguous().numpy()


def build_attention(
    model: nn.Module, recorder: AttentionRecorder, num_layers: int, offsets: np.ndarray, lengths: np.ndarray
) -> AttentionCapture:
    """One AttentionLayer per softmax-attention layer seen (exactly one call each: a single forward), a
    reason for every other decoder layer. offsets/lengths [B]: column of position 0 and real tokens."""
    by_layer: dict[int, list] = {}
    for call in recorder.calls:
        by_layer.setdefault(call.layer, []).append(call)
    layers, no_map = {}, {}
    config = model.config
    for layer, calls in by_layer.items():
        if len(calls) != 1:
            raise CaptureError(
                f"attention layer {layer} ran {len(calls)} times in one forward; expected once "
                f"({', '.join(sorted({c.module for c in calls}))})"
            )
        call = calls[0]
        layers[layer] = AttentionLayer(
            layer=layer,
            module=call.module,
            query=_numpy(call.query),
            key=_numpy(call.key),
            lo=call.lo.numpy().astype(np.int64),
            hi=call.hi.numpy().astype(np.int64),
            scaling=call.scaling,
            value_dim=call.value_dim,
            sinks=None if call.sinks is None else call.sinks.numpy().astype(np.float32),
            softcap=call.softcap,
            sliding_window=call.sliding_window,
            implementation=call.implementation,
        )
    failed = {error.split(":", 1)[0]: error for error in recorder.errors}
    for layer in range(num_layers):
        if layer not in layers:
            no_map[layer] = no_map_reason(config, layer)
    for module, error in failed.items():
        index = next((i for i, (name, idx) in recorder.modules.items() if name == module), None)
        layer = recorder.modules[index][1] if index is not None else -1
        no_map[layer] = f"mask not representable as key intervals ({error})"
    dtype = next(model.parameters()).dtype
    return AttentionCapture(
        layers=layers,
        no_map=no_map,
        offsets=np.asarray(offsets, dtype=np.int64),
        lengths=np.asarray(lengths, dtype=np.int64),
        dtype_bytes=torch.empty(0, dtype=dtype).element_size(),
        geometry=kv_geometry(config),
    )
