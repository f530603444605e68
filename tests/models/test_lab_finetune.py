"""The Lab's fine-tuning (moeviz.lab.finetune) on the bundled healthy Mixtral sample: what each mode may
change, LoRA's zero start, the saved folders reopened by peft and by moeviz, the router mismatch against two
independent moeviz captures, the refusals, and the runner under the Lab's limits: training slots shared
with Lab runs, the memory budget, the pause limit and the training state released when it ends.

Runs are tiny (2–3 steps of 2 × 16 tokens) so the module takes seconds; speeds per mode are measured by
benchmarks/bench_finetune.py.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

import moeviz
from moeviz.errors import InputError, LabBusy, LabTooLarge
from moeviz.lab import LabConfig, LabRunner
from moeviz.lab.finetune import (
    LORA_TARGETS,
    FinetuneConfig,
    FinetuneRun,
    FinetuneRunner,
    finetune_summary,
    memory_needed,
    start_config,
    trainable_count,
)
from moeviz.lab.runner import PAUSE_LIMIT, active_runs
from moeviz.models.sites import find_moe_sites

SAMPLE = "sample:mixtral-healthy"
TINY = FinetuneConfig(start=SAMPLE, domain="python", steps=3, batch=2, seq=16, eval_every=1, lr=1e-2)


@pytest.fixture(scope="module")
def base():
    return moeviz.load_model(SAMPLE, dtype="float32", device="cpu")


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The transformers Mixtral's own parameters by their plain names (peft's wrapping names removed)."""
    out = {}
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer", "")
        out[plain] = parameter.detach().clone()
    return out


def _captured_sets(loaded, ids: torch.Tensor) -> np.ndarray:
    """moeviz's capture of token ids [B, S] → the top-k sets [layers, B·S, k] (row-major tokens)."""
    trace = moeviz.capture(loaded, token_ids=ids.tolist())
    return np.stack([np.sort(layer.experts, axis=-1) for layer in trace.layers])


def _changed(before: dict, after: dict, names) -> list[str]:
    return [name for name in names if not torch.equal(before[name], after[name])]


def test_router_only_changes_the_routers_and_nothing_else():
    run = FinetuneRun(dataclasses.replace(TINY, mode="router"))
    before = _weights(run.model)
    run.run()
    after = _weights(run.model)
    routers = [name for name in before if name.endswith("mlp.gate.weight")]
    others = [name for name in before if name not in routers]
    assert len(routers) == 4 and any(".mlp.experts." in name for name in others)
    assert _changed(before, after, others) == []  # experts, attention, norms, embeddings: bitwise equal
    assert _changed(before, after, routers) == routers


def test_experts_only_changes_the_experts_and_leaves_every_router_bitwise():
    run = FinetuneRun(dataclasses.replace(TINY, mode="experts"))
    before = _weights(run.model)
    run.run()
    after = _weights(run.model)
    experts = [name for name in before if ".mlp.experts." in name]
    routers = [name for name in before if name.endswith("mlp.gate.weight")]
    attention = [name for name in before if ".self_attn." in name]
    assert _changed(before, after, routers + attention) == []
    assert _changed(before, after, experts) == experts


def test_lora_before_its_first_step_routes_exactly_as_the_base(base):
    run = FinetuneRun(dataclasses.replace(TINY, mode="lora", lora_rank=4, lora_targets=LORA_TARGETS))
    lora_b = [p for name, p in run.model.named_parameters() if "lora_B" in name]
    assert lora_b and all(torch.count_nonzero(p) == 0 for p in lora_b)
    ids = run.data.heldout[:3]
    np.testing.assert_array_equal(run.routing(ids), _captured_sets(base, ids))
    assert run.history()["router_mismatch"].iloc[0] == 0.0


def test_saved_lora_adapter_reloads_with_peft_and_routes_as_the_fine_tuned_model(base, tmp_path):
    from peft import PeftModel

    run = FinetuneRun(dataclasses.replace(TINY, mode="lora", lora_rank=4, lora_targets=LORA_TARGETS))
    run.run()
    folder = run.save(tmp_path / "adapter")
    assert (folder / "adapter_model.safetensors").is_file() and (folder / "adapter_config.json").is_file()
    assert not list(folder.glob("*.bin"))
    fresh = moeviz.load_model(SAMPLE, dtype="float32", device="cpu").model
    merged = PeftModel.from_pretrained(fresh, folder).merge_and_unload().eval()
    reloaded = dataclasses.replace(base, model=merged, sites=find_moe_sites(merged))
    ids = run.data.heldout[:4]
    in_memory = run.routing(ids)  # the unmerged peft model the run trains
    assert not np.array_equal(in_memory, _captured_sets(base, ids))  # the fine-tune moved some routing
    np.testing.assert_array_equal(_captured_sets(reloaded, ids), in_memory)


