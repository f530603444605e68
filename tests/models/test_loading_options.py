"""Load options: dtype ("auto" keeps the checkpoint's), device choice, the memory check made before any weight
is read, loading progress, and what a loaded model records about itself."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import moeviz
from moeviz.errors import InsufficientMemoryError, LoadOptionError
from moeviz.models import memory, placement, safetensors_headers
from moeviz.testing.tiny_models import build_tiny_model
from tests.support.reference_routing import capture_with_router_inputs

SEQS = [list(range(3, 15)), [40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def bf16_mixtral(tmp_path_factory):
    """A tiny Mixtral saved in bfloat16 (config dtype bfloat16, BF16 tensors)."""
    folder = tmp_path_factory.mktemp("mixtral_bf16")
    build_tiny_model("mixtral").to(torch.bfloat16).save_pretrained(folder)
    return folder


def _no_weight_reads(monkeypatch):
    """Make any attempt to read weights fail the test."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def _tensor_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ---- dtype ----------------------------------------------------------------------------------------------
def test_auto_dtype_keeps_bf16_and_capture_is_what_the_bf16_model_computed(bf16_mixtral):
    loaded = moeviz.load_model(bf16_mixtral)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.info.dtype == "bfloat16"

    # Independent recomputation from what each router received: the bf16 projection the model does, then
    # Mixtral's rule (fp32 softmax, top-k, renormalise) written out here.
    trace, inputs = capture_with_router_inputs(loaded, SEQS)
    width = max(map(len, SEQS))
    for i, (site, layer) in enumerate(zip(loaded.sites, trace.layers, strict=True)):
        hidden = inputs[i].reshape(-1, inputs[i].shape[-1])
        assert hidden.dtype == torch.bfloat16
        with torch.no_grad():
            logits = F.linear(hidden, site.router.weight)  # bf16, as the model computes it
        probs = torch.softmax(logits.float(), dim=-1)
        top, experts = torch.topk(probs, 2, dim=-1)
        weights = top / top.sum(-1, keepdim=True)
        tokens = trace.tokens.iloc[layer.token_rows]
        flat = tokens.seq.to_numpy() * width + tokens.pos.to_numpy()
        np.testing.assert_array_equal(layer.logits, logits.float().numpy()[flat])
        np.testing.assert_array_equal(layer.experts, experts.numpy()[flat])
        # weights: the model's own (MixtralTopKRouter: softmax of logits.float(), topk, divide by the sum)
        # against the same torch ops on the same [N, E] tensor: one code path, so bitwise equal
        np.testing.assert_array_equal(layer.weights, weights.numpy()[flat])
        # scores are fp32 softmax of the bf16 logits, whatever the model's dtype: moeviz's numpy softmax
        # against torch's, two implementations whose exp and sum may round differently (2 ulps seen), so
        # equal within a few float32 ulps of each value, not within an absolute 1e-7
        assert layer.scores.dtype == np.float32
        np.testing.assert_allclose(
            layer.scores, probs.numpy()[flat], rtol=8 * np.finfo(np.float32).eps, atol=1e-30
        )


def test_explicit_dtypes(bf16_mixtral):
    for dtype, expected in (
        ("float32", torch.float32),
        (torch.float32, torch.float32),
        ("fp16", torch.float16),
    ):
        loaded = moeviz.load_model(bf16_mixtral, dtype=dtype)
        assert {p.dtype for p in loaded.model.parameters()} == {expected}
        assert loaded.info.dtype == str(expected).removeprefix("torch.")
    for bad in ("int8", "float64x", torch.int32):
        with pytest.raises(LoadOptionError, match="dtype"):
            moeviz.load_model(bf16_mixtral, dtype=bad)


def test_auto_dtype_loads_fp16_checkpoints_as_fp32_on_cpu():
    # the samples ship fp16 weights: CPUs only emulate fp16 arithmetic
    folder = moeviz.models.loading.sample_models_dir() / "mixtral-healthy"
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float16"
    loaded = moeviz.load_model("sample:mixtral-healthy")
    assert loaded.info.dtype == "float32"
    assert next(loaded.model.parameters()).dtype == torch.float32


