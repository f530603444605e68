"""Lab fine-tune benchmark: training steps per CPU second of each mode (moeviz.lab.finetune) on the bundled
healthy Mixtral sample (4 layers, 8 experts, d 128), with the Lab's default batch (8 × 64 tokens).

Each mode's run is built once (not timed); then, `--repeats` times, every mode trains `--steps` steps in
turn (interleaved: a load change on the machine hits every mode alike). Timing is CPU time
(`time.process_time`) with torch on one thread (the Lab trains on one: `moeviz.lab.train.lab_threads`); no
evaluation runs inside the timed steps. Printed: steps/s per mode (median and spread over the repeats), and
the ratio of each mode's median to full fine-tuning's.

LoRA appears three times: on its default targets (attention and routers), on attention only, and on every
target (the fused expert tensors too, whose peft wrapper rebuilds each expert's B·A delta at every forward).

Run: .venv/bin/python benchmarks/bench_finetune.py [--repeats 3] [--steps 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from moeviz.lab.finetune import FinetuneConfig, FinetuneRun

VARIANTS = {
    "router": {"mode": "router"},
    "experts": {"mode": "experts"},
    "lora (attn+router)": {"mode": "lora"},
    "lora (attention)": {"mode": "lora", "lora_targets": ("attention",)},
    "lora (all targets)": {"mode": "lora", "lora_targets": ("attention", "router", "experts")},
    "full": {"mode": "full"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    total = args.repeats * args.steps + 1  # the last step (which evaluates) is never timed
    base = FinetuneConfig(steps=total, eval_every=total)
    runs = {name: FinetuneRun(dataclasses.replace(base, **changes)) for name, changes in VARIANTS.items()}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(args.repeats):
        for name, run in runs.items():
            start = time.process_time()
            for _ in range(args.steps):
                run.step()
            rates[name].append(args.steps / (time.process_time() - start))
        print(f"repeat {repeat + 1}: " + ", ".join(f"{n} {r[-1]:.2f}" for n, r in rates.items()))
    full = statistics.median(rates["full"])
    print(f"\nsteps per CPU second (batch {base.batch} × {base.seq}, 1 thread), median (spread):")
    for name, values in rates.items():
        median = statistics.median(values)
        print(
            f"  {name:20s} {median:6.2f}  ({min(values):.2f}–{max(values):.2f})  "
            f"{median / full:.2f}× full  trainable {runs[name].trainable:,}"
        )


if __name__ == "__main__":
    main()
