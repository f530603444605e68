"""PEFT LoRA adapters as a model source (`moeviz.load_model(base, adapter=DIR)`, moeviz.models.adapters):
adapters made as users make them (peft's `get_peft_model(LoraConfig(...))` + `save_pretrained`) on a tiny
Qwen3-MoE, whose router is a `*TopKRouter` weight and whose experts are fused 3-D tensors.

Oracles: the base itself (an adapter whose B matrices are zero), and peft's own
`PeftModel.from_pretrained(base, dir).merge_and_unload()` run without hooks on the same tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import moeviz
from moeviz.errors import (
    CorruptWeightsError,
    InvalidConfigError,
    LoadOptionError,
    ModelSourceError,
    MoevizError,
    UnsafeWeightsError,
)
from moeviz.models.adapters import AdapterInfo
from tests.support.adapters import ATTENTION, FAMILY, ROUTER_AND_EXPERTS, save_adapter

TOKENS = [[5, 17, 33, 9, 61, 2, 88, 40, 12, 7, 101, 64, 3, 29, 77, 50]]


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir) -> Path:
    return tiny_model_dir(FAMILY)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    return save_adapter(tmp_path_factory.mktemp("adapter") / "lora")


def forward_logits(loaded) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(torch.tensor(TOKENS)).logits


def test_an_adapter_with_zero_b_routes_exactly_as_the_base(base_dir, tmp_path) -> None:
    adapter = save_adapter(tmp_path / "zero", random_b=False)
    from safetensors.torch import load_file

    stored = load_file(adapter / "adapter_model.safetensors")
    assert all(not t.any() for k, t in stored.items() if "lora_B" in k)  # the update is zero...
    assert any(t.any() for k, t in stored.items() if "lora_A" in k)  # ... though A is not

    base = moeviz.load_model(base_dir, dtype="float32")
    tuned = moeviz.load_model(base_dir, dtype="float32", adapter=adapter)
    a, b = moeviz.capture(base, token_ids=TOKENS), moeviz.capture(tuned, token_ids=TOKENS)
    for x, y in zip(a.layers, b.layers, strict=True):
        np.testing.assert_array_equal(x.experts, y.experts)
        np.testing.assert_array_equal(x.logits, y.logits)  # bitwise
    assert torch.equal(forward_logits(base), forward_logits(tuned))
    info = AdapterInfo.from_json(tuned.info.adapter)
    assert (info.peft_type, info.rank, info.alpha) == ("LORA", 4, 8.0)
    assert info.targets == sorted(ATTENTION) + sorted(ROUTER_AND_EXPERTS)
    assert base.info.adapter == ""


def test_an_adapter_routes_as_peft_merges_it(base_dir, adapter_dir) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tuned = moeviz.load_model(base_dir, dtype="float32", adapter=adapter_dir)
    trace = moeviz.capture(tuned, token_ids=TOKENS)

    reference = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(reference, adapter_dir).merge_and_unload().eval()
    with torch.no_grad():
        out = reference(torch.tensor(TOKENS), output_router_logits=True)  # no hooks: the model's own
    top_k = reference.config.num_experts_per_tok
    assert len(out.router_logits) == len(trace.layers)
    for routing, logits in zip(trace.layers, out.router_logits, strict=True):
        np.testing.assert_array_equal(routing.logits, logits.numpy())
        chosen = torch.topk(torch.softmax(logits, -1), top_k, dim=-1).indices.numpy()
        np.testing.assert_array_equal(np.sort(routing.experts, 1), np.sort(chosen, 1))
    assert torch.equal(forward_logits(tuned), out.logits)

    base = moeviz.capture(moeviz.load_model(base_dir, dtype="float32"), token_ids=TOKENS)
    moved = sum(
        (np.sort(x.experts, 1) != np.sort(y.experts, 1)).any(1).sum()
        for x, y in zip(base.layers, trace.layers, strict=True)
    )
    assert moved > 0  # the adapter does change the routing: the comparison above is not vacuous
    info = AdapterInfo.from_json(tuned.info.adapter)
    kinds = {name.rsplit(".", 1)[-1] for name in info.adapted}
    assert kinds == {"q_proj", "v_proj", "gate", "experts"}  # attention, router and fused experts


def test_the_adapter_survives_a_trace_round_trip(base_dir, adapter_dir, tmp_path) -> None:
    loaded = moeviz.load_model(base_dir, dtype="float32", adapter=adapter_dir)
    trace = moeviz.capture(loaded, token_ids=TOKENS)
    path = trace.to_parquet(tmp_path / "t.parquet")
    back = moeviz.Trace.from_parquet(path)
    assert back.model.adapter == loaded.info.adapter
    assert AdapterInfo.from_json(back.model.adapter).path == str(adapter_dir)


def snapshot(*folders: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for folder in folders
        for p in sorted(folder.rglob("*"))
    }


def refusal(
    base_dir: Path, adapter: Path, error: type[MoevizError], *, before_weights: bool, monkeypatch
) -> str:
    """The one line `load_model(base, adapter=...)` refuses with; nothing written in either folder, and (with
    `before_weights`) the base's weights never read."""
    if before_weights:
        import moeviz.models.loading as loading

        def no_weights(*args, **kwargs):
            raise AssertionError("the base's weights were read before the adapter was refused")

        monkeypatch.setattr(loading, "_materialise", no_weights)
    before = snapshot(base_dir, adapter)
    with pytest.raises(error) as caught:
        moeviz.load_model(base_dir, adapter=adapter)
    assert snapshot(base_dir, adapter) == before
    message = str(caught.value)
    assert "\n" not in message and str(adapter) in message
    return message


