"""Lab benchmark: 300 steps of the default configuration (target < 60 s on 2 CPU cores, issue 17), and the
stories the three presets tell.

Timing: wall (`time.perf_counter`) and CPU (`time.process_time`, all threads) of building the run and
training it, `--repeats` times; median and spread (min–max). Each step runs on one torch thread
(moeviz.lab.train.lab_threads, set for the training thread only), whatever the process's setting.

Stories (`--presets`): per preset one full run; the step at which moeviz's collapse verdict first trips,
held-out loss, and per layer at the end (mean over the last 10 steps): normalised load entropy, the largest
expert share (fair share 1/E) and the experts with no load.

Run: .venv/bin/python benchmarks/bench_lab.py [--repeats 3] [--presets]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from record import Figure, flags, record

from moeviz.lab import PRESETS, LabConfig, LabRun
from moeviz.lab.data import lab_corpus


def timed_run(config: LabConfig) -> tuple[float, float, LabRun]:
    wall, cpu = time.perf_counter(), time.process_time()
    run = LabRun(config)
    run.run()
    return time.perf_counter() - wall, time.process_time() - cpu, run


def story(run: LabRun) -> str:
    c = run.config
    history, loads = run.history(), run.load_history()
    tail = loads[loads["step"] > c.steps - 10].groupby(["layer", "expert"])["load"].mean()
    lines = [
        f"  collapse_step={run.collapse_step}"
        f" final held-out loss={history['heldout_loss'].dropna().iloc[-1]:.3f}"
        f" train loss={history['train_loss'].tail(10).mean():.3f}"
        f" aux_loss_megatron={history['aux_loss_megatron'].iloc[-1]:.3f}"
        f" z_loss={history['z_loss'].iloc[-1]:.2f} collapsed steps={int(history['collapsed'].sum())}"
    ]
    for layer in range(c.layers):
        share = tail.loc[layer].to_numpy()
        p = share[share > 0] / share.sum()
        entropy = float(-(p * np.log(p)).sum() / np.log(c.experts)) if c.experts > 1 else 1.0
        lines.append(
            f"  layer {layer}: load entropy {entropy:.2f}, max share {share.max():.2f}"
            f" (fair {1 / c.experts:.3f}),"
            f" dead {int((share == 0).sum())}, shares {np.round(share, 2).tolist()}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--presets", action="store_true", help="also run the presets and print their stories")
    args = parser.parse_args()
    start = time.perf_counter()
    lab_corpus()
    print(f"corpus tokenised in {time.perf_counter() - start:.2f} s; torch threads {torch.get_num_threads()}")
    config = LabConfig()
    walls, cpus = [], []
    last = None
    for i in range(args.repeats):
        wall, cpu, last = timed_run(config)
        walls.append(wall)
        cpus.append(cpu)
        print(
            f"default ({config.label()}), {config.steps} steps, run {i + 1}:"
            f" wall {wall:.1f} s, CPU {cpu:.1f} s"
        )
    print(
        f"default: wall median {statistics.median(walls):.1f} s (spread {min(walls):.1f}–{max(walls):.1f}),"
        f" CPU median {statistics.median(cpus):.1f} s (spread {min(cpus):.1f}–{max(cpus):.1f});"
        " target < 60 s wall"
    )
    if last is not None:
        params = sum(p.numel() for p in last.model.parameters())
        print(f"params {params:,}; step time {last.elapsed / config.steps * 1000:.0f} ms")
    wall = statistics.median(walls)
    record(
        "lab",
        [
            Figure(
                "Teaching lab",
                f"{config.steps} steps of the default configuration ({config.label()}), build + train, "
                f"{args.repeats} runs",
                f"wall {wall:.1f} s ({min(walls):.1f}–{max(walls):.1f}); "
                f"CPU {statistics.median(cpus):.1f} s ({min(cpus):.1f}–{max(cpus):.1f})",
                f"python benchmarks/bench_lab.py{flags(parser, args)}",
                "< 60 s wall",
                wall < 60,
            )
        ],
    )
    if args.presets:
        for name, preset in PRESETS.items():
            wall, cpu, run = (walls[-1], cpus[-1], last) if preset == config and last else timed_run(preset)
            print(f"preset {name!r} ({preset.label()}): wall {wall:.1f} s, CPU {cpu:.1f} s")
            print(story(run))


if __name__ == "__main__":
    main()
