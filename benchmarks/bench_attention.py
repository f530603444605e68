"""Attention-capture cost: overhead at 512 tokens, capture + all-head summaries at 2,048 tokens, and (behind
`--long`) a long-context capture.

CPU time (`time.process_time`) with one torch thread, contenders interleaved (the order alternates each
round) so machine noise hits all alike; (a) reports medians of per-round ratios to the plain forward, (b)
ratios of medians (below).

(a) 512 tokens: `moeviz.capture(..., attention=True)` vs a plain forward (target <= 1.15). Also reported:
    the routing-only capture, and eager attention with `output_attentions=True` (the usual approach).
(b) 2,048 tokens (issue 18): plain forward; capture with attention; capture with attention + per-token
    summaries of all layers and heads (`summaries()`) and the head grid (`head_summary()`, what the app
    shows). Target: capture + summaries <= 1.5x a plain forward. `--runs` (3) measurements of
    `--summary-rounds` (5) interleaved rounds each; a run's ratio is the contender's median over its rounds
    divided by plain's; prints the median and the spread (min-max) of the runs' ratios.
(c) `--long 32768`: the sample model `mixtral-healthy` on its whole context (sliding-window attention over
    256 tokens): routing + attention capture, per-head summaries of every layer, one attention row of the
    last token; time against a plain forward, and peak RSS (after the plain forward alone, and after the
    capture).

Figures go to the Benchmarks page through `record`: (a) and (b) as "attention", (c) as "attention_long".

Models: a random d=512, 8-layer Mixtral (`bench_capture_overhead.mid_size_mixtral`) and the bundled sample
`sample:mixtral-healthy`.

    python benchmarks/bench_attention.py [--tokens 512] [--repeats 15] [--summary-tokens 2048]
        [--summary-rounds 5] [--runs 3] [--skip-overhead] [--skip-summaries] [--long 32768]
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
from record import Figure, flags, record

import moeviz


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _inputs(loaded, tokens: int):
    """Seeded random ids [1, tokens], the same as a list, and the plain forward on them."""
    vocab = loaded.model.config.vocab_size
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))

    def plain():
        with torch.inference_mode():
            loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids))

    return ids, ids[0].tolist(), plain


def overhead(loaded, tokens: int, repeats: int) -> dict[str, float]:
    ids, id_list, plain = _inputs(loaded, tokens)
    model = loaded.model

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
            start = time.process_time()
            runs[name]()
            times[name].append(time.process_time() - start)
    eager_times = []
    model.set_attn_implementation("eager")
    try:
        for _ in range(max(3, repeats // 3)):
            start = time.process_time()
            with torch.inference_mode():
                model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
            eager_times.append(time.process_time() - start)
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


def summaries_cost(loaded, tokens: int, rounds: int, runs: int) -> dict:
    """(b): plain forward, capture with attention, capture + summaries of all layers and heads, interleaved
    (the order rotates each round). Each of `runs` measurements gives, per contender, its median over
    `rounds` divided by plain's median; returns those ratios per contender (one per run)."""
    _, id_list, plain = _inputs(loaded, tokens)

    def capture():
        moeviz.capture(loaded, token_ids=id_list, attention=True)

    def capture_summaries():
        attention = moeviz.capture(loaded, token_ids=id_list, attention=True).attention
        frame = attention.summaries()
        grid = attention.head_summary()
        assert len(frame) == tokens * sum(attention.layer(i).num_heads for i in attention.map_layers)
        assert len(grid) >= len(attention.map_layers)

    contenders = {"plain": plain, "capture": capture, "capture+summaries": capture_summaries}
    names = list(contenders)
    for fn in contenders.values():  # warm-up
        fn()
    ratios: dict[str, list[float]] = {name: [] for name in names[1:]}
    plain_s = []
    for _ in range(runs):
        times: dict[str, list[float]] = {name: [] for name in names}
        for i in range(rounds):
            for name in names[i % 3 :] + names[: i % 3]:
                start = time.process_time()
                contenders[name]()
                times[name].append(time.process_time() - start)
        base = statistics.median(times["plain"])
        plain_s.append(base)
        for name in names[1:]:
            ratios[name].append(statistics.median(times[name]) / base)
    return {"plain_s": statistics.median(plain_s), "ratios": ratios}


