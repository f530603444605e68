"""Every way a model source can be bad gets a specific error, before anything is half-loaded."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch

import moeviz
from moeviz.errors import (
    CorruptWeightsError,
    ModelNotFoundError,
    ModelSourceError,
    NotAModelFolderError,
    NotMoEModelError,
    UnknownSampleError,
    UnsafeWeightsError,
)


def test_missing_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        moeviz.load_model(tmp_path / "nope")


def test_file_instead_of_folder(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x")
    with pytest.raises(NotAModelFolderError, match="is a file"):
        moeviz.load_model(path)


def test_folder_without_config(tmp_path):
    with pytest.raises(NotAModelFolderError, match=r"no config\.json"):
        moeviz.load_model(tmp_path)


def test_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(NotAModelFolderError, match="not valid JSON"):
        moeviz.load_model(tmp_path)


def test_unknown_sample_lists_available():
    with pytest.raises(UnknownSampleError, match="mixtral-healthy"):
        moeviz.load_model("sample:no-such-model")


def test_dense_model_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(NotMoEModelError, match=r"dense model.*LlamaForCausalLM"):
        moeviz.load_model(tmp_path)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_weights(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("mixtral"), tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptWeightsError, match="truncated"):
        moeviz.load_model(folder)


def test_garbage_weights(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("mixtral"), tmp_path / "m")
    (folder / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage header}" + b"\0" * 64
    )
    with pytest.raises(CorruptWeightsError, match="corrupt header"):
        moeviz.load_model(folder)


def test_missing_tensors(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_model_dir("mixtral"), tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    dropped = next(k for k in tensors if k.endswith("norm.weight"))
    del tensors[dropped]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CorruptWeightsError, match="incomplete"):
        moeviz.load_model(folder)


def test_no_weights_at_all(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("mixtral"), tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CorruptWeightsError, match="no weights"):
        moeviz.load_model(folder)


class _Exploit:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_malicious_pickle_is_refused(tiny_model_dir, tmp_path, capsys):
    folder = _copy(tiny_model_dir("mixtral"), tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with open(folder / "pytorch_model.bin", "wb") as handle:
        pickle.dump({"weight": _Exploit()}, handle)
    with pytest.raises(UnsafeWeightsError, match="weights_only"):
        moeviz.load_model(folder)
    assert "this must never run" not in capsys.readouterr().out


def test_plain_state_dict_pickle_loads(tiny_model_dir, tmp_path):
    """A .bin that is only tensors passes weights_only=True and gives the same routing."""
    from safetensors.torch import load_file

    folder = _copy(tiny_model_dir("mixtral"), tmp_path / "m")
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    from_bin = moeviz.capture(moeviz.load_model(folder), token_ids=[5, 6, 7])
    from_st = moeviz.capture(moeviz.load_model(tiny_model_dir("mixtral")), token_ids=[5, 6, 7])
    assert (from_bin.layers[0].experts == from_st.layers[0].experts).all()


def test_remote_code_needs_explicit_trust(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("mixtral"), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="my_custom_moe",
        architectures=["MyCustomMoeForCausalLM"],
        auto_map={"AutoConfig": "configuration_custom.CustomConfig"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_custom.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ModelSourceError, match="trust_remote_code"):
        moeviz.load_model(folder)


def test_kimi_k2_format_loads_as_deepseek_v3_without_remote_code(tiny_model_dir, tmp_path):
    """Kimi K2 folders say `model_type: kimi_k2` and ship remote code for DeepseekV3ForCausalLM."""
    reference = moeviz.load_model(tiny_model_dir("deepseek_v3"))
    folder = _copy(tiny_model_dir("deepseek_v3"), tmp_path / "k2")
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="kimi_k2",
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
        architectures=["DeepseekV3ForCausalLM"],
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_deepseek.py").write_text("raise SystemExit('remote code ran')\n")
    loaded = moeviz.load_model(folder)
    assert loaded.info.model_type == "deepseek_v3" and "kimi_k2" in loaded.info.notes[0]
    got = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8, 9]])
    want = moeviz.capture(reference, token_ids=[[5, 6, 7, 8, 9]])
    for a, b in zip(got.layers, want.layers, strict=True):
        assert (a.experts == b.experts).all() and a.bias is not None
