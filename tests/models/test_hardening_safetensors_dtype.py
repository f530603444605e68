"""A safetensors header whose dtype does not describe its bytes is refused, naming the tensor: a float16
router declared int16 spans the same bytes (the header checks cannot see it) and transformers cast the
integers to floats without a word. Integers where the model holds integers, or under names it does not
hold, still load. A header of 10^5 nested arrays is a corrupt header, not a RecursionError."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moeviz
from moeviz.errors import CorruptWeightsError

ROUTER = "model.layers.0.block_sparse_moe.gate.weight"


def _float16_copy(tiny_model_dir, folder: Path, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """The tiny Mixtral saved again in float16 (as most checkpoints are stored), plus `extra` tensors."""
    shutil.copytree(tiny_model_dir("mixtral"), folder)
    tensors = {name: t.to(torch.float16) for name, t in load_file(folder / "model.safetensors").items()}
    save_file({**tensors, **(extra or {})}, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "float16"}))
    return folder


def _declare(path: Path, tensor: str, dtype: str) -> None:
    """Rewrite one header entry's dtype, the bytes untouched (the new dtype of the same width)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header[tensor]["dtype"] = dtype
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def test_float16_router_declared_int16_is_refused_naming_it(tiny_model_dir, tmp_path):
    folder = _float16_copy(tiny_model_dir, tmp_path / "m")
    _declare(folder / "model.safetensors", ROUTER, "I16")
    with pytest.raises(CorruptWeightsError, match=rf"tensor '{ROUTER}' is declared I16 \(integers\)") as info:
        moeviz.load_model(folder)
    assert "\n" not in str(info.value)


def test_float32_router_declared_int32_is_refused(tiny_model_dir, tmp_path):
    folder = shutil.copytree(tiny_model_dir("mixtral"), tmp_path / "m")
    _declare(folder / "model.safetensors", "lm_head.weight", "I32")
    with pytest.raises(CorruptWeightsError, match=r"tensor 'lm_head\.weight' is declared I32"):
        moeviz.load_model(folder)


def test_float16_checkpoint_still_loads_its_router_exactly(tiny_model_dir, tmp_path):
    """The same copy, declared honestly, loads; its router holds the stored float16 values (as float32 on a
    CPU), read here from the file itself. An integer tensor under a name the model does not hold is left
    to transformers, which ignores it."""
    folder = _float16_copy(tiny_model_dir, tmp_path / "m", extra={"model.step_counter": torch.arange(4)})
    loaded = moeviz.load_model(folder)
    stored = load_file(folder / "model.safetensors")[ROUTER]
    router = loaded.model.model.layers[0].mlp.gate.weight
    assert torch.equal(router.detach().cpu(), stored.to(router.dtype))


def test_header_of_100000_nested_arrays_is_refused(tiny_model_dir, tmp_path):
    folder = shutil.copytree(tiny_model_dir("mixtral"), tmp_path / "m")
    raw = ("[" * 100_000 + "]" * 100_000).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 64)
    with pytest.raises(CorruptWeightsError, match=r"model\.safetensors has a corrupt header \(JSON nested"):
        moeviz.load_model(folder)
