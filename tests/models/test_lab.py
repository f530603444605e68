"""The lab's training core (moeviz.lab): determinism, the dense case, save → load_model → capture, the
background runner and its server-wide limit, loss-free balancing and capacity drops. The configuration's
validation and presets: tests/unit/test_lab_config.py.

Runs use a tiny configuration (d_model 16, one or two layers, 2 × 16 tokens a step) so the module takes
seconds; the default configuration's speed and the presets' stories are measured by benchmarks/bench_lab.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch

from moeviz.lab import LabBusy, LabConfig, LabRun, LabRunner
from moeviz.lab.train import LOAD_WINDOW, capacity_keep
from moeviz.scoring import expert_capacity

TINY = LabConfig(experts=4, k=2, d_model=16, layers=2, batch=2, seq=16, steps=4, eval_every=2)


def test_same_config_and_seed_give_identical_histories():
    config = replace(TINY, router_noise=0.5, capacity_factor=1.0, bias_rate=0.01, z_coef=0.001)
    first, second = LabRun(config), LabRun(config)
    threads = torch.get_num_threads()
    first.run(), second.run()
    assert torch.get_num_threads() == threads  # the steps ran on one thread; the caller's count is back
    pd.testing.assert_frame_equal(first.history(), second.history())
    pd.testing.assert_frame_equal(first.load_history(), second.load_history())
    np.testing.assert_array_equal(first.bias(), second.bias())
    history = first.history()
    assert list(history["step"]) == [1, 2, 3, 4]
    assert history["heldout_loss"].isna().tolist() == [True, False, True, False]
    assert history["dropped_fraction"].gt(0).any()  # capacity 1.0 drops something at random init
    other = LabRun(replace(config, seed=1))
    other.run(1)
    assert other.history()["train_loss"].iloc[0] != history["train_loss"].iloc[0]


def test_dense_run_has_one_expert_doing_everything():
    run = LabRun(replace(TINY, experts=1, k=1, steps=2))
    history = run.run()
    loads = run.load_history()
    assert loads["load"].eq(1.0).all() and set(loads["expert"]) == {0}
    assert history["aux_loss_megatron"].eq(1.0).all()  # E · f · P = 1 for one expert: no gradient
    assert not history["collapsed"].any() and history["dead_experts_window_sum"].eq(0).all()
    assert np.isfinite(history["train_loss"]).all()


def test_saved_folder_routes_like_the_live_model(tmp_path):
    import moeviz

    run = LabRun(replace(TINY, steps=3))
    run.run()
    live = run.loaded_model()
    folder = run.save(tmp_path / "lab-model")
    assert {"config.json", "model.safetensors", "tokenizer.json", "lab.json"} <= {
        p.name for p in folder.iterdir()
    }
    reloaded = moeviz.load_model(folder)
    text = "def main():\n    return 1\nIn the beginning God created the heavens and the earth."
    ids = live.tokenizer(text)["input_ids"]
    assert reloaded.tokenizer(text)["input_ids"] == ids
    a, b = moeviz.capture(live, token_ids=[ids]), moeviz.capture(reloaded, token_ids=[ids])
    assert len(a.layers) == len(b.layers) == TINY.layers
    for la, lb in zip(a.layers, b.layers, strict=True):
        np.testing.assert_array_equal(la.experts, lb.experts)
        np.testing.assert_allclose(la.weights, lb.weights, atol=1e-6)
        assert la.bias is None
    # the live copy does not move while training goes on
    before = live.model.model.layers[0].mlp.gate.weight.clone()
    run2 = LabRun(replace(TINY, steps=3))
    run2.run(1)
    copy = run2.loaded_model()
    run2.run()
    assert torch.equal(before, live.model.model.layers[0].mlp.gate.weight)
    assert not torch.equal(
        copy.model.model.layers[0].mlp.gate.weight, run2.model.model.layers[0].mlp.gate.weight
    )


def test_bias_moves_against_the_load_and_capture_sees_it():
    import moeviz

    gamma = 0.01
    run = LabRun(replace(TINY, bias_rate=gamma, steps=2))
    run.step()
    slots = TINY.batch * TINY.seq * TINY.k
    loads = run.load_history()
    for layer in range(TINY.layers):
        counts = loads[loads["layer"] == layer].sort_values("expert")["load"].to_numpy() * slots
        counts = counts.round()
        expected = gamma * np.sign(counts.mean() - counts)  # overloaded experts go down, idle ones up
        np.testing.assert_allclose(run.bias()[layer], expected, atol=1e-7)
    assert np.abs(run.bias()).sum() > 0
    loaded = run.loaded_model()
    assert all(site.bias is not None for site in loaded.sites)
    trace = moeviz.capture(loaded, "In the beginning God created the heavens and the earth.")
    for layer, routing in enumerate(trace.layers):
        np.testing.assert_allclose(routing.bias, run.bias()[layer])
        chosen = np.sort(routing.experts, axis=1)
        by_selection = np.sort(np.argsort(-routing.selection_scores, axis=1)[:, : TINY.k], axis=1)
        np.testing.assert_array_equal(chosen, by_selection)


def test_capacity_drops_equal_an_independent_count():
    run = LabRun(replace(TINY, capacity_factor=0.75, steps=1))
    router = run.routers[0]
    router.train()
    router.lab_recording = True
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.normal_(0, 1.0, generator=generator)  # skewed routing: plenty of drops
        hidden = torch.randn(TINY.batch * TINY.seq, TINY.d_model, generator=generator)
        _, weights, indices = router(hidden)
    _, probs, _, kept, _ = router.lab_record
    router.lab_recording, router.lab_record = False, None
    cap = max(1, expert_capacity(TINY.seq, TINY.k, TINY.experts, 0.75))
    assert cap == math.ceil(0.75 * TINY.seq * TINY.k / TINY.experts)
    expected_dropped = 0
    for s in range(TINY.batch):
        rows = slice(s * TINY.seq, (s + 1) * TINY.seq)
        idx, p, keep = indices[rows].numpy(), probs[rows].numpy(), kept[rows].numpy()
        for e in range(TINY.experts):
            slots = list(zip(*np.nonzero(idx == e), strict=True))
            expected_dropped += max(0, len(slots) - cap)
            kept_p = sorted((p[t, e] for t, j in slots if keep[t, j]), reverse=True)
            dropped_p = [p[t, e] for t, j in slots if not keep[t, j]]
            assert len(kept_p) == min(cap, len(slots))
            assert not dropped_p or max(dropped_p) <= min(kept_p)  # the lowest probabilities go
    assert expected_dropped > 0
    assert int((~kept).sum()) == expected_dropped
    assert torch.equal(weights == 0, ~kept)
    # capacity_keep on its own: no drops when capacity exceeds every load
    assert capacity_keep(indices, probs, TINY.seq, 64.0).all()


def test_collapse_verdict_on_constructed_loads():
    run = LabRun(replace(TINY, experts=8, k=1, layers=1, batch=8, seq=64))
    tokens = 8 * 64
    uniform = np.full((1, 8), tokens // 8)
    one_expert = np.zeros((1, 8), dtype=np.int64)
    one_expert[0, 3] = tokens
    for counts, collapsed in ((uniform, False), (one_expert, True)):
        run._window.clear()
        for _ in range(LOAD_WINDOW):
            run._window.append((counts, np.zeros(1, dtype=np.int64)))
        assert run._collapsed([4.0]) is collapsed


def _wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


def test_runner_pauses_resumes_stops_and_is_limited(monkeypatch):
    monkeypatch.setenv("MOEVIZ_LAB_MAX_RUNS", "1")
    runner = LabRunner(replace(TINY, layers=1, steps=5_000))
    assert runner.state == "idle"
    runner.start()
    try:
        with pytest.raises(LabBusy, match="busy: 1 trainings are running on this server; try again"):
            LabRunner(TINY).start()
        _wait_for(lambda: runner.steps_done >= 2)
        assert runner.state == "running"
        runner.pause()
        assert runner.state == "paused"
        # the step in progress finishes, then the thread parks on the resume event: no step can run
        _wait_for(runner._parked.is_set)
        frozen = runner.steps_done
        history, loads = runner.snapshot()
        assert len(history) == frozen and len(loads) == frozen * 4
        assert runner._parked.is_set() and runner.steps_done == frozen  # still parked, nothing ran
        runner.resume()
        _wait_for(lambda: runner.steps_done > frozen + 1)
    finally:
        runner.stop(wait=20)
    assert runner.state == "stopped" and not runner.alive
    assert runner.error is None
    finished = LabRunner(replace(TINY, steps=2))  # the slot is free again
    finished.start()
    finished.join(20)
    assert finished.state == "done" and len(finished.snapshot()[0]) == 2
    assert finished.loaded_model().info.source.startswith("lab: E=4 k=2")
