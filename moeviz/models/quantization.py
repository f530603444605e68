"""Quantised checkpoints: whether transformers can run or dequantise them here, asked before any weight is
read, and the note a loaded model's card carries about it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moeviz.errors import UnsupportedQuantizationError

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
