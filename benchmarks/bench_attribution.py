"""Attribution and counterfactual timings on the default sample model (mixtral-healthy).

Target (issue 8): router attribution (IG, 32 steps, plus the feature-ablation check) for one (token,
layer, expert) over a 256-token prompt in under 10 s; the expert-importance sweep time is reported.

    python benchmarks/bench_attribution.py [--tokens 256]
"""

from __future__ import annotations

import argparse
import time
import warnings

import moeviz
from moeviz.attribution import next_token_attribution, router_attribution
from moeviz.interventions import DisableExpert, counterfactual, expert_importance
from moeviz.samples import eval_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    loaded = moeviz.load_model("sample:mixtral-healthy")
    ids = list(eval_batch(loaded).token_ids[0])[: args.tokens]
    last, layer = len(ids) - 1, loaded.sites[-1].layer
    warnings.simplefilter("ignore")
    router_attribution(loaded, token_ids=ids[:16], position=15, layer=layer, expert=0)  # warm-up
    timings = {}
    start = time.perf_counter()
    result = router_attribution(loaded, token_ids=ids, position=last, layer=layer, expert=0)
    timings["router attribution, IG + ablation (last token, last layer)"] = time.perf_counter() - start
    start = time.perf_counter()
    router_attribution(loaded, token_ids=ids, position=last, layer=layer, expert=0, ablation=False)
    timings["router attribution, IG only"] = time.perf_counter() - start
    start = time.perf_counter()
    next_token_attribution(loaded, token_ids=ids)
    timings["next-token attribution, IG + LLMAttribution ablation"] = time.perf_counter() - start
    start = time.perf_counter()
    counterfactual(loaded, token_ids=ids, interventions=[DisableExpert(expert=0, layer=layer)])
    timings["counterfactual (before/after traces + log-probs)"] = time.perf_counter() - start
    start = time.perf_counter()
    expert_importance(loaded, token_ids=ids)
    timings["expert-importance sweep (all layers x experts)"] = time.perf_counter() - start
    print(f"{len(ids)} tokens, {len(loaded.sites)} MoE layers x {loaded.sites[0].num_experts} experts")
    for name, seconds in timings.items():
        print(f"{name:60s} {seconds:7.2f} s")
    print(f"IG relative delta {result.relative_delta:.1%}, IG/ablation rank agreement {result.agreement}")
    ok = timings["router attribution, IG + ablation (last token, last layer)"] < 10
    print("target (< 10 s):", "met" if ok else "MISSED")


if __name__ == "__main__":
    main()
