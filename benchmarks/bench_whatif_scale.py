"""The model-running what-ifs at the scale of real checkpoints: quantisation and speculative prefetch on a
DeepSeek-V3-shaped random model (256 routed experts, top-8 of 4-of-8 groups, 58 MoE layers, narrow widths;
tests/support/scale_models.py), against one plain forward of the same tokens.

Side by side in one run, interleaved, CPU time (`time.process_time`, one torch thread), 3 repeats with the
spread: one plain forward, one capture (the forward with moeviz's routing hooks and decode), the
quantisation what-if as it is and as it was at `--baseline` (a git revision: two captures, then two more
plain forwards for the log-probabilities, and a deep copy of the model), the prefetch recall, and the
Deployment page's Offloading tab's replays of the captured routing (every policy at the tab's default cache
of 2k experts, then the hit-rate curve at the tab's cache sizes) as they are and as they were at
`--offload-baseline` (each cache size replayed on its own). Ratios are to the plain forward's median.

Run: .venv/bin/python benchmarks/bench_whatif_scale.py [--tokens 1000] [--dtype int8] [--target experts]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import streamlit.logger
import torch
from record import Figure, flags, record

from benchmarks.bench_whatif import BASELINE, OFFLOAD_BASELINE, baseline_module
from moeviz.capture.forward import capture
from moeviz.models.loading import load_model
from moeviz.whatif import offload
from moeviz.whatif.prefetch import prefetch_recall
from moeviz.whatif.quant import quantisation_flips
from moeviz.whatif.routes import routes_from_trace
from tests.support.scale_models import save_scale_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))  # the app's building blocks
streamlit.logger.get_logger("streamlit.runtime.caching.cache_data_api").setLevel(logging.ERROR)  # no runtime
from components.deployment import curve_caches  # noqa: E402


def offload_tab(module, routes, cache: int, caches: tuple[int, ...]):
    """The Offloading tab's replays with `module` (today's or a baseline's moeviz.whatif.offload): each
    policy at `cache`, then the hit-rate curve at `caches` → the curve."""
    for policy in module.POLICIES:
        module.simulate_offload(routes, cache, policy, expert_bytes=1)
    return module.hit_rate_curve(routes, caches, expert_bytes=1)


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
    parser.add_argument("--offload-baseline", default=OFFLOAD_BASELINE, help="git revision for offloading")
    args = parser.parse_args()
    torch.set_num_threads(1)
    old = baseline_module(args.baseline, "moeviz/whatif/quant.py")
    old_offload = baseline_module(args.offload_baseline, "moeviz/whatif/offload.py")
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_scale_model("deepseek-v3", Path(tmp) / "deepseek-v3", max_position_embeddings=4096)
        loaded = load_model(folder)
    ids = torch.randint(3, 2000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    def plain() -> None:
        with torch.inference_mode():
            loaded.model(input_ids=torch.tensor([ids]))

    quant = dict(token_ids=ids, dtype=args.dtype, target=args.target)
    routes = routes_from_trace(capture(loaded, token_ids=[ids]))
    first = routes.layers[0]
    tab = (routes, 2 * first.k, curve_caches(first.k, first.num_experts))
    replays = (
        f"Offloading tab's replays ({len(offload.POLICIES)} policies at C = {tab[1]}, "
        f"curve at {len(tab[2])} sizes)"
    )
    contenders = {
        "one plain forward": plain,
        "one capture": lambda: capture(loaded, token_ids=[ids]),
        f"quantisation what-if ({args.dtype}, {args.target})": lambda: quantisation_flips(loaded, **quant),
        f"quantisation what-if [{args.baseline}]": lambda: old.quantisation_flips(loaded, **quant),
        "prefetch recall (offset 1)": lambda: prefetch_recall(loaded, token_ids=ids),
        replays: lambda: offload_tab(offload, *tab),
        f"{replays} [{args.offload_baseline}]": lambda: offload_tab(old_offload, *tab),
    }
    same = (
        quantisation_flips(loaded, **quant)
        .layers_frame()
        .equals(old.quantisation_flips(loaded, **quant).layers_frame())
    )
    same_curve = offload_tab(offload, *tab).equals(offload_tab(old_offload, *tab))
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
    print(f"  hit-rate curve identical to {args.offload_baseline}'s: {same_curve}")
    figures.append(
        Figure(
            "Deployment what-ifs",
            f"hit-rate curve ({len(tab[2])} cache sizes × {len(offload.POLICIES)} policies) = "
            f"[{args.offload_baseline}]'s, DeepSeek-V3-shaped model, {args.tokens:,} tokens",
            "identical" if same_curve else "**differs**",
            f"python benchmarks/bench_whatif_scale.py{flags(parser, args)}",
            target="identical",
            met=same_curve,
        )
    )
    record("whatif_scale", figures)


if __name__ == "__main__":
    main()
