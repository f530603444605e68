"""The capture at scale: `moeviz.capture` vs the plain forward on a DeepSeek-V3-shaped model, under each
experts implementation. `python benchmarks/bench_capture_scale.py` prints the figures.

The model: random weights shaped like DeepSeek-V3 (256 routed experts, top-8 within the best 4 of 8 groups, 61
blocks of which 58 MoE, narrow widths; tests/support/scale_models.py), saved to a temporary folder and loaded
once per experts implementation (`load_model(..., experts_implementation=...)`): transformers' per-expert loop
("eager") and its grouped kernel ("grouped_mm", what "auto" runs for this family).

Contenders, on the same 1,000 random token ids: the plain forward (`model(input_ids, attention_mask,
use_cache=False)` under `torch.inference_mode()`: the very call `capture` makes, without hooks) and
`moeviz.capture` (hooks, the forward, the decode into a Trace), per implementation. Measurement (the
project's rules): CPU time (`time.process_time`) with one torch thread; the contenders run interleaved (each
round runs every contender once, in an order rotated round by round); per contender the median over the
rounds; the whole measurement repeated (3 times by default) and the median and spread (min–max) over the
repeats printed. moeviz's part is capture / plain − 1 under the same implementation (target <= 5%).

Before measuring, the captures under the implementations are compared: the same experts for every token and
layer, and the largest weight difference. `--profile PATH` also writes, per implementation, the 15 entries of
one capture's profile with the most cumulative time, and moeviz's own functions.

    python benchmarks/bench_capture_scale.py [--tokens 1000] [--rounds 5] [--runs 3]
        [--implementations eager,grouped_mm] [--profile /tmp/shots/forward/profile.txt]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the scale models live with the tests
from record import Figure, flags, record

import moeviz
from moeviz.models.loading import LoadedModel
from tests.support.scale_models import save_scale_model

TARGET = 0.05  # moeviz's part of a capture, as a share of the plain forward


def contenders(loaded: dict[str, LoadedModel], ids: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Per implementation, the plain forward and the capture of `ids` [1, T]."""
    id_list = ids[0].tolist()
    mask = torch.ones_like(ids)
    runs: dict[str, Callable[[], object]] = {}
    for name, model in loaded.items():

        def plain(model=model) -> object:
            with torch.inference_mode():
                return model.model(input_ids=ids, attention_mask=mask, use_cache=False)

        def captured(model=model) -> object:
            return moeviz.capture(model, token_ids=[id_list])

        runs[f"plain {name}"] = plain
        runs[f"capture {name}"] = captured
    return runs


