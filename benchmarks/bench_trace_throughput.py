"""Corpus-trace throughput: `moeviz trace` (`write_corpus`) against a plain forward over the same batches.

Contenders, interleaved (plain, trace, plain, trace, ...) so machine noise hits both alike, one torch thread:
- plain: the model's forward over the batches of the fixed plan, tokenised beforehand (nothing else);
- trace: `write_corpus` from the corpus files into a fresh temporary store (reading, tokenising, planning,
  capturing, building the rows, Parquet + zstd, manifest, fsync; everything `moeviz trace` does).

Throughput = tokens per second of wall time and tokens per process CPU second (the trace overlaps its
tokenising and writing with the forward in threads, so it spends more CPU than wall time on 2+ cores).
Ratio = trace / plain per repeat; printed: median and spread (min–max) over the repeats.

Models: the bundled sample `sample:mixtral-healthy` (8 × 256-token sequences a batch) and the d=512 random
Mixtral of `bench_capture_overhead.mid_size_mixtral` with the sample's tokenizer (10 batches of 4 × 512: with
4 the run's fixed start and end — the first batch's tokenising, the last one's write — weighed ~5%), both on
the bundled evaluation corpus. Targets (issue 18): ≥ 0.9 on the sample, ≥ 0.97 on the d=512 model.

    python benchmarks/bench_trace_throughput.py [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_capture_overhead import mid_size_mixtral
from record import Figure, flags, record

import moeviz
from moeviz.samples import eval_dir
from moeviz.store import TraceSettings, iter_batches, write_corpus


@dataclasses.dataclass
class Case:
    name: str
    loaded: object
    settings: TraceSettings
    target: float


def plain_forward(loaded, batches) -> None:
    """The model alone on the plan's batches (right padding, attention mask), as `capture` feeds it."""
    with torch.inference_mode():
        for batch in batches:
            ids = batch.token_ids
            width = max(len(s) for s in ids)
            x = torch.tensor([s + [0] * (width - len(s)) for s in ids])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in ids])
            loaded.model(input_ids=x, attention_mask=mask)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(case: Case, corpus: Path, repeats: int) -> dict[str, list[float]]:
    loaded, settings = case.loaded, case.settings
    tokenize = lambda text: loaded.tokenizer(text)["input_ids"]  # noqa: E731
    batches = list(
        iter_batches(corpus, tokenize, settings.chunk_tokens, settings.batch_size, settings.max_batches)
    )
    tokens = sum(b.num_tokens for b in batches)
    root = Path(tempfile.mkdtemp(prefix="moeviz-bench-trace-"))
    count = iter(range(10**6))

    def trace() -> None:
        store = root / f"store{next(count)}"
        run = write_corpus(loaded, corpus, store, settings=settings, progress=False)
        assert run.complete and run.tokens == tokens, (run.tokens, tokens)
        shutil.rmtree(store)

    results: dict[str, list[float]] = {"wall": [], "cpu": [], "plain_tps": [], "trace_tps": []}
    try:
        plain_forward(loaded, batches[:1])  # warm-up
        trace()
        for _ in range(repeats):
            plain_wall, plain_cpu = timed(lambda: plain_forward(loaded, batches))
            trace_wall, trace_cpu = timed(trace)
            results["wall"].append(plain_wall / trace_wall)  # = trace tok/s ÷ plain tok/s
            results["cpu"].append(plain_cpu / trace_cpu)
            results["plain_tps"].append(tokens / plain_wall)
            results["trace_tps"].append(tokens / trace_wall)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{case.name}: {len(batches)} batches of {settings.batch_size} x {settings.chunk_tokens} "
        f"({tokens:,} tokens); plain {statistics.median(results['plain_tps']):,.0f} tok/s, "
        f"trace {statistics.median(results['trace_tps']):,.0f} tok/s (wall, medians)"
    )
    return results


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sample = moeviz.load_model("sample:mixtral-healthy")
    mid = dataclasses.replace(mid_size_mixtral(), tokenizer=sample.tokenizer)
    cases = [
        Case(
            "sample:mixtral-healthy",
            sample,
            TraceSettings(batch_size=8, chunk_tokens=256, max_batches=12),
            0.9,
        ),
        Case("d=512 mixtral", mid, TraceSettings(batch_size=4, chunk_tokens=512, max_batches=10), 0.97),
    ]
    print(f"torch threads: {torch.get_num_threads()}, repeats: {args.repeats} (interleaved)")
    rows = [(case, measure(case, eval_dir(), args.repeats)) for case in cases]
    print("\nthroughput ratio trace / plain forward: median (min–max)")
    figures = []
    for case, res in rows:
        met = statistics.median(res["wall"]) >= case.target
        print(
            f"  {case.name:<24} wall {spread(res['wall'])}   per CPU second {spread(res['cpu'])}   "
            f"target (wall) >= {case.target}: {'met' if met else 'NOT MET'}"
        )
        settings = case.settings
        figures.append(
            Figure(
                "Store and tracing",
                f"`write_corpus` vs a plain forward, tokens/s, {case.name}, "
                f"{settings.max_batches} batches of "
                f"{settings.batch_size} × {settings.chunk_tokens}",
                f"{spread(res['wall'])} (wall); per CPU second {spread(res['cpu'])}",
                f"python benchmarks/bench_trace_throughput.py{flags(parser, args)}",
                f"≥ {case.target} (wall)",
                met,
            )
        )
    record("trace_throughput", figures)


if __name__ == "__main__":
    main()
