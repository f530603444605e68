"""Lab fine-tune benchmark: training steps per CPU second of each mode (moeviz.lab.finetune) on the bundled
healthy Mixtral sample (4 layers, 8 experts, d 128), with the Lab's default batch (8 × 64 tokens).

Each mode's run is built once (not timed); then, `--repeats` times, every mode trains `--steps` steps in
turn (interleaved: a load change on the machine hits every mode alike). Timing is CPU time
(`time.process_time`) with torch on one thread (the Lab trains on one: `moeviz.lab.train.lab_threads`); no
evaluation runs inside the timed steps. Printed: steps/s per mode (median and spread over the repeats), and
the ratio of each mode's median to full fine-tuning's.

LoRA appears three times: on its default targets (attention and routers), on attention only, and on every
target (the fused expert tensors too, whose peft wrapper rebuilds each expert's B·A delta at every forward).

Adapter capture overhead: the sample with a LoRA adapter (rank 8 on attention q/v, the routers and the fused
expert tensors, saved by peft as tests/support/adapters.py saves them) loaded through
`moeviz.load_model(base, adapter=DIR)`, against the same adapter merged by peft (`merge_and_unload`) and saved
as a plain model folder, loaded by `load_model(folder)`; both capture the same 512 tokens (`--tokens`),
interleaved round by round (`--rounds`, the order rotated), CPU time, one thread; per repeat the ratio of the
medians adapter / merged; printed the ratio's median and spread over the repeats (target ≤ 1.05×). The two
models' weights and routing are checked to be identical first.

Figures go to benchmarks/results/finetune.json (`record`).

Run: .venv/bin/python benchmarks/bench_finetune.py [--repeats 3] [--steps 10] [--tokens 512] [--rounds 10]
    [--parts steps,capture]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the adapter helper lives with the tests
from record import Figure, flags, record

import moeviz
from moeviz.lab.finetune import FinetuneConfig, FinetuneRun
from moeviz.models.loading import sample_models_dir
from tests.support.adapters import save_adapter_over

SAMPLE = "mixtral-healthy"
CAPTURE_TARGET = 1.05
ADAPTER_RANK = 8  # the sample's routers are 8 × 128: the largest rank they allow

VARIANTS = {
    "router": {"mode": "router"},
    "experts": {"mode": "experts"},
    "lora (attn+router)": {"mode": "lora"},
    "lora (attention)": {"mode": "lora", "lora_targets": ("attention",)},
    "lora (all targets)": {"mode": "lora", "lora_targets": ("attention", "router", "experts")},
    "full": {"mode": "full"},
}


def steps_per_second(
    repeats: int, steps: int
) -> tuple[dict[str, list[float]], dict[str, int], FinetuneConfig]:
    """Per variant, steps per CPU second of each repeat; per variant its trainable parameters; the config."""
    total = repeats * steps + 1  # the last step (which evaluates) is never timed
    base = FinetuneConfig(steps=total, eval_every=total)
    runs = {name: FinetuneRun(dataclasses.replace(base, **changes)) for name, changes in VARIANTS.items()}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(repeats):
        for name, run in runs.items():
            start = time.process_time()
            for _ in range(steps):
                run.step()
            rates[name].append(steps / (time.process_time() - start))
        print(f"repeat {repeat + 1}: " + ", ".join(f"{n} {r[-1]:.2f}" for n, r in rates.items()), flush=True)
    return rates, {name: run.trainable for name, run in runs.items()}, base


def adapter_and_merged(folder: Path) -> tuple[moeviz.LoadedModel, moeviz.LoadedModel]:
    """The sample with a saved LoRA adapter loaded through moeviz (`adapter=`), and the same adapter merged by
    peft and saved as a plain model folder, loaded through moeviz; both fp32 on the CPU."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sample = sample_models_dir() / SAMPLE
    base = AutoModelForCausalLM.from_pretrained(sample, dtype=torch.float32)
    adapter = save_adapter_over(copy.deepcopy(base), folder / "adapter", rank=ADAPTER_RANK)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.save_pretrained(folder / "merged", safe_serialization=True)
    AutoTokenizer.from_pretrained(sample).save_pretrained(folder / "merged")
    options = {"dtype": "float32", "device": "cpu"}
    return (
        moeviz.load_model(f"sample:{SAMPLE}", adapter=adapter, **options),
        moeviz.load_model(folder / "merged", **options),
    )


def _routing(trace) -> np.ndarray:
    return np.stack([np.sort(layer.experts, axis=-1) for layer in trace.layers])


