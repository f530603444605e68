"""A model larger than its memory budget: `device_map` with disk offload under `max_memory` captures the same
routing as an in-memory load while the process's memory stays near the budget.

The model is random, built here at full Qwen3-30B-A3B width (hidden 2048, 32 heads of 128, expert
intermediate 768) with 3 layers of 16 experts (~540 MiB in bf16), never downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

MiB = 2**20
TOKENS = [list(range(3, 35)), list(range(40, 60))]

# Runs in a fresh interpreter: load with the given placement + capture, sampling /proc/self/status every
# 5 ms (the load starts once the interpreter's own memory is sampled); then, for reference, the same capture
# on an in-memory load (MKL_CBWR=COMPATIBLE is set so that MKL's kernel choice does not depend on where the
# weights happen to lie in memory). Resident memory is
# reported split into anonymous pages (what the process allocated: the part that counts against a budget)
# and file-backed pages (the checkpoint's safetensors, memory-mapped while transformers reads it: clean page
# cache the kernel drops under pressure), with VmHWM (the peak of their sum; ru_maxrss would include the
# forking pytest process's own peak, which Linux carries across exec).
PROBE = textwrap.dedent(
    """
    import json, sys, threading, time
    import accelerate, moeviz, torch
    import transformers.models.qwen3_moe.modeling_qwen3_moe

    def status():
        out = {}
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(("RssAnon", "RssFile", "VmHWM")):
                    key, value = line.split(":")
                    out[key] = int(value.split()[0]) * 1024
        return out

    peaks, phase, running, sampled = {}, ["base"], [True], threading.Event()

    def sample():
        while running[0]:
            now, peak = status(), peaks.setdefault(phase[0], {})
            for key, value in now.items():
                peak[key] = max(peak.get(key, 0), value)
            sampled.set()
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    assert sampled.wait(60), "the memory sampler never ran"  # the base line is recorded before the load
    folder, kwargs, tokens = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    phase[0] = "load"
    loaded = moeviz.load_model(folder, **kwargs)
    phase[0] = "capture"
    trace = moeviz.capture(loaded, token_ids=tokens)
    hwm, device_map, device = status()["VmHWM"], loaded.model.hf_device_map, loaded.info.device
    del loaded
    before_reference = status()["RssAnon"]
    phase[0] = "reference"
    in_memory = moeviz.load_model(folder)
    expected = moeviz.capture(in_memory, token_ids=tokens)
    running[0] = False
    sampler.join()

    def routing(t):
        return [[layer.experts.tolist(), layer.weights.tolist(), layer.logits.tolist()] for layer in t.layers]

    print(json.dumps({
        "peaks": peaks,
        "hwm": hwm,
        "before_reference": before_reference,
        "device_map": {k: str(v) for k, v in device_map.items()},
        "device": device,
        "dtype": in_memory.info.dtype,
        "routing": routing(trace),
        "expected": routing(expected),
    }))
    """
)


def _build_wide_qwen3_moe(folder) -> int:
    """Save a random 3-layer Qwen3-MoE at Qwen3-30B-A3B width in bf16; returns its parameter bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=256,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=16,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=3,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")  # random values below are cheaper than the initialisers
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:  # routers get a larger scale so that routing is far from uniform
                scale = 0.5 if ".mlp.gate." in name else 0.02
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.bfloat16) * scale)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder)
    return size


def _probe(folder, kwargs) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(folder), json.dumps(kwargs), json.dumps(TOKENS)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "MKL_CBWR": "COMPATIBLE"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_disk_offload_under_a_budget_captures_the_in_memory_routing(tmp_path):
    folder = tmp_path / "wide-qwen3-moe"
    model_bytes = _build_wide_qwen3_moe(folder)
    budget = int(0.4 * model_bytes)

    offload = tmp_path / "offload"
    try:
        run = _probe(
            folder, {"device_map": "auto", "max_memory": {"cpu": budget}, "offload_folder": str(offload)}
        )
    finally:  # ~0.9 GB of checkpoint and offloaded weights: do not leave them in pytest's kept temp dirs
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(offload, ignore_errors=True)
    assert "disk" in run["device_map"].values(), run["device_map"]
    assert "disk" in run["device"]
    assert run["dtype"] == "bfloat16"
    assert len(run["routing"]) == 3
    for offloaded, in_memory in zip(run["routing"], run["expected"], strict=True):
        for got, expected in zip(offloaded, in_memory, strict=True):  # experts, weights, logits
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))

    peaks = run["peaks"]
    base = peaks["base"]["RssAnon"]
    grown_load = peaks["load"]["RssAnon"] - base
    grown_capture = peaks["capture"]["RssAnon"] - base
    grown_in_memory = peaks["reference"]["RssAnon"] - run["before_reference"]
    print(
        f"\nmodel {model_bytes / MiB:.0f} MiB, budget {budget / MiB:.0f} MiB; anonymous memory above the "
        f"interpreter's {base / MiB:.0f} MiB: load +{grown_load / MiB:.0f} MiB, capture "
        f"+{grown_capture / MiB:.0f} MiB; file-backed peak {peaks['load']['RssFile'] / MiB:.0f} MiB; "
        f"VmHWM {run['hwm'] / MiB:.0f} MiB; map {sorted(set(run['device_map'].values()))}; "
        f"an in-memory load + capture afterwards: +{grown_in_memory / MiB:.0f} MiB"
    )
    # What the process allocated stays near the budget (one layer's experts are fused while loading) and
    # well below the model's size.
    assert grown_load < budget + 0.25 * model_bytes
    assert grown_capture < budget + 0.25 * model_bytes
    assert max(grown_load, grown_capture) < 0.75 * model_bytes
