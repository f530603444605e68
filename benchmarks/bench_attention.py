"""Attention-capture cost: overhead at 512 tokens, and a long-context (default 32k-token) capture.

(a) `moeviz.capture(..., attention=True)` vs a plain forward of the same model on the same 512 tokens, runs
    interleaved so machine noise hits both alike; ratio of medians (target <= 1.15). Also reported: the
    routing-only capture, and eager attention with `output_attentions=True` (the usual approach).
(b) Long context: the sample model `mixtral-healthy` on its whole context (32,768 tokens; sliding-window
    attention over 256 tokens): routing + attention capture, per-head summaries of every layer, one attention
    row of the last token; wall time against a plain forward, and peak RSS (after the plain forward alone,
    and after the capture).

    python benchmarks/bench_attention.py [--tokens 512] [--repeats 15] [--long 32768] [--skip-long]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_capture_overhead import mid_size_mixtral

import moeviz


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def overhead(loaded, tokens: int, repeats: int) -> dict[str, float]:
    vocab = loaded.model.config.vocab_size
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    id_list = ids[0].tolist()
    model = loaded.model

    def plain():
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))

    def routing():
        moeviz.capture(loaded, token_ids=id_list)

    def with_attention():
        moeviz.capture(loaded, token_ids=id_list, attention=True)

    runs = {"plain": plain, "routing": routing, "attention": with_attention}
    for fn in runs.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeats):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))  # alternate order: no position bias
        for name in order:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    eager_times = []
    model.set_attn_implementation("eager")
    try:
        for _ in range(max(3, repeats // 3)):
            start = time.perf_counter()
            with torch.inference_mode():
                model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
            eager_times.append(time.perf_counter() - start)
    finally:
        model.set_attn_implementation("sdpa")
    base = statistics.median(times["plain"])

    def ratio(name: str) -> float:  # median of per-round ratios: robust to load changing between rounds
        return statistics.median(t / p for t, p in zip(times[name], times["plain"], strict=True))

    return {
        "plain_s": base,
        "routing_ratio": ratio("routing"),
        "attention_ratio": ratio("attention"),
        "attention_min_ratio": min(times["attention"]) / min(times["plain"]),
        "eager_output_attentions_ratio": statistics.median(eager_times) / base,
    }


def long_context(tokens: int) -> dict[str, float]:
    loaded = moeviz.load_model("sample:mixtral-healthy")
    if tokens > (loaded.max_length or 0):
        raise SystemExit(f"--long {tokens} exceeds the sample's context of {loaded.max_length} tokens")
    vocab = loaded.model.config.vocab_size
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.inference_mode():
        loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids))
    plain_s = time.perf_counter() - start
    rss_after_plain = _peak_rss_mib()
    start = time.perf_counter()
    trace = moeviz.capture(loaded, token_ids=ids[0].tolist(), attention=True)
    capture_s = time.perf_counter() - start
    rss_after_capture = _peak_rss_mib()
    start = time.perf_counter()
    summaries = trace.attention.summaries(window=128)
    summaries_s = time.perf_counter() - start
    start = time.perf_counter()
    row = trace.attention.row(trace.attention.map_layers[-1], 0, 0, tokens - 1)
    row_s = time.perf_counter() - start
    return {
        "tokens": tokens,
        "plain_forward_s": plain_s,
        "capture_s": capture_s,
        "capture_ratio": capture_s / plain_s,
        "summaries_s": summaries_s,
        "summary_rows": len(summaries),
        "row_s": row_s,
        "row_sum": float(row.sum()),
        "attention_bytes_mib": trace.attention.nbytes / 2**20,
        "routing_rows": len(trace.routing_frame()),
        "peak_rss_after_plain_mib": rss_after_plain,
        "peak_rss_after_capture_mib": rss_after_capture,
        "peak_rss_end_mib": _peak_rss_mib(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--long", type=int, default=32768)
    parser.add_argument("--skip-long", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    if not args.skip_overhead:
        for name, loaded in (
            ("random mixtral d=512 L=8", mid_size_mixtral()),
            ("sample:mixtral-healthy", moeviz.load_model("sample:mixtral-healthy")),
        ):
            result = overhead(loaded, args.tokens, args.repeats)
            print(
                f"[{args.tokens} tokens, {name}] plain {result['plain_s'] * 1e3:.1f} ms | "
                f"routing capture {result['routing_ratio']:.3f}x | "
                f"capture+attention {result['attention_ratio']:.3f}x (target <= 1.15; "
                f"min/min {result['attention_min_ratio']:.3f}x) | "
                f"eager output_attentions {result['eager_output_attentions_ratio']:.3f}x"
            )
    if not args.skip_long:
        result = long_context(args.long)
        print(
            f"[long context] tokens {result['tokens']} | plain forward {result['plain_forward_s']:.1f} s | "
            f"capture (routing+attention) {result['capture_s']:.1f} s = {result['capture_ratio']:.2f}x | "
            f"summaries (all layers/heads, {result['summary_rows']} rows) {result['summaries_s']:.1f} s | "
            f"row of token {result['tokens'] - 1}: {result['row_s'] * 1e3:.0f} ms "
            f"(sum {result['row_sum']:.4f}) | attention capture {result['attention_bytes_mib']:.0f} MiB | "
            f"peak RSS: after plain {result['peak_rss_after_plain_mib']:.0f} MiB, after capture "
            f"{result['peak_rss_after_capture_mib']:.0f} MiB, end {result['peak_rss_end_mib']:.0f} MiB"
        )


if __name__ == "__main__":
    main()