def test_saved_full_model_reopens_through_load_model(tmp_path):
    run = FinetuneRun(dataclasses.replace(TINY, mode="full", steps=2))
    run.run()
    folder = run.save(tmp_path / "full")
    assert (folder / "model.safetensors").is_file()
    reopened = moeviz.load_model(str(folder), dtype="float32", device="cpu")
    mine = _weights(run.model)
    theirs = _weights(reopened.model)
    assert set(mine) == set(theirs)
    assert all(torch.equal(mine[name], theirs[name]) for name in mine)
    ids = run.data.heldout[:2]
    np.testing.assert_array_equal(_captured_sets(reopened, ids), run.routing(ids))


def test_mismatch_equals_two_independent_captures(base):
    run = FinetuneRun(dataclasses.replace(TINY, mode="full", steps=2, eval_every=2))
    run.run()
    ids = run.data.heldout
    before, after = _captured_sets(base, ids), _captured_sets(run.loaded_model(), ids)
    differs = np.any(before != after, axis=-1)  # [layers, tokens]
    recorded = run.history()["router_mismatch"].dropna()
    assert recorded.iloc[0] == 0.0
    assert 0 < differs.mean() < 1
    assert recorded.iloc[-1] == pytest.approx(differs.mean(), abs=0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lora_rank": 0}, "LoRA rank must be at least 1, got 0"),
        ({"lora_rank": -3}, "LoRA rank must be at least 1, got -3"),
        ({"mode": "adapters"}, "mode must be one of router, experts, lora, full"),
        ({"domain": None, "text": "  \n "}, "the text to fine-tune on is empty"),
        ({"domain": "klingon"}, "the new domain must be one of"),
        ({"lora_targets": ("mlp",)}, "LoRA targets must be some of attention, router, experts"),
    ],
)
def test_bad_config_is_one_line(changes, message):
    with pytest.raises(InputError, match=message) as caught:
        dataclasses.replace(TINY, **changes)
    assert "\n" not in str(caught.value)


def test_rank_larger_than_a_targeted_layer_is_refused_before_training():
    config = dataclasses.replace(TINY, mode="lora", lora_rank=9)  # the router is 8 × 128
    with pytest.raises(InputError, match="LoRA rank 9 is larger than the router") as caught:
        FinetuneRunner([config])
    assert "\n" not in str(caught.value)
    with pytest.raises(InputError, match="LoRA rank 129 is larger than attention"):
        FinetuneRun(dataclasses.replace(config, lora_rank=129, lora_targets=("attention",)))
    FinetuneRunner([dataclasses.replace(config, lora_targets=("attention", "experts"))])  # 9 ≤ 128: fine


def test_short_text_is_refused_and_a_long_one_trains():
    with pytest.raises(InputError, match=r"the text has \d+ tokens; it needs at least 32"):
        FinetuneRunner([dataclasses.replace(TINY, domain=None, text="def f(): pass")])
    text = "def add(a, b):\n    return a + b\n\n" * 40
    run = FinetuneRun(dataclasses.replace(TINY, domain=None, text=text, steps=1))
    run.run()
    assert set(run.data.parts) == {"new", "old"}
    assert np.isfinite(run.history()["new_loss"]).sum() == 2


def test_trainable_counts_and_memory_follow_the_mode():
    model_config = start_config(TINY)
    needs = {}
    for mode in ("router", "experts", "lora", "full"):
        config = dataclasses.replace(TINY, mode=mode, lora_rank=4)
        run = FinetuneRun(config)
        counted = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in run.model.parameters())
        assert trainable_count(config, model_config) == (counted, total)
        needs[mode] = memory_needed(config, model_config)
    assert needs["router"].total < needs["lora"].total < needs["experts"].total < needs["full"].total
    frozen_bytes = needs["full"].weights_and_optimizer - needs["router"].weights_and_optimizer
    assert frozen_bytes == 20 * (trainable_count(TINY.with_mode("full"), model_config)[0] - 4 * 128 * 8)


def test_runner_trains_each_mode_and_the_summary_reads_their_histories():
    configs = [dataclasses.replace(TINY, mode=mode, steps=2, eval_every=2) for mode in ("router", "full")]
    runner = FinetuneRunner(configs)
    runner.start()
    runner.join(120)
    assert runner.state == "done", runner.error
    results = runner.results()
    assert [r.config.mode for r in results] == ["router", "full"]
    assert runner.steps_done == runner.total_steps == 4
    summary = finetune_summary(results)
    for row, result in zip(summary.itertuples(index=False), results, strict=True):
        evaluated = result.history.dropna(subset=["new_loss"])
        assert row[summary.columns.get_loc("new loss drop")] == pytest.approx(
            evaluated["new_loss"].iloc[0] - evaluated["new_loss"].iloc[-1]
        )
        assert row[summary.columns.get_loc("old loss rise")] == pytest.approx(
            evaluated["old_loss"].iloc[-1] - evaluated["old_loss"].iloc[0]
        )
    assert runner.run.optimizer is None  # the finished run released its training state


