"""The model-running what-ifs at the scale of real checkpoints: quantisation and speculative prefetch on a
DeepSeek-V3-shaped random model (256 routed experts, top-8 of 4-of-8 groups, 58 MoE layers, narrow widths;
tests/support/scale_models.py), against one plain forward of the same tokens.

Side by side in one run, interleaved, CPU time (`time.process_time`, one torch thread), 3 repeats with the
spread: one plain forward, one capture (the forward with moeviz's routing hooks and decode), the
quantisation what-if as it is and as it was at `--baseline` (a git revision: two captures, then two more
plain forwards for the log-probabilities, and a deep copy of the model), and the prefetch recall. Ratios
are to the plain forward's median.

Run: .venv/bin/python benchmarks/bench_whatif_scale.py [--tokens 1000] [--dtype int8] [--target experts]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from record import Figure, flags, record

from benchmarks.bench_whatif import BASELINE, baseline_module
from moeviz.capture.forward import capture
from moeviz.models.loading import load_model
from moeviz.whatif.prefetch import prefetch_recall
from moeviz.whatif.quant import quantisation_flips
from tests.support.scale_models import save_scale_model


def timed(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--dtype", default="int8")
    parser.add_argument("--target", default="experts")
    parser.add_argument("--baseline", default=BASELINE, help="git revision to compare with")
    args = parser.parse_args()
    torch.set_num_threads(1)
    old = baseline_module(args.baseline, "moeviz/whatif/quant.py")
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_scale_model("deepseek-v3", Path(tmp) / "deepseek-v3", max_position_embeddings=4096)
        loaded = load_model(folder)
    ids = torch.randint(3, 2000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    def plain() -> None:
        with torch.inference_mode():
            loaded.model(input_ids=torch.tensor([ids]))

    quant = dict(token_ids=ids, dtype=args.dtype, target=args.target)
    contenders = {
        "one plain forward": plain,
        "one capture": lambda: capture(loaded, token_ids=[ids]),
        f"quantisation what-if ({args.dtype}, {args.target})": lambda: quantisation_flips(loaded, **quant),
        f"quantisation what-if [{args.baseline}]": lambda: old.quantisation_flips(loaded, **quant),
        "prefetch recall (offset 1)": lambda: prefetch_recall(loaded, token_ids=ids),
    }
    same = (
        quantisation_flips(loaded, **quant)
        .layers_frame()
        .equals(old.quantisation_flips(loaded, **quant).layers_frame())
    )
    plain()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(3):  # interleaved
        for name, run in contenders.items():
            times[name].append(timed(run))
    forward = statistics.median(times["one plain forward"])
    print(f"DeepSeek-V3-shaped model (256 experts, 58 MoE layers, narrow), {args.tokens:,} tokens, 1 thread")
    figures = []
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"  {name}: {median:.2f} s CPU (spread {min(values):.2f}–{max(values):.2f}), "
            f"{median / forward:.2f}× the plain forward"
        )
        figures.append(
            Figure(
                "Deployment what-ifs",
                f"{name}, DeepSeek-V3-shaped model (256 experts, 58 MoE layers, narrow), "
                f"{args.tokens:,} tokens",
                f"{median:.2f} s CPU ({min(values):.2f}–{max(values):.2f}), "
                f"{median / forward:.2f}× the plain forward",
                f"python benchmarks/bench_whatif_scale.py{flags(parser, args)}",
            )
        )
    print(f"  quantisation per-layer frame identical to {args.baseline}'s: {same}")
    record("whatif_scale", figures)


if __name__ == "__main__":
    main()