def test_an_adapter_for_another_base_is_refused_naming_the_tensor(base_dir, tmp_path, monkeypatch) -> None:
    other = save_adapter(tmp_path / "other", hidden_size=32)  # the same family, another hidden size
    message = refusal(base_dir, other, ModelSourceError, before_weights=False, monkeypatch=monkeypatch)
    assert "in the adapter, this base's module needs" in message
    assert "lora_A.weight" in message and "32]" in message and "64]" in message


def test_a_corrupt_safetensors_file_is_refused(base_dir, adapter_dir, tmp_path, monkeypatch) -> None:
    broken = Path(shutil.copytree(adapter_dir, tmp_path / "broken"))
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    message = refusal(base_dir, broken, CorruptWeightsError, before_weights=True, monkeypatch=monkeypatch)
    assert "truncated" in message


def test_pickled_adapter_weights_are_refused_unread(base_dir, tmp_path, monkeypatch) -> None:
    pickled = save_adapter(tmp_path / "pickled", safe=False)
    assert (pickled / "adapter_model.bin").is_file() and not (pickled / "adapter_model.safetensors").exists()

    def never(*args, **kwargs):
        raise AssertionError("adapter weights were unpickled")

    monkeypatch.setattr(torch, "load", never)
    message = refusal(base_dir, pickled, UnsafeWeightsError, before_weights=True, monkeypatch=monkeypatch)
    assert "adapter_model.bin" in message and "adapter_model.safetensors" in message


@pytest.mark.parametrize("rank", [0, -2, 2.5, True])
def test_a_rank_that_is_not_a_positive_integer_is_refused(
    base_dir, adapter_dir, tmp_path, monkeypatch, rank
) -> None:
    bad = Path(shutil.copytree(adapter_dir, tmp_path / "bad"))
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": rank}))
    message = refusal(base_dir, bad, InvalidConfigError, before_weights=True, monkeypatch=monkeypatch)
    assert "rank r must be a positive integer" in message


def test_a_target_the_base_lacks_is_refused_with_the_fused_names(
    base_dir, adapter_dir, tmp_path, monkeypatch
) -> None:
    # a transformers-4 style adapter: one Linear per expert, which transformers 5 fuses into 3-D tensors
    old = Path(shutil.copytree(adapter_dir, tmp_path / "old"))
    config = json.loads((old / "adapter_config.json").read_text())
    config.update(target_modules=["experts.0.gate_proj"], target_parameters=None)
    (old / "adapter_config.json").write_text(json.dumps(config))
    message = refusal(base_dir, old, ModelSourceError, before_weights=False, monkeypatch=monkeypatch)
    assert "'experts.0.gate_proj'" in message and "does not have" in message
    assert "mlp.experts.gate_up_proj" in message and "target_parameters" in message


def test_a_rank_above_the_layer_is_refused(base_dir, tmp_path, monkeypatch) -> None:
    wide = save_adapter(
        tmp_path / "wide", rank=16, modules=[], parameters=["mlp.gate.weight"]
    )  # gate: 8 × 64
    message = refusal(base_dir, wide, ModelSourceError, before_weights=False, monkeypatch=monkeypatch)
    assert "LoRA rank 16 is larger than the layer model.layers.0.mlp.gate (8 × 64)" in message


def test_an_adapter_is_not_merged_into_offloaded_weights(base_dir, adapter_dir) -> None:
    with pytest.raises(LoadOptionError, match="without a device_map"):
        moeviz.load_model(base_dir, adapter=adapter_dir, device_map="cpu")


def test_capture_takes_adapter_on_the_command_line(base_dir, adapter_dir, tmp_path, capsys) -> None:
    from moeviz.cli import main

    out = tmp_path / "t.parquet"
    ids = ",".join(map(str, TOKENS[0]))
    assert (
        main(
            [
                "capture",
                "--model",
                str(base_dir),
                "--adapter",
                str(adapter_dir),
                "--token-ids",
                ids,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    recorded = moeviz.Trace.from_parquet(out).model.adapter
    assert AdapterInfo.from_json(recorded).path == str(adapter_dir)
    with pytest.raises(SystemExit) as usage:  # report --trace loads no model: --adapter is a usage error
        main(["report", "--trace", str(out), "--adapter", str(adapter_dir)])
    assert usage.value.code == 2 and "--adapter does not apply to --trace" in capsys.readouterr().err
