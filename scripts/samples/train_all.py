"""Train every sample model, export it to `sample_models/`, and write its model card.

    python scripts/samples/train_all.py [--jobs 2] [--steps 1000] [--only NAME ...] [--export-only]

Expects `build/corpus` (build_corpus.py) and `build/tokenizer` (train_tokenizer.py). Runs go two at a
time with one thread each (faster on 2 cores than one run with two threads): about 10 min per run alone,
~20 min for a pair on a busy 2-core machine. Runs whose `build/runs/NAME/final` exists are not retrained.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "build"
SAMPLES = REPO / "sample_models"
SERIES_STEPS = "0,10,25,50,100,200,400"

# name -> (train_model.py arguments, card title, how the behaviour was obtained)
RUNS: dict[str, tuple[list[str], str, str]] = {
    "mixtral-healthy": (
        ["--arch", "mixtral", "--balance", "per-layer", "--aux-coef", "0.01", "--checkpoints", SERIES_STEPS],
        "A small Mixtral-style MoE language model with balanced routing in every layer: moeviz's default.",
        "Balanced with a Switch/GShard loss computed per MoE layer and averaged (coefficient 0.01).",
    ),
    "mixtral-unbalanced": (
        ["--arch", "mixtral", "--balance", "none"],
        "The same recipe as mixtral-healthy with no balancing loss at all.",
        "No auxiliary loss: whatever imbalance the router finds on its own (hub and near-dead experts).",
    ),
    "mixtral-collapsed": (
        ["--arch", "mixtral", "--balance", "inverted", "--aux-coef", "0.05"],
        "A Mixtral-style model whose routing was collapsed on purpose.",
        "Collapse was induced: the per-layer Switch balancing loss was *subtracted* (coefficient -0.05), "
        "which rewards sending tokens to few experts. Real collapses arise differently (e.g. from "
        "fine-tuning without balancing); this model exists to show what collapse looks like.",
    ),
    "deepseek-v3-bias": (
        ["--arch", "deepseek_v3", "--balance", "bias", "--bias-rate", "0.001"],
        "A small DeepSeek-V3-style MoE: sigmoid router, 16 fine-grained routed experts in 4 groups "
        "(top-4 from the best 2 groups), one shared expert, first layer dense.",
        "Auxiliary-loss-free balancing as DeepSeek-V3 describes: after every step each layer's per-expert "
        "selection bias moved by 0.001 · sign(mean load − load). No balancing loss. The bias only affects "
        "which experts are selected; combination weights use the unbiased sigmoid scores.",
    ),
}


def train(name: str, steps: int) -> None:
    final = BUILD / "runs" / name / "final"
    if final.is_dir():
        print(f"{name}: already trained ({final})")
        return
    args, _, _ = RUNS[name]
    log = BUILD / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        str(REPO / "scripts/samples/train_model.py"),
        "--corpus", str(BUILD / "corpus"),
        "--tokenizer", str(BUILD / "tokenizer"),
        "--out", str(BUILD / "runs" / name),
        "--threads", "1",
        "--steps", str(steps),
        *args,
    ]  # fmt: skip
    print(f"{name}: training, log in {log}")
    with log.open("w") as handle:
        subprocess.run(command, check=True, stdout=handle, stderr=subprocess.STDOUT)


def export(name: str) -> None:
    """Copy the final fp16 folder (and a checkpoint series, if any) into sample_models/, then write cards."""
    run = BUILD / "runs" / name
    target = SAMPLES / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(run / "final", target)
    _, title, how = RUNS[name]
    card = [
        sys.executable,
        str(REPO / "scripts/samples/write_card.py"),
        str(target),
        "--title",
        title,
        "--how",
        how,
    ]
    subprocess.run(card, check=True)
    checkpoints = sorted((run / "checkpoints").glob("step-*"))
    if checkpoints:
        series = SAMPLES / f"{name}-series"
        shutil.rmtree(series, ignore_errors=True)
        for folder in checkpoints:
            shutil.copytree(folder, series / folder.name)
        final_step = json.loads((run / "final" / "training.json").read_text())["step"]
        shutil.copytree(run / "final", series / f"step-{final_step:05d}")
        steps = ", ".join(str(int(p.name[5:])) for p in sorted(series.glob("step-*")))
        (series / "README.md").write_text(
            f"# {name}-series\n\nCheckpoints of the `{name}` training run at steps {steps} (fp16), for the "
            f"checkpoint timeline. The last one is `sample:{name}`. Load one with\n"
            f"`moeviz.load_model('sample:{name}-series/step-00100')`.\n"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--only", nargs="*", choices=sorted(RUNS), default=sorted(RUNS))
    parser.add_argument("--export-only", action="store_true")
    args = parser.parse_args()
    if not args.export_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda name: train(name, args.steps), args.only))
    for name in args.only:
        export(name)
    total = sum(p.stat().st_size for p in SAMPLES.rglob("*") if p.is_file())
    print(f"sample_models/: {total / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
