"""The what-if flag bounds in time: how long the largest configuration each bound admits takes to place.

- `traffic` at P = TRAFFIC_MAX_SLOTS (512) slots per layer, the refinement's worst shape (one node, so the
  swaps run over all P copies at once), with DeepSeek-V3's 256 experts + 256 copies and 64 + 448;
- `eplb` at P = MAX_SLOTS (65,536): R = E·(G − 1), every one of 256 experts on each of 256 GPUs.

The bound is per layer: a model's time is this × its MoE layers. Skewed synthetic loads (Zipf-like counts,
random co-occurrence); CPU time (`time.process_time`, one numpy/torch thread), 3 repeats, median and spread.

Run: .venv/bin/python benchmarks/bench_whatif_bounds.py
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
from record import Figure, record

from moeviz.whatif.ep import MAX_SLOTS, TRAFFIC_MAX_SLOTS, EPConfig, traffic_placement
from moeviz.whatif.eplb import rebalance_experts

COMMAND = "python benchmarks/bench_whatif_bounds.py"


def loads(experts: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(counts [E], pairs [E, E]): Zipf-like expert loads and a symmetric co-occurrence table."""
    rng = np.random.default_rng(seed)
    counts = (1e5 / np.arange(1, experts + 1) ** 0.8)[rng.permutation(experts)].astype(np.int64)
    pairs = rng.integers(0, 200, (experts, experts))
    pairs = pairs + pairs.T
    np.fill_diagonal(pairs, 0)
    return counts, pairs


def cpu_seconds(work, repeats: int = 3) -> tuple[float, float, float]:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        work()
        times.append(time.process_time() - start)
    return statistics.median(times), min(times), max(times)


def main() -> None:
    torch.set_num_threads(1)
    figures = []
    for experts, gpus, per_node in ((256, 8, 8), (64, 8, 8)):
        config = EPConfig(
            gpus=gpus, gpus_per_node=per_node, redundant=TRAFFIC_MAX_SLOTS - experts, placement="traffic"
        )
        config.check_fit(experts)  # the largest the bound admits
        counts, pairs = loads(experts, seed=0)
        median, low, high = cpu_seconds(lambda: traffic_placement(counts, pairs, config))  # noqa: B023
        print(
            f"traffic, P = {TRAFFIC_MAX_SLOTS} (E {experts} + R {TRAFFIC_MAX_SLOTS - experts}) on {gpus} "
            f"GPUs, {per_node} per node: {median:.2f} s CPU per layer (spread {low:.2f}–{high:.2f})"
        )
        figures.append(
            Figure(
                "Deployment what-ifs",
                f"`traffic` placement at its bound, P = {TRAFFIC_MAX_SLOTS} (E {experts} + "
                f"R {TRAFFIC_MAX_SLOTS - experts}) on {gpus} GPUs, {per_node} per node, per layer",
                f"{median:.2f} s CPU ({low:.2f}–{high:.2f})",
                COMMAND,
            )
        )
    experts, gpus = 256, 256
    redundant = experts * (gpus - 1)
    assert experts + redundant == MAX_SLOTS
    EPConfig(gpus=gpus, gpus_per_node=8, redundant=redundant, placement="eplb").check_fit(experts)
    weight = loads(experts, seed=1)[0][None, :].astype(np.float64)
    median, low, high = cpu_seconds(lambda: rebalance_experts(weight, experts + redundant, 1, 1, gpus))
    print(
        f"eplb, R = E·(G − 1) = {redundant:,} (P = {experts + redundant:,}) on {gpus} GPUs: {median:.2f} s "
        f"CPU per layer (spread {low:.2f}–{high:.2f})"
    )
    figures.append(
        Figure(
            "Deployment what-ifs",
            f"`eplb` at its bound, R = E·(G − 1) = {redundant:,} (P = {experts + redundant:,}) on {gpus} "
            "GPUs, per layer",
            f"{median:.2f} s CPU ({low:.2f}–{high:.2f})",
            COMMAND,
        )
    )
    record("whatif_bounds", figures)


if __name__ == "__main__":
    main()