def test_checkpoint_dtype_falls_back_to_the_safetensors_dtype(bf16_mixtral, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(bf16_mixtral)
    config.dtype = None
    assert placement.checkpoint_dtype(config, bf16_mixtral) == torch.bfloat16


# ---- device ---------------------------------------------------------------------------------------------
def test_device_auto_prefers_cuda_then_mps_then_cpu(monkeypatch):
    mps = torch.backends.mps
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(mps, "is_available", lambda: True)
    assert placement.pick_device("auto") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert placement.pick_device("auto") == torch.device("mps")
    monkeypatch.setattr(mps, "is_available", lambda: False)
    assert placement.pick_device("auto") == torch.device("cpu")
    assert placement.pick_device("cpu") == torch.device("cpu")
    with pytest.raises(LoadOptionError, match="no CUDA GPU"):
        placement.pick_device("cuda")
    with pytest.raises(LoadOptionError, match="MPS is not available"):
        placement.pick_device("mps")
    with pytest.raises(LoadOptionError, match="unknown device"):
        placement.pick_device("gpu0")


def test_offload_options_need_a_device_map(bf16_mixtral, tmp_path):
    with pytest.raises(LoadOptionError, match="need a device_map"):
        moeviz.load_model(bf16_mixtral, offload_folder=tmp_path)
    with pytest.raises(LoadOptionError, match="need a device_map"):
        moeviz.load_model(bf16_mixtral, max_memory={"cpu": "1GiB"})


def test_loaded_model_records_dtype_device_and_bytes(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("qwen3_moe"), device="cpu")
    assert loaded.device == torch.device("cpu")
    assert loaded.info.device == "cpu"
    assert loaded.info.dtype == "float32"
    assert loaded.info.parameter_bytes == _tensor_bytes(loaded.model)  # the estimate is exact for weights
    assert loaded.memory is not None and loaded.memory.parameter_bytes == loaded.info.parameter_bytes
    assert loaded.memory.available_bytes and loaded.memory.available_bytes > 0
    trace = moeviz.capture(loaded, token_ids=SEQS)
    assert trace.model.device == "cpu" and trace.model.parameter_bytes == loaded.info.parameter_bytes
    same = moeviz.Trace.from_parquet(_roundtrip(trace))
    assert same.model == trace.model


def _roundtrip(trace):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "t.parquet"
    trace.to_parquet(path)
    return path


# ---- memory check ---------------------------------------------------------------------------------------
def test_refuses_a_model_that_does_not_fit_before_reading_weights(bf16_mixtral, monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device, max_age=0.0: 200 * 1024)
    _no_weight_reads(monkeypatch)
    with pytest.raises(InsufficientMemoryError) as err:
        moeviz.load_model(bf16_mixtral)
    message = str(err.value)
    assert "200.0 KiB is free" in message and "on cpu at bfloat16" in message
    assert "of parameters" in message and "of activations for 2,048 tokens" in message
    assert "device_map='auto'" in message and "offload_folder" in message and "max_memory" in message
    assert "lower precision" not in message  # already 2 bytes per parameter
    with pytest.raises(InsufficientMemoryError, match=r"dtype='bfloat16' needs"):
        moeviz.load_model(bf16_mixtral, dtype="float32")


def test_memory_check_can_be_skipped(bf16_mixtral, monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device, max_age=0.0: 1024)
    loaded = moeviz.load_model(bf16_mixtral, check_memory=False)
    assert loaded.memory is not None and not loaded.memory.fits


def test_estimate_counts_parameters_at_the_load_dtype(bf16_mixtral):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(bf16_mixtral)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    fp32 = memory.parameter_bytes(skeleton, torch.float32)
    bf16 = memory.parameter_bytes(skeleton, torch.bfloat16)
    numel = sum(p.numel() for p in skeleton.parameters())
    assert fp32 - bf16 == 2 * numel  # floating parameters halve; buffers (rotary frequencies) stay fp32
    loaded = moeviz.load_model(bf16_mixtral)
    assert loaded.info.parameter_bytes == bf16 == _tensor_bytes(loaded.model)
    assert memory.activation_bytes(config, torch.bfloat16, 2048) > memory.activation_bytes(
        config, torch.bfloat16, 16
    )


def _mem_available() -> int | None:
    """/proc/meminfo's MemAvailable in bytes, read here (None off Linux)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")), None)


def test_available_memory_reads_the_system():
    before = _mem_available()
    free = memory.available_memory(torch.device("cpu"))
    after = _mem_available()
    if before is None:  # not Linux: the OS may not say
        assert free is None or free > 0
    else:  # the smaller of the OS's available memory and the cgroup's room: never above the OS's figure
        assert free is not None and 0 < free <= max(before, after) + 256 * 2**20
    assert memory.format_bytes(3 * 2**30) == "3.0 GiB"


def test_a_recent_free_memory_reading_is_reused_only_far_from_the_limit(monkeypatch):
    """Captures in a row read the free memory once a second; an input near the limit reads it now."""
    readings = iter(range(1 << 30, 0, -(1 << 20)))  # each reading 1 MiB less than the one before
    monkeypatch.setattr(memory, "_read_available", lambda device: next(readings))
    monkeypatch.setattr(memory, "_readings", {})
    cpu = torch.device("cpu")
    first = memory.available_memory(cpu)
    assert memory.available_memory(cpu, max_age=60.0) == first  # recent: reused
    assert memory.available_memory(cpu) == first - (1 << 20)  # max_age 0: read now
    shape = memory.ActivationShape(hidden=64, intermediate=128, experts=8, layers=2, heads=4, vocab=1000)
    need = shape.bytes(torch.float32, 100)
    memory.refuse_if_input_too_large(shape, torch.float32, cpu, 1, 100, "small")
    assert next(readings) == first - 2 * (1 << 20)  # far below the limit: no reading
    monkeypatch.setattr(memory, "_readings", {"cpu": (time.monotonic(), 4 * need - 1)})
    memory.refuse_if_input_too_large(shape, torch.float32, cpu, 1, 100, "near the limit")
    assert next(readings) == first - 4 * (1 << 20)  # near it: read once more


# ---- progress -------------------------------------------------------------------------------------------
def test_progress_reports_bytes_read(bf16_mixtral):
    calls: list[tuple[int, int]] = []
    moeviz.load_model(bf16_mixtral, progress=lambda done, total: calls.append((done, total)))
    total = sum(
        safetensors_headers._entry_bytes(e)
        for e in safetensors_headers.safetensors_entries(bf16_mixtral).values()
    )
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    done = [d for d, _ in calls]
    assert done == sorted(done)
    assert len({d for d in done if 0 < d < total}) > 5, "progress should advance tensor by tensor"
    # transformers' own bar is back in place for loads without a callback
    from transformers import core_model_loading

    assert not hasattr(core_model_loading.tqdm, "moeviz_original")


def test_progress_is_per_thread(bf16_mixtral, tiny_model_dir):
    """A load with a callback and loads without one, at once on other threads: each gets its own."""
    import threading

    calls: list[tuple[int, int]] = []
    other = tiny_model_dir("qwen3_moe")
    errors: list[BaseException] = []

    def load(source, progress=None):
        try:
            moeviz.load_model(source, progress=progress)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(other,)) for _ in range(2)]
    threads.append(threading.Thread(target=load, args=(bf16_mixtral, lambda d, t: calls.append((d, t)))))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert torch.get_default_dtype() == torch.float32  # loads at other dtypes did not leave theirs behind
    total = safetensors_headers.stored_bytes(bf16_mixtral)
    assert calls[-1] == (total, total) and all(t == total for _, t in calls)
    from transformers import core_model_loading

    assert not hasattr(core_model_loading.tqdm, "moeviz_original")


def test_capture_refuses_an_input_whose_activations_do_not_fit(tiny_model_dir, monkeypatch):
    loaded = moeviz.load_model(tiny_model_dir("qwen3_moe"))
    monkeypatch.setattr(memory, "available_memory", lambda device, max_age=0.0: 50 * 1024)
    with pytest.raises(
        InsufficientMemoryError, match=r"2 sequences × 12 tokens\) needs about .* 50\.0 KiB is free"
    ):
        moeviz.capture(loaded, token_ids=SEQS)
    assert not any(site.router._forward_hooks for site in loaded.sites)  # refused before hooks went in
    monkeypatch.setattr(memory, "available_memory", lambda device, max_age=0.0: None)  # unknown: no check
    assert moeviz.capture(loaded, token_ids=SEQS).layers


def test_placement_summary_names_devices_and_module_counts():
    model = torch.nn.Embedding(4, 2)
    assert placement.placement_summary(model) == "cpu"
    assert placement.input_device(model) == torch.device("cpu")
    model.hf_device_map = {"embed": "cpu", "layers.0": "disk", "layers.1": "disk", "head": 0}
    assert placement.placement_summary(model) == "cpu (1 module), disk (2 modules), cuda:0 (1 module)"
    model.hf_device_map = {"": "disk"}
    assert placement.placement_summary(model) == "disk (runs on cpu)"


def test_explicit_device_map_with_a_layer_on_disk(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("mixtral")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "disk",
        "model.layers.1": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    split = moeviz.load_model(folder, device_map=device_map, offload_folder=tmp_path / "offload")
    assert split.device == torch.device("cpu")
    assert split.info.device == "cpu (5 modules), disk (1 module)"
    got = moeviz.capture(split, token_ids=SEQS)
    expected = moeviz.capture(moeviz.load_model(folder), token_ids=SEQS)
    for a, b in zip(got.layers, expected.layers, strict=True):
        np.testing.assert_array_equal(a.experts, b.experts)
        np.testing.assert_allclose(a.weights, b.weights, atol=1e-6)
