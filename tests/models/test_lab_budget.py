"""The Lab cannot take the server down: a run's memory is estimated before it starts (and checked against
what a real run takes), runs above the server's budget are refused, a paused run times out and a finished
one lets go of its training state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeviz.errors import InputError
from moeviz.lab import LabBusy, LabConfig, LabRunner, LabTooLarge
from moeviz.lab.budget import memory_estimate, parameter_count
from moeviz.lab.data import lab_corpus
from moeviz.lab.runner import active_runs
from moeviz.lab.train import build_model

REPO = Path(__file__).resolve().parents[2]
TINY = LabConfig(d_model=16, experts=4, k=2, layers=1, batch=2, seq=16, steps=400, eval_every=400)


def test_the_parameter_count_is_the_models():
    for config in (TINY, LabConfig(d_model=64, experts=8, expert_ffn=96, layers=3)):
        model = build_model(config, lab_corpus())
        assert parameter_count(config, lab_corpus().vocab_size) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "fields",
    [
        {"d_model": 512, "experts": 16, "expert_ffn": 1024, "layers": 1, "batch": 4, "seq": 64},  # weights
        {
            "d_model": 128,
            "experts": 32,
            "expert_ffn": 256,
            "layers": 2,
            "batch": 16,
            "seq": 256,
        },  # activations
    ],
)
def test_the_estimate_bounds_what_a_real_run_takes(fields):
    """Peak resident memory a fresh process adds for a run of two steps: the estimate is above it, and not
    by more than 3× (a budget that refused runs three times too eagerly would be no use)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.lab_memory", json.dumps({**fields, "steps": 10})],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
        check=True,
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["measured"] <= figures["estimate"] <= 3 * figures["measured"], figures


def test_a_run_above_the_budget_is_refused_before_it_starts(monkeypatch):
    big = LabConfig(d_model=256, experts=32, expert_ffn=1024, layers=4)
    need = memory_estimate(big, lab_corpus().vocab_size).total
    monkeypatch.setenv("MOEVIZ_LAB_MEMORY_GIB", str(need / 2**30 / 2))
    runner = LabRunner(big)
    with pytest.raises(LabTooLarge, match=r"this run needs ≈ .* GiB .*M parameters.*MOEVIZ_LAB_MEMORY_GIB"):
        runner.start()
    assert runner.state == "idle" and active_runs() == 0


def test_runs_together_stay_within_the_budget(monkeypatch):
    need = memory_estimate(TINY, lab_corpus().vocab_size).total
    monkeypatch.setenv("MOEVIZ_LAB_MEMORY_GIB", str(1.5 * need / 2**30))  # room for one, not two
    monkeypatch.setenv("MOEVIZ_LAB_MAX_RUNS", "4")
    first, second = LabRunner(TINY), LabRunner(TINY)
    first.start()
    try:
        with pytest.raises(LabBusy, match=r"hold ≈ .* GiB of the .* GiB allowed"):
            second.start()
    finally:
        first.stop(wait=30)
    assert active_runs() == 0
    second = LabRunner(TINY)  # the memory came back with the slot
    second.start()
    second.stop(wait=30)


def test_a_paused_run_times_out_and_lets_go_of_its_training_state():
    runner = LabRunner(TINY, pause_limit=0.5)
    runner.start()
    while runner.steps_done == 0:
        time.sleep(0.05)
    runner.pause()
    runner.join(timeout=30)
    assert runner.state == "stopped" and "paused" in runner.note and "released" in runner.note
    assert runner.run.optimizer is None and all(p.grad is None for p in runner.run.model.parameters())
    assert active_runs() == 0
    assert runner.loaded_model().sites  # the weights stay for the other pages


def test_the_trained_tokens_are_capped():
    with pytest.raises(InputError, match=r"steps × batch × sequence length = 163,840,000 tokens"):
        LabConfig(steps=5000, batch=64, seq=512)
