"""Attribution and counterfactual timings on the default sample model (mixtral-healthy).

Target (issue 8): router attribution (IG, 32 steps, plus the feature-ablation check) for one (token,
layer, expert) over a 256-token prompt in under 10 s; the expert-importance sweep time is reported.
CPU time (`time.process_time`) with one torch thread, the operations interleaved, `--repeats` rounds: the
median and the spread (min–max).

    python benchmarks/bench_attribution.py [--tokens 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from record import Figure, flags, record

import moeviz
from moeviz.attribution import next_token_attribution, router_attribution
from moeviz.interventions import DisableExpert, counterfactual, expert_importance
from moeviz.samples import eval_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = moeviz.load_model("sample:mixtral-healthy")
    ids = list(eval_batch(loaded).token_ids[0])[: args.tokens]
    last, layer = len(ids) - 1, loaded.sites[-1].layer
    warnings.simplefilter("ignore")
    router_attribution(loaded, token_ids=ids[:16], position=15, layer=layer, expert=0)  # warm-up
    operations = {
        "router attribution, IG + ablation (last token, last layer)": lambda: router_attribution(
            loaded, token_ids=ids, position=last, layer=layer, expert=0
        ),
        "router attribution, IG only": lambda: router_attribution(
            loaded, token_ids=ids, position=last, layer=layer, expert=0, ablation=False
        ),
        "next-token attribution, IG + LLMAttribution ablation": lambda: next_token_attribution(
            loaded, token_ids=ids
        ),
        "counterfactual (before/after traces + log-probs)": lambda: counterfactual(
            loaded, token_ids=ids, interventions=[DisableExpert(expert=0, layer=layer)]
        ),
        "expert-importance sweep (all layers x experts)": lambda: expert_importance(loaded, token_ids=ids),
    }
    runs: dict[str, list[float]] = {name: [] for name in operations}
    result = None
    for _ in range(args.repeats):  # interleaved: each round runs every operation once
        for name, operation in operations.items():
            start = time.process_time()
            out = operation()
            runs[name].append(time.process_time() - start)
            result = out if name.startswith("router attribution, IG + ablation") else result
    timings = {name: statistics.median(values) for name, values in runs.items()}
    print(f"{len(ids)} tokens, {len(loaded.sites)} MoE layers x {loaded.sites[0].num_experts} experts")
    for name, seconds in timings.items():
        values = runs[name]
        print(f"{name:60s} {seconds:7.2f} s CPU (spread {min(values):.2f}–{max(values):.2f})")
    print(f"IG relative delta {result.relative_delta:.1%}, IG/ablation rank agreement {result.agreement}")
    ok = timings["router attribution, IG + ablation (last token, last layer)"] < 10
    print("target (< 10 s):", "met" if ok else "MISSED")
    size = f"mixtral-healthy, {len(ids)} tokens, CPU, one thread"
    command = f"python benchmarks/bench_attribution.py{flags(parser, args)}"
    figures = [
        Figure(
            "Attribution",
            f"{name}, {size}",
            f"{seconds:.2f} s ({min(runs[name]):.2f}–{max(runs[name]):.2f})",
            command,
            *(("< 10 s", ok) if name.startswith("router attribution, IG + ablation") else ()),
        )
        for name, seconds in timings.items()
    ]
    record("attribution", figures)


if __name__ == "__main__":
    main()