def measure(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """One measurement: median CPU seconds per contender over `rounds` interleaved rounds."""
    names = list(runs)
    for name in names:  # warm-up
        runs[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            start = time.process_time()
            runs[name]()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def compare_routing(loaded: dict[str, LoadedModel], id_list: list[int]) -> str:
    """How the captures under the implementations differ from the first one's."""
    names = list(loaded)
    traces = {name: moeviz.capture(loaded[name], token_ids=[id_list]) for name in names}
    base = traces[names[0]]
    lines = []
    for name in names[1:]:
        other = traces[name]
        pairs = list(zip(base.layers, other.layers, strict=True))
        same = sum(np.array_equal(a.experts, b.experts) for a, b in pairs)
        dw = max(float(np.abs(a.weights - b.weights).max()) for a, b in pairs)
        lines.append(
            f"  {name} vs {names[0]}: the same experts for every token in {same} of {len(base.layers)} MoE "
            f"layers; largest weight difference {dw:.2e}"
        )
    return "\n".join(lines)


def profile(loaded: dict[str, LoadedModel], id_list: list[int], path: Path) -> None:
    """One capture's profile per implementation (CPU time): the top 15 cumulative entries and moeviz's own."""
    parts = []
    for name, model in loaded.items():
        moeviz.capture(model, token_ids=[id_list])
        profiler = cProfile.Profile(time.process_time)
        profiler.enable()
        moeviz.capture(model, token_ids=[id_list])
        profiler.disable()
        for restriction, title in ((15, "top 15 cumulative"), ("moeviz/", "moeviz's own functions")):
            out = io.StringIO()
            stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
            stats.print_stats(*((restriction,) if restriction == 15 else (restriction, 15)))
            parts.append(
                f"--- experts_implementation={name}: {title} (one capture of {len(id_list):,} tokens, "
                f"1 torch thread, CPU time) ---\n{out.getvalue()}"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))
    print(f"profile written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per measurement")
    parser.add_argument("--runs", type=int, default=3, help="times the whole measurement is repeated")
    parser.add_argument("--implementations", default="eager,grouped_mm", help="comma-separated")
    parser.add_argument("--profile", type=Path, default=None, help="write a profile of one capture here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_scale_model("deepseek-v3", Path(tmp) / "deepseek-v3", max_position_embeddings=4096)
        loaded = {
            name: moeviz.load_model(folder, experts_implementation=name)
            for name in args.implementations.split(",")
        }
    first = next(iter(loaded.values()))
    ids = torch.randint(3, first.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    print(
        f"DeepSeek-V3 shape: {len(first.sites)} MoE layers x {first.sites[0].num_experts} experts, top-"
        f"{first.sites[0].top_k}; {args.tokens:,} tokens; torch threads {torch.get_num_threads()}; "
        f"{args.rounds} interleaved rounds (CPU time, medians) x {args.runs} runs"
    )
    print("routing under each implementation:\n" + compare_routing(loaded, ids[0].tolist()))
    if args.profile is not None:
        profile(loaded, ids[0].tolist(), args.profile)
    runs = contenders(loaded, ids)
    results = [measure(runs, args.rounds) for _ in range(args.runs)]
    for name in runs:
        values = [run[name] for run in results]
        print(
            f"  {name:<22} {statistics.median(values):7.3f} s  (spread {min(values):.3f}–{max(values):.3f})",
            flush=True,
        )
    names = list(loaded)
    command = f"python benchmarks/bench_capture_scale.py{flags(parser, args)}"
    shape = (
        f"DeepSeek-V3-shaped model ({len(first.sites)} MoE layers × {first.sites[0].num_experts} experts), "
        f"{args.tokens:,} tokens"
    )
    figures = []
    for name in names:
        ratios = [run[f"capture {name}"] / run[f"plain {name}"] for run in results]
        median = statistics.median(ratios)
        verdict = "OK" if median - 1 <= TARGET else "ABOVE TARGET"
        print(
            f"  capture/plain under {name:<11} {median:.3f} (spread {min(ratios):.3f}–{max(ratios):.3f}): "
            f"moeviz's part {100 * (median - 1):+.1f}% of the plain forward; target <= {100 * TARGET:.0f}%: "
            f"{verdict}"
        )
        figures.append(
            Figure(
                "Capture",
                f"routing capture vs a plain forward, experts `{name}`, {shape}",
                f"{median:.3f}× ({min(ratios):.3f}–{max(ratios):.3f}): "
                f"moeviz's part {100 * (median - 1):+.1f}%",
                command,
                f"≤ {100 * TARGET:.0f}%",
                median - 1 <= TARGET,
            )
        )
    for name in names[1:]:
        speedups = [run[f"plain {names[0]}"] / run[f"plain {name}"] for run in results]
        print(
            f"  plain {names[0]} / plain {name}: {statistics.median(speedups):.2f}x "
            f"(spread {min(speedups):.2f}–{max(speedups):.2f})"
        )
        figures.append(
            Figure(
                "Capture",
                f"plain forward, experts `{name}` vs `{names[0]}`, {shape}",
                f"{statistics.median(speedups):.2f}× faster ({min(speedups):.2f}–{max(speedups):.2f})",
                command,
            )
        )
    record("capture_scale", figures)


if __name__ == "__main__":
    main()
