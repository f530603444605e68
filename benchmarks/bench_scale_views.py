"""Spec build times of the views at scale (issue 13 §2) on random traces shaped like DeepSeek-V3 (256 experts,
top-8 from 4 of 8 groups, 58 MoE layers) and Kimi K2 (384 experts, top-8, 60 MoE layers), 4,096 tokens.
Target: each chart's spec built in < 0.5 s. Prints, per chart: build (the chart function), to_dict (Vega-Lite
JSON with schema validation, what an export does), rows shipped and JSON size. Frames (balance, mean scores,
one token's scores, co-activation) are computed once per trace and timed apart.

    python benchmarks/bench_scale_views.py [--tokens 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import altair as alt
import pandas as pd
from record import Figure, flags, record

from moeviz.analysis import confidence_frame, expert_balance_frame
from moeviz.analysis.expert_order import expert_order
from moeviz.analysis.null import load_confidence
from moeviz.analysis.scale_frames import mean_score_frame, token_scores_frame
from moeviz.analysis.structure import coactivation_counts
from moeviz.charts.routing import router_score_heatmap, token_margin_chart, token_strip_chart
from moeviz.charts.scale import expert_load_curve_chart, layer_expert_heatmap, token_rank_path_chart
from moeviz.testing.scale_traces import SHAPES, shaped_trace
from moeviz.trace import Trace


def best_of(fn: Callable[[], object], repeats: int) -> tuple[object, float]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def bench_shape(name: str, tokens: int, repeats: int) -> tuple[str, str, bool]:
    """Print the shape's frame and chart timings. → (the shape in words, its slowest spec build in words,
    whether every build is under 0.5 s)."""
    trace, seconds = best_of(lambda: shaped_trace(name, num_tokens=tokens), 1)
    mid = trace.layers[len(trace.layers) // 2]
    print(
        f"\n{name}: {len(trace.layers)} MoE layers × {mid.num_experts} experts, top-{mid.k}, {tokens} tokens "
        f"(trace built in {seconds:.1f} s)"
    )
    frames = {
        "expert_balance_frame": lambda: expert_balance_frame(trace),
        "mean_score_frame": lambda: mean_score_frame(trace),
        "token_scores_frame": lambda: token_scores_frame(trace, 0, 100),
        "coactivation_counts (1 layer)": lambda: coactivation_counts(mid, False),
        "routing rows (1 layer)": lambda: Trace(trace.model, trace.tokens, [mid]).routing_frame(),
        "confidence_frame": lambda: confidence_frame(trace),
    }
    got = {}
    for label, fn in frames.items():
        got[label], seconds = best_of(fn, 1)
        print(f"  frame {label:<32} {seconds:7.3f} s")
    balance, token, conf = got["expert_balance_frame"], got["token_scores_frame"], got["confidence_frame"]
    one_layer = balance[balance["layer"] == mid.layer]
    order = expert_order(one_layer, "coactivation", coactivation=got["coactivation_counts (1 layer)"][0])
    band = load_confidence(mid, draws=400)
    bands = pd.DataFrame(
        {"expert": range(mid.num_experts), "share": band.share, "share_low": band.share_low,
         "share_high": band.share_high}
    )  # fmt: skip
    subset = [*expert_order(one_layer, by="load")[:15].tolist(), int(mid.experts[0, -1])]
    charts = {
        "layer_expert_heatmap utilisation": lambda: layer_expert_heatmap(balance, highlight=3),
        "layer_expert_heatmap one token": lambda: layer_expert_heatmap(token, "score", highlight=3),
        "layer_expert_heatmap score, PC1": lambda: layer_expert_heatmap(
            got["mean_score_frame"], "score", order=order, order_name="co-activation PC1"
        ),
        "token_rank_path_chart score": lambda: token_rank_path_chart(token),
        "token_rank_path_chart load": lambda: token_rank_path_chart(token, rank_by="load", load=balance),
        "expert_load_curve_chart": lambda: expert_load_curve_chart(one_layer, highlight=3),
        "expert_load_curve_chart, bands": lambda: expert_load_curve_chart(
            one_layer, highlight=3, bands=bands
        ),
        "router_score_heatmap (200 × 16)": lambda: router_score_heatmap(
            trace.scores_frame(mid.layer), max_tokens=200, experts=subset
        ),
        "token_strip_chart (400 tokens)": lambda: token_strip_chart(
            got["routing rows (1 layer)"], num_experts=mid.num_experts, n_group=mid.n_group, highlight=3
        ),
        "token_margin_chart": lambda: token_margin_chart(conf[conf["pos"] == 100]),
    }
    print(f"  {'chart':<36} {'build':>8} {'to_dict':>8} {'rows':>7} {'JSON':>8}")
    builds: dict[str, float] = {}
    for label, fn in charts.items():
        chart, build = best_of(fn, repeats)
        spec, to_dict = best_of(chart.to_dict, repeats)
        rows = sum(len(v) for v in spec.get("datasets", {}).values())
        size = len(json.dumps(spec)) / 1e6
        flag = "" if build < 0.5 else "  (over 0.5 s)"
        print(f"  {label:<36} {build:7.3f}s {to_dict:7.3f}s {rows:7d} {size:6.2f}MB{flag}")
        builds[label] = build
    slowest = max(builds, key=builds.__getitem__)
    under = sum(seconds < 0.5 for seconds in builds.values())
    shape = (
        f"{name}: {len(trace.layers)} MoE layers × {mid.num_experts} experts, top-{mid.k}, {tokens:,} tokens"
    )
    summary = f"slowest {builds[slowest]:.3f} s (`{slowest}`); {under} of {len(builds)} charts under 0.5 s"
    return shape, summary, under == len(builds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    alt.data_transformers.disable_max_rows()  # Streamlit ships chart data as Arrow, without altair's guard
    figures = []
    for name in SHAPES:
        shape, summary, met = bench_shape(name, args.tokens, args.repeats)
        figures.append(
            Figure(
                "Views at scale",
                f"each chart's spec built (wall, best of {args.repeats}), {shape}",
                summary,
                f"python benchmarks/bench_scale_views.py{flags(parser, args)}",
                "< 0.5 s each",
                met,
            )
        )
    record("scale_views", figures)


if __name__ == "__main__":
    main()