def long_context(tokens: int) -> dict[str, float]:
    loaded = moeviz.load_model("sample:mixtral-healthy")
    if tokens > (loaded.max_length or 0):
        raise SystemExit(f"--long {tokens} exceeds the sample's context of {loaded.max_length} tokens")
    vocab = loaded.model.config.vocab_size
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    start = time.process_time()
    with torch.inference_mode():
        loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids))
    plain_s = time.process_time() - start
    rss_after_plain = _peak_rss_mib()
    start = time.process_time()
    trace = moeviz.capture(loaded, token_ids=ids[0].tolist(), attention=True)
    capture_s = time.process_time() - start
    rss_after_capture = _peak_rss_mib()
    start = time.process_time()
    summaries = trace.attention.summaries(window=128)
    summaries_s = time.process_time() - start
    start = time.process_time()
    row = trace.attention.row(trace.attention.map_layers[-1], 0, 0, tokens - 1)
    row_s = time.process_time() - start
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
    parser.add_argument("--summary-tokens", type=int, default=2048)
    parser.add_argument("--summary-rounds", type=int, default=5, help="interleaved rounds per run")
    parser.add_argument("--runs", type=int, default=3, help="times the summaries measurement is repeated")
    parser.add_argument("--long", type=int, default=0, help="tokens of the long-context run (0: skip)")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-summaries", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = (
        ("random mixtral d=512 L=8", mid_size_mixtral),
        ("sample:mixtral-healthy", lambda: moeviz.load_model("sample:mixtral-healthy")),
    )
    print(f"torch threads: {torch.get_num_threads()}; CPU time (process_time), contenders interleaved")
    command = "python benchmarks/bench_attention.py" + flags(parser, args)
    figures: list[Figure] = []
    if not args.skip_summaries:
        for name, load in models:
            result = summaries_cost(load(), args.summary_tokens, args.summary_rounds, args.runs)
            parts = []
            for contender, ratios in result["ratios"].items():
                parts.append(
                    f"{contender} {statistics.median(ratios):.3f}x "
                    f"(spread {min(ratios):.3f}-{max(ratios):.3f})"
                )
            summary = statistics.median(result["ratios"]["capture+summaries"])
            print(
                f"[{args.summary_tokens} tokens, {name}] plain {result['plain_s'] * 1e3:.0f} ms | "
                + " | ".join(parts)
                + f" | target capture+summaries <= 1.5x: {'met' if summary <= 1.5 else 'NOT met'} "
                f"({args.runs} runs of {args.summary_rounds} rounds)"
            )
            ratios = result["ratios"]["capture+summaries"]
            capture = statistics.median(result["ratios"]["capture"])
            figures.append(
                Figure(
                    "Attention",
                    f"capture with attention + all-head summaries and the head grid vs a plain forward, "
                    f"{args.summary_tokens:,} tokens, {name}",
                    f"{summary:.2f}× ({min(ratios):.2f}–{max(ratios):.2f}); capture alone {capture:.2f}×; "
                    f"plain forward {result['plain_s'] * 1e3:.0f} ms",
                    command,
                    "≤ 1.5×",
                    summary <= 1.5,
                )
            )
    if not args.skip_overhead:
        for name, load in models:
            result = overhead(load(), args.tokens, args.repeats)
            print(
                f"[{args.tokens} tokens, {name}] plain {result['plain_s'] * 1e3:.1f} ms | "
                f"routing capture {result['routing_ratio']:.3f}x | "
                f"capture+attention {result['attention_ratio']:.3f}x (target <= 1.15; "
                f"min/min {result['attention_min_ratio']:.3f}x) | "
                f"eager output_attentions {result['eager_output_attentions_ratio']:.3f}x"
            )
            figures.append(
                Figure(
                    "Attention",
                    f"capture with attention vs a plain forward, {args.tokens} tokens, {name}",
                    f"{result['attention_ratio']:.3f}× (median of {args.repeats} per-round ratios); routing "
                    f"only {result['routing_ratio']:.3f}×; eager `output_attentions` "
                    f"{result['eager_output_attentions_ratio']:.2f}×",
                    command,
                    "≤ 1.15×",
                    result["attention_ratio"] <= 1.15,
                )
            )
    if figures:
        record("attention", figures)
    if args.long:
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
        what = f"{result['tokens']:,} tokens on sample:mixtral-healthy (sliding window 256)"
        record(
            "attention_long",
            [
                Figure(
                    "Attention",
                    f"routing + attention capture vs a plain forward, {what}",
                    f"{result['capture_ratio']:.2f}× (one run); attention capture "
                    f"{result['attention_bytes_mib']:.0f} MiB; "
                    f"peak RSS {result['peak_rss_end_mib'] / 1024:.1f} GiB",
                    command,
                ),
                Figure(
                    "Attention",
                    f"per-head summaries of every layer; one attention row, {what}",
                    f"{result['summaries_s']:.1f} s; {result['row_s'] * 1e3:.0f} ms (one run)",
                    command,
                ),
            ],
        )


if __name__ == "__main__":
    main()
