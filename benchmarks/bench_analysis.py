"""Analysis timings on a synthetic trace of 1,000,000 routing rows (32 MoE layers × 15,625 tokens × top-2,
8 experts, skewed load). Each entry of BENCHMARKS is (name, callable taking the trace); add yours there.
Target (analysis issue): the per-layer structure metrics together (repetition, co-activation, transitions,
vocabulary specialisation without shuffles, saturation) well under 2 s; shuffle baselines are timed apart.
CPU time (`time.process_time`) on one thread, `--repeats` times each: the median and the spread (min–max);
a group's total is the sum of its entries' medians.

    python benchmarks/bench_analysis.py [--repeats 3] [--only NAME_PREFIX]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pandas as pd
from record import Figure, flags, record

from moeviz.analysis.balance import balance_frame, expert_balance_frame
from moeviz.analysis.collapse import collapse_frame, collapse_report
from moeviz.analysis.compare import routing_agreement_frame
from moeviz.analysis.confidence import confidence_frame, confidence_summary_frame
from moeviz.analysis.losses import aux_loss_topk_pooled, loss_frame
from moeviz.analysis.specialisation import expert_domain_specialisation, vocabulary_specialisation_frame
from moeviz.analysis.structure import (
    coactivation_frame,
    path_frame,
    repetition_frame,
    transition_frame,
)
from moeviz.scoring import scores_from_logits, selection_scores
from moeviz.trace import LayerRouting, ModelInfo, Trace


def synthetic_trace(
    layers: int = 32, seqs: int = 125, seq_len: int = 125, experts: int = 8, k: int = 2, seed: int = 0
) -> Trace:
    """Random routing with a skewed load per layer over `seqs` × `seq_len` tokens of a 2,000-id vocabulary."""
    rng = np.random.default_rng(seed)
    n = seqs * seq_len
    ids = rng.zipf(1.3, n) % 2000
    tokens = pd.DataFrame(
        {
            "seq": np.repeat(np.arange(seqs), seq_len),
            "pos": np.tile(np.arange(seq_len), seqs),
            "stream": "input",
            "token_id": ids,
            "token": [f"t{i}" for i in ids],
            "phase": "prompt",
            "step": 0,
            "predicted_id": np.roll(ids, -1),
        }
    )
    routings = []
    for layer in range(layers):
        logits = (rng.normal(size=(n, experts)) + np.log(rng.dirichlet(np.ones(experts)))).astype(np.float32)
        top = np.argsort(-logits, axis=1)[:, :k]
        weights = np.take_along_axis(logits, top, axis=1)
        weights = np.exp(weights - weights.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        routings.append(
            LayerRouting(
                layer=layer,
                site="mlp",
                token_rows=np.arange(n),
                logits=logits,  # the Trace derives scores = softmax(logits)
                experts=top,
                weights=weights,
                score_fn="softmax",
            )
        )
    info = ModelInfo(source="synthetic", model_type="synthetic", architecture="synthetic", num_layers=layers)
    return Trace(model=info, tokens=tokens, layers=routings)


def _checkpoint_of(trace: Trace, seed: int = 1) -> Trace:
    """The same tokens with 30 % of the tokens re-routed, standing in for an earlier checkpoint."""
    rng = np.random.default_rng(seed)
    layers = []
    for r in trace.layers:
        experts = r.experts.copy()
        moved = rng.random(len(experts)) < 0.3
        experts[moved] = np.argsort(-rng.random((int(moved.sum()), r.num_experts)), axis=1)[:, : r.k]
        layers.append(dataclasses.replace(r, experts=experts))
    return Trace(model=trace.model, tokens=trace.tokens, layers=layers)


_CHECKPOINT: dict[int, Trace] = {}


def _saturation(trace: Trace) -> pd.DataFrame:
    earlier = _CHECKPOINT.setdefault(id(trace), _checkpoint_of(trace))
    return routing_agreement_frame(earlier, trace)


def _biased_of(trace: Trace, seed: int = 2) -> Trace:
    """The same logits read as a sigmoid router with a balancing bias (DeepSeek-V3 style): the costlier
    biased paths of the confidence metrics (selection margin, unbiased overlap)."""
    rng = np.random.default_rng(seed)
    layers = []
    for r in trace.layers:
        bias = (rng.normal(size=r.num_experts) * 0.1).astype(np.float32)
        scores = scores_from_logits(r.logits, "sigmoid")
        selection = selection_scores(scores, bias)
        experts = np.argsort(-selection, axis=1)[:, : r.k]
        layers.append(dataclasses.replace(r, experts=experts, score_fn="sigmoid", bias=bias))
    return Trace(model=trace.model, tokens=trace.tokens, layers=layers)


_BIASED: dict[int, Trace] = {}


def _biased(trace: Trace) -> Trace:
    return _BIASED.setdefault(id(trace), _biased_of(trace))


# Balance, losses, confidence, collapse: the budget (2 s) is for these together.
BALANCE_BUDGET_S = 2.0
BALANCE: list[tuple[str, Callable[[Trace], object]]] = [
    ("balance.balance_frame_D4", lambda t: balance_frame(t, devices=4)),
    ("balance.expert_balance_frame", expert_balance_frame),
    ("losses.loss_frame", loss_frame),
    ("losses.aux_loss_topk_pooled", lambda t: aux_loss_topk_pooled(t.layers)),
    ("confidence.confidence_frame", confidence_frame),
    ("confidence.confidence_summary_frame", confidence_summary_frame),
    ("collapse.collapse_frame", lambda t: collapse_frame(collapse_report(t))),
    ("biased.loss_frame", lambda t: loss_frame(_biased(t))),
    ("biased.confidence_frame", lambda t: confidence_frame(_biased(t))),
]
# Structure group: the budget is for these together.
STRUCTURE: list[tuple[str, Callable[[Trace], object]]] = [
    ("structure.repetition", repetition_frame),
    ("structure.coactivation", coactivation_frame),
    ("structure.coactivation_adjacent", lambda t: coactivation_frame(t, adjacent_only=True)),
    ("structure.transitions", transition_frame),
    ("structure.vocabulary_specialisation", vocabulary_specialisation_frame),
    ("structure.saturation", _saturation),
]
# Shuffle baselines, reported apart.
SHUFFLES: list[tuple[str, Callable[[Trace], object]]] = [
    ("shuffle.repetition_20", lambda t: repetition_frame(t, shuffles=20)),
    ("shuffle.vocabulary_20", lambda t: vocabulary_specialisation_frame(t, shuffles=20)),
    ("shuffle.domain_200", lambda t: expert_domain_specialisation(t, ["a", "b", "c", "d", "e"] * 25)),
    ("extra.paths_4_layers", lambda t: path_frame(t, layers=range(4))),
]
BENCHMARKS: list[tuple[str, Callable[[Trace], object]]] = BALANCE + STRUCTURE + SHUFFLES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="run the entries whose name starts with this")
    args = parser.parse_args()
    trace = synthetic_trace()
    rows = sum(r.experts.size for r in trace.layers)
    print(f"synthetic trace: {len(trace.layers)} layers × {len(trace.tokens)} tokens, {rows:,} routing rows")
    _saturation(trace)  # build the stand-in checkpoint outside the timings
    _biased(trace)  # likewise the biased-router variant
    best: dict[str, float] = {}  # the median CPU seconds
    spread: dict[str, str] = {}
    for name, fn in BENCHMARKS:
        if not name.startswith(args.only):
            continue
        times = []
        for _ in range(args.repeats):
            start = time.process_time()
            fn(trace)
            times.append(time.process_time() - start)
        best[name] = statistics.median(times)
        spread[name] = f"{min(times):.3f}–{max(times):.3f}"
        print(f"{name:40s} {best[name]:8.3f} s CPU  (median of {args.repeats}, spread {spread[name]})")
    command = f"python benchmarks/bench_analysis.py{flags(parser, args)}"
    size = f"{rows:,} routing rows, CPU, one thread, median of {args.repeats}"
    figures = []
    balance = [best[name] for name, _ in BALANCE if name in best]
    if balance:
        total = sum(balance)
        print(
            f"{'balance/losses/confidence/collapse total':40s} {total:8.3f} s  "
            f"({total / BALANCE_BUDGET_S:.0%} of the {BALANCE_BUDGET_S:g} s budget)"
        )
        figures.append(
            Figure(
                "Analysis",
                f"balance, losses, confidence and collapse together, {size}",
                f"{total:.3f} s",
                command,
                f"< {BALANCE_BUDGET_S:g} s",
                total < BALANCE_BUDGET_S,
            )
        )
    structure = [best[name] for name, _ in STRUCTURE if name in best]
    if structure:
        print(f"{'structure total':40s} {sum(structure):8.3f} s  (target: well under 2 s)")
        figures.append(
            Figure(
                "Analysis",
                "structure metrics together (repetition, co-activation, transitions, vocabulary, "
                f"saturation), {size}",
                f"{sum(structure):.3f} s",
                command,
                "well under 2 s",
                sum(structure) < 2,
            )
        )
    for name, _ in SHUFFLES:
        if name in best:
            figure = f"{best[name]:.3f} s ({spread[name]})"
            figures.append(Figure("Analysis", f"`{name}`, {size}", figure, command))
    record("analysis", figures)


if __name__ == "__main__":
    main()