def test_the_labs_own_model_fine_tunes_in_every_mode():
    from moeviz.lab import LabConfig, LabRun

    lab = LabRun(LabConfig(experts=4, k=2, d_model=16, layers=2, batch=2, seq=16, steps=2, bias_rate=0.01))
    lab.run()
    start = lab.loaded_model()
    for mode in ("router", "lora"):
        config = dataclasses.replace(TINY, start="lab: run 1", mode=mode, lora_rank=4, steps=2)
        run = FinetuneRun(config, start)
        run.run()
        assert run.experts == 4 and run.history()["router_mismatch"].notna().sum() == 3
    with pytest.raises(InputError, match="LoRA rank 5 is larger than the router"):
        FinetuneRun(dataclasses.replace(config, lora_rank=5), start)  # the Lab's router is 4 × 16


def _wait_for(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_fine_tunes_and_lab_runs_share_the_servers_training_slots(monkeypatch):
    """MOEVIZ_LAB_MAX_RUNS counts Lab runs and fine-tunes together: with one slot, either kind holding it
    refuses the other until it ends."""
    monkeypatch.setenv("MOEVIZ_LAB_MAX_RUNS", "1")
    lab = LabRunner(LabConfig(experts=4, k=2, d_model=16, layers=1, batch=2, seq=16, steps=5_000))
    lab.start()
    try:
        with pytest.raises(LabBusy, match="busy: 1 trainings are running"):
            FinetuneRunner([dataclasses.replace(TINY, mode="router")]).start()
    finally:
        lab.stop(wait=30)
    fine_tune = FinetuneRunner([dataclasses.replace(TINY, mode="router", steps=5_000)])
    fine_tune.start()
    try:
        assert active_runs() == 1
        with pytest.raises(LabBusy, match="busy: 1 trainings are running"):
            LabRunner(LabConfig(steps=2)).start()
    finally:
        fine_tune.stop(wait=60)
    assert fine_tune.state == "stopped" and active_runs() == 0


def test_a_fine_tune_counts_against_the_labs_memory_budget(monkeypatch):
    """The runner's estimate is the largest mode's training plus the other modes' fp32 weights
    (`memory_needed`); above the budget it is refused before it starts, and the memory a Lab run holds
    counts against it."""
    configs = [dataclasses.replace(TINY, mode=mode) for mode in ("router", "full")]
    model_config = start_config(TINY)
    needs = [memory_needed(config, model_config) for config in configs]
    expected = needs[1].total + 4 * needs[0].parameters  # full trains; router's model is kept beside it
    runner = FinetuneRunner(configs)
    assert runner.memory.total == expected
    monkeypatch.setenv("MOEVIZ_LAB_MEMORY_GIB", str(expected / 2**30 / 2))
    with pytest.raises(LabTooLarge, match="MOEVIZ_LAB_MEMORY_GIB"):
        runner.start()
    monkeypatch.setenv("MOEVIZ_LAB_MEMORY_GIB", str(1.5 * expected / 2**30))
    monkeypatch.setenv("MOEVIZ_LAB_MAX_RUNS", "4")
    lab = LabRunner(LabConfig(experts=4, k=2, d_model=16, layers=1, batch=2, seq=16, steps=5_000))
    monkeypatch.setattr(lab, "memory", dataclasses.replace(lab.memory, activations=expected))
    lab.start()
    try:
        with pytest.raises(LabBusy, match=r"hold ≈ .* GiB of the .* GiB allowed"):
            FinetuneRunner(configs).start()
    finally:
        lab.stop(wait=30)
    assert active_runs() == 0


def test_a_paused_fine_tune_times_out_and_every_run_lets_go_of_its_training_state():
    """Paused past its limit, a fine-tune stops like a Lab run; the finished mode and the one paused keep
    their weights but no gradients and no AdamW state."""
    configs = [dataclasses.replace(TINY, mode="router", steps=2), dataclasses.replace(TINY, steps=5_000)]
    assert FinetuneRunner(configs).pause_limit == LabRunner(LabConfig()).pause_limit == PAUSE_LIMIT
    runner = FinetuneRunner(configs, pause_limit=0.3)
    runner.start()
    _wait_for(lambda: len(runner.runs) == 2 and runner.runs[1].steps_done >= 1)
    runner.pause()
    runner.join(timeout=60)
    assert runner.state == "stopped" and "paused" in runner.note and "released" in runner.note
    assert active_runs() == 0 and [run.config.mode for run in runner.runs] == ["router", "lora"]
    for run in runner.runs:
        assert run.optimizer is None and all(p.grad is None for p in run.model.parameters())
    assert runner.runs[1].loaded_model().sites  # the weights stay for the other pages
