"""Engine diff benchmark: two routings of 1,048,576 tokens × 48 MoE layers × k = 8 (E = 128, a
Qwen3-30B-A3B-shaped rollout: 384 M expert ids per side, int16, layer-major as the importers build them,
logits and weights absent) that differ in a few % of (token, layer).

Target (issue 27): `engine_diff` < 5 s. CPU time (`time.process_time`, one torch/numpy thread) over 3
repeats, median and spread. Cases: B with a few % of slots flipped (ranked like A); the same B with every
token's slots in reverse order and `ranked=False` (Megatron's ascending-id order: nothing matches slot for
slot, only as sets); the same B without token ids (aligned by position). Building the traces is not timed.

Run: .venv/bin/python benchmarks/bench_engine_diff.py [--tokens 1048576] [--layers 48] [--flip 0.03]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pandas as pd
import torch
from record import Figure, flags, record

from moeviz.analysis.engine_diff import engine_diff
from moeviz.trace import TOKEN_COLUMNS, LayerRouting, ModelInfo, Trace
from moeviz.trace.records import absent

E, K, SEQ = 128, 8, 4096


def synthetic_ids(rng: np.random.Generator, layers: int, tokens: int) -> np.ndarray:
    """[layers, tokens, K] int16 distinct ids per row: (base + j·stride) mod 128 with an odd stride (j·stride
    mod 128 differ for j < 128), cheap to draw for 384 M ids."""
    base = rng.integers(0, E, (layers, tokens, 1), dtype=np.int16)
    stride = (2 * rng.integers(0, E // 2, (layers, tokens, 1), dtype=np.int16) + 1).astype(np.int16)
    return ((base + np.arange(K, dtype=np.int16) * stride) % E).astype(np.int16), base, stride


def flipped(ids: np.ndarray, base: np.ndarray, stride: np.ndarray, rng: np.random.Generator, p: float):
    """A copy of ids with a fraction p of (token, layer) given one new expert (j = K: outside the row)."""
    out = ids.copy()
    layer, token = np.nonzero(rng.random(ids.shape[:2]) < p)
    slot = rng.integers(0, K, len(layer))
    out[layer, token, slot] = (base[layer, token, 0] + K * stride[layer, token, 0]) % E
    return out, len(layer)


def make_trace(ids: np.ndarray, ranked: bool) -> Trace:
    layers, n, _ = ids.shape
    tokens = pd.DataFrame(
        {
            "seq": np.repeat(np.arange(n // SEQ), SEQ),
            "pos": np.tile(np.arange(SEQ), n // SEQ),
            "stream": np.full(n, "input", dtype=object),
            "token_id": np.arange(n) % 151_000,
            "token": np.full(n, "", dtype=object),
            "phase": np.full(n, "prompt", dtype=object),
            "step": np.zeros(n, np.int64),
            "predicted_id": np.full(n, -1, np.int64),
        }
    )[TOKEN_COLUMNS]
    rows = np.arange(n)
    routings = [
        LayerRouting(
            layer=layer,
            site="mlp",
            token_rows=rows,
            logits=absent(n, E),
            experts=ids[layer],
            weights=absent(n, K),
            score_fn="softmax",
            decision_source="synthetic",
            has_logits=False,
            has_weights=False,
            ranked=ranked,
        )
        for layer in range(layers)
    ]
    info = ModelInfo(source="synthetic", model_type="qwen3_moe", architecture="synthetic", num_layers=layers)
    return Trace(model=info, tokens=tokens, layers=routings)


def without_ids(trace: Trace) -> Trace:
    """The trace as an import without token ids holds it: token_id −1 (so the diff aligns by position, the
    slow path: a join on (stream, seq, pos) and a gather of every layer's rows)."""
    trace.tokens = trace.tokens.assign(token_id=-1)
    return trace


def timed(a: Trace, b: Trace):
    start = time.process_time()
    result = engine_diff(a, b)
    return time.process_time() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--flip", type=float, default=0.03)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    ids, base, stride = synthetic_ids(rng, args.layers, args.tokens)
    other, flips = flipped(ids, base, stride, rng, args.flip)
    del base, stride
    a = make_trace(ids, ranked=True)
    cases = {
        "flipped slots, both ranked": make_trace(other, ranked=True),
        "flipped slots, B unranked (slots reversed)": make_trace(
            np.ascontiguousarray(other[:, :, ::-1]), False
        ),
        "flipped slots, B an import without ids (aligned by position)": without_ids(make_trace(other, True)),
    }
    print(
        f"{args.tokens:,} tokens × {args.layers} layers × k={K}, E={E}: {flips:,} flipped (token, layer) "
        f"({flips / (args.tokens * args.layers):.2%}); torch threads {torch.get_num_threads()}, "
        f"{args.repeats} repeats"
    )
    figures = []
    for name, b in cases.items():
        values, result = [], None
        for _ in range(args.repeats):
            seconds, result = timed(a, b)
            values.append(seconds)
        assert result.mismatched == flips, (result.mismatched, flips)
        spread = f"{min(values):.2f}–{max(values):.2f}"
        print(
            f"  {name}: {statistics.median(values):.2f} s CPU (spread {spread}); router mismatch "
            f"{result.router_mismatch:.4f}, tokens differing in ≥ 1 layer {result.tokens_any_layer:.3f}"
        )
        median = statistics.median(values)
        figures.append(
            Figure(
                "Engine import and diff",
                f"`engine_diff`, {args.tokens:,} tokens × {args.layers} layers × k = {K}, E = {E}: {name}",
                f"{median:.2f} s CPU ({spread})",
                f"python benchmarks/bench_engine_diff.py{flags(parser, args)}",
                "< 5 s",
                median < 5,
            )
        )
    record("engine_diff", figures)


if __name__ == "__main__":
    main()