def capture_ratios(tokens: int, rounds: int, repeats: int) -> tuple[list[float], dict[str, float]]:
    """Per repeat the ratio of median capture CPU times adapter / merged (interleaved rounds), and each
    contender's median seconds over all rounds. Raises when the two models' weights or routing differ."""
    with tempfile.TemporaryDirectory(prefix="bench-finetune-") as tmp:
        loaded = dict(zip(("adapter", "merged"), adapter_and_merged(Path(tmp)), strict=True))
    theirs = dict(loaded["merged"].model.named_parameters())
    differ = [n for n, p in loaded["adapter"].model.named_parameters() if not torch.equal(p, theirs[n])]
    if differ or set(theirs) != {n for n, _ in loaded["adapter"].model.named_parameters()}:
        raise SystemExit(f"the adapter loaded by moeviz and the merged folder differ: {differ[:3]}")
    vocab = loaded["merged"].model.config.vocab_size
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))[0].tolist()
    traces = {name: moeviz.capture(model, token_ids=[ids]) for name, model in loaded.items()}  # warm-up
    if not np.array_equal(_routing(traces["adapter"]), _routing(traces["merged"])):
        raise SystemExit("the adapter loaded by moeviz routes differently from the merged folder")
    names = list(loaded)
    ratios, everything = [], {name: [] for name in names}
    for repeat in range(repeats):
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(rounds):
            for name in names[round_ % 2 :] + names[: round_ % 2]:
                start = time.process_time()
                moeviz.capture(loaded[name], token_ids=[ids])
                times[name].append(time.process_time() - start)
        ratios.append(statistics.median(times["adapter"]) / statistics.median(times["merged"]))
        for name in names:
            everything[name] += times[name]
        print(f"capture repeat {repeat + 1}: adapter / merged {ratios[-1]:.3f}", flush=True)
    return ratios, {name: statistics.median(values) for name, values in everything.items()}


def _spread(values: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10, help="interleaved capture rounds per repeat")
    parser.add_argument("--parts", default="steps,capture", help="comma-separated: steps, capture")
    args = parser.parse_args()
    torch.set_num_threads(1)
    parts = {p.strip() for p in args.parts.split(",")}
    command = f"python benchmarks/bench_finetune.py{flags(parser, args)}"
    figures: list[Figure] = []
    if "steps" in parts:
        rates, trainable, base = steps_per_second(args.repeats, args.steps)
        full = statistics.median(rates["full"])
        print(f"\nsteps per CPU second (batch {base.batch} × {base.seq}, 1 thread), median (spread):")
        for name, values in rates.items():
            median = statistics.median(values)
            print(
                f"  {name:20s} {median:6.2f}  ({min(values):.2f}–{max(values):.2f})  "
                f"{median / full:.2f}× full  trainable {trainable[name]:,}"
            )
            lora_default = name == "lora (attn+router)"
            figures.append(
                Figure(
                    "Fine-tuning",
                    f"{name} fine-tuning steps per CPU second, sample:{SAMPLE}, batch {base.batch} × "
                    f"{base.seq}, 1 thread",
                    f"{_spread(values)} steps/s; {median / full:.2f}× full ({full:.2f} steps/s); "
                    f"{trainable[name]:,} trainable",
                    command,
                    "LoRA > full" if lora_default else "",
                    median > full if lora_default else None,
                )
            )
    if "capture" in parts:
        ratios, seconds = capture_ratios(args.tokens, args.rounds, args.repeats)
        ratio = statistics.median(ratios)
        met = ratio <= CAPTURE_TARGET
        print(
            f"\ncapture of {args.tokens} tokens, adapter (load_model adapter=) / merged folder: "
            f"{_spread(ratios, '.3f')}× over {len(ratios)} repeats "
            f"(adapter {seconds['adapter'] * 1e3:.1f} ms, "
            f"merged {seconds['merged'] * 1e3:.1f} ms)   target <= {CAPTURE_TARGET:.2f}: "
            f"{'OK' if met else 'ABOVE TARGET'}"
        )
        figures.append(
            Figure(
                "Fine-tuning",
                f"capture with a LoRA adapter (load_model adapter=, rank {ADAPTER_RANK} on attention, "
                f"routers and experts) vs the same adapter merged and saved, {args.tokens} tokens, "
                f"sample:{SAMPLE}",
                f"{_spread(ratios, '.3f')}×; merged {seconds['merged'] * 1e3:.1f} ms; "
                "same weights and routing",
                command,
                f"≤ {CAPTURE_TARGET:.2f}×",
                met,
            )
        )
    if figures and parts >= {"steps", "capture"}:
        record("finetune", figures)
    elif figures:
        print("(a partial run: benchmarks/results/finetune.json is written by a run of every part)")


if __name__ == "__main__":
    main()
