"""Quantised copies of saved tiny models, as the big MoE checkpoints ship them (for loading tests).

- FP8 block quantisation (DeepSeek-V3, Kimi K2, Qwen3-FP8): every 2-D projection weight stored as
  float8_e4m3fn with one float32 `weight_scale_inv` per [bm, bn] block (weight ≈ fp8 · scale), and a
  `quantization_config` {quant_method: fp8, weight_block_size: [bm, bn]}. Embeddings, norms, routers and the
  output head stay in bf16, as in the released checkpoints.
- MXFP4 (gpt-oss): the experts' `gate_up_proj` / `down_proj` stored as `*_blocks` (two e2m1 nibbles per
  byte, 32 values per block along the input dimension) and `*_scales` (the block's shared power of two,
  biased by 127); everything else bf16.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_KEEP_FULL = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "router", "e_score_correction_bias")


def _copy_folder(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy2(path, dst / path.name)


def _write_config(src: Path, dst: Path, quantization_config: dict) -> None:
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def fp8_block_quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [rows/bm, cols/bn]) with weight ≈ q · scale per block."""
    bm, bn = block
    rows, cols = weight.shape
    if rows % bm or cols % bn:
        raise ValueError(f"weight {tuple(weight.shape)} is not a whole number of {bm}×{bn} blocks")
    blocks = weight.float().reshape(rows // bm, bm, cols // bn, bn)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / _FP8_MAX
    quantised = (blocks / scale[:, None, :, None]).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return quantised.reshape(rows, cols), scale


def fp8_dequantize(quantised: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 weight from an FP8 block-quantised one (the inverse of `fp8_block_quantize`)."""
    rows, cols = quantised.shape
    bm, bn = rows // scale.shape[0], cols // scale.shape[1]
    blocks = quantised.float().reshape(scale.shape[0], bm, scale.shape[1], bn)
    return (blocks * scale[:, None, :, None]).reshape(rows, cols)


def save_fp8_copy(src: Path, dst: Path, block: tuple[int, int] = (8, 8)) -> Path:
    """Copy the saved model in `src` to `dst` with its projections FP8 block-quantised (DeepSeek-V3 style)."""
    src, dst = Path(src), Path(dst)
    _copy_folder(src, dst)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if tensor.dim() == 2 and name.endswith(".weight") and not any(k in name for k in _KEEP_FULL):
            tensors[name], tensors[name + "_scale_inv"] = fp8_block_quantize(tensor, block)
        else:
            tensors[name] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    _write_config(
        src,
        dst,
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        },
    )
    return dst


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of a [..., rows, cols] weight, blocks of 32 along `cols`: (uint8 blocks [..., rows, cols/32, 16]
    with two e2m1 codes per byte, low nibble first; uint8 scales [..., rows, cols/32] = exponent + 127)."""
    *lead, rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of 32, got {cols}")
    groups = weight.float().reshape(*lead, rows, cols // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)  # e2m1's largest value is 6 = 1.5·2²
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - _E2M1).abs().argmin(dim=-1)  # nearest representable magnitude
    codes = (magnitude | ((scaled < 0) & (magnitude > 0)).long() << 3).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, cols] float32 from MXFP4 blocks and scales (the inverse of `mxfp4_quantize`)."""
    lut = torch.cat([_E2M1, -_E2M1])
    low, high = (blocks & 0xF).long(), (blocks >> 4).long()
    values = torch.stack([lut[low], lut[high]], dim=-1).reshape(*blocks.shape[:-1], 32)
    values = values * torch.exp2(scales.float() - 127)[..., None]
    return values.reshape(*values.shape[:-2], -1)


def save_mxfp4_copy(src: Path, dst: Path) -> Path:
    """Copy a saved gpt-oss model in `src` to `dst` with its experts MXFP4-quantised, as gpt-oss ships."""
    src, dst = Path(src), Path(dst)
    _copy_folder(src, dst)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # transformers keeps gpt-oss experts as [E, in, out]; the checkpoint quantises along `in`
            blocks, scales = mxfp4_quantize(tensor.transpose(-1, -2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    _write_config(src, dst, {"quant_method": "mxfp4", "modules_to_not_convert": None})
    return dst
