"""Straightforward reference implementations of the deployment what-ifs, written from their definitions in
docs/deployment-whatifs.md (plain Python loops over tokens, slots and experts; no shared code with
`moeviz.whatif` beyond the input dataclasses), for the tests that pin the fast implementations to them.

Slow on purpose: use them on small random routing (a few thousand assignments) or a few dozen tokens of a
model.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

# ---- capacity replay (docs: "Capacity-factor replay") -----------------------------------------------------


def capacity(tokens: int, k: int, experts: int, cf: float, exact: bool) -> int:
    """C = ceil((T·k / E)·CF): Megatron's float order (Python floats), or exact with CF read as its repr."""
    if exact:
        return math.ceil(Fraction(tokens * k, experts) * Fraction(repr(float(cf))))
    return math.ceil((tokens * k / experts) * cf)


def _groups(seq: np.ndarray, group_tokens: int | None) -> list[list[int]]:
    """Row indices of each dispatch group: one sequence (a run of one seq id), or N consecutive rows."""
    rows = list(range(len(seq)))
    if group_tokens is not None:
        return [rows[i : i + group_tokens] for i in range(0, len(rows), group_tokens)]
    groups: list[list[int]] = []
    for row in rows:
        if row == 0 or seq[row] != seq[row - 1]:
            groups.append([])
        groups[-1].append(row)
    return groups


def capacity_replay(
    layer, cfs, policy: str, buckets: int = 10, exact: bool = False, group_tokens: int | None = None
) -> dict:
    """One LayerRoutes replayed at each CF. → {"layers": [row per cf], "experts": {cf: (assigned [E],
    dropped [E])}, "positions": {cf: (assigned [B], dropped [B])}} with the columns of
    `CapacityResult.layers_frame` in each row."""
    experts, k = int(layer.num_experts), layer.k
    bucket_of = {}
    for rows in _groups(layer.seq, None):  # position buckets are always within the token's sequence
        for i, row in enumerate(rows):
            bucket_of[row] = (i * buckets) // len(rows)
    out = {"layers": [], "experts": {}, "positions": {}}
    for cf in cfs:
        dropped_slots: set[tuple[int, int]] = set()
        caps = []
        for rows in _groups(layer.seq, group_tokens):
            cap = capacity(len(rows), k, experts, cf, exact)
            caps.append(cap)
            arrivals: dict[int, list[tuple[int, int]]] = {}
            for row in rows:
                for slot in range(k):
                    e = int(layer.experts[row, slot])
                    if e >= 0:
                        arrivals.setdefault(e, []).append((row, slot))
            for slots in arrivals.values():
                if policy == "probs":  # the largest weight first; ties → earlier token, then slot
                    slots = sorted(slots, key=lambda rs: (-float(layer.weights[rs]), rs))
                dropped_slots.update(slots[cap:])
        assigned = np.zeros(experts, dtype=np.int64)
        dropped = np.zeros(experts, dtype=np.int64)
        pos_assigned = np.zeros(buckets, dtype=np.int64)
        pos_dropped = np.zeros(buckets, dtype=np.int64)
        all_dropped = 0
        for row in range(layer.tokens):
            valid = [s for s in range(k) if layer.experts[row, s] >= 0]
            for slot in valid:
                e = int(layer.experts[row, slot])
                assigned[e] += 1
                pos_assigned[bucket_of[row]] += 1
                if (row, slot) in dropped_slots:
                    dropped[e] += 1
                    pos_dropped[bucket_of[row]] += 1
            if valid and all((row, s) in dropped_slots for s in valid):
                all_dropped += 1
        total = int(assigned.sum())
        out["layers"].append(
            {
                "layer": layer.layer,
                "cf": float(cf),
                "policy": policy,
                "capacity": max(caps) if caps else 0,
                "capacity_min": min(caps) if caps else 0,
                "assigned": total,
                "dropped": int(dropped.sum()),
                "dropped_fraction": int(dropped.sum()) / total if total else 0.0,
                "tokens_all_dropped": all_dropped,
                "overflowing_experts": int(np.count_nonzero(dropped)),
            }
        )
        out["experts"][float(cf)] = (assigned, dropped)
        out["positions"][float(cf)] = (pos_assigned, pos_dropped)
    return out


# ---- expert parallelism (docs: "Expert parallelism and All-to-All") ---------------------------------------


def ep_layer(layer, phy2log: np.ndarray, config) -> dict:
    """One LayerRoutes on the placement phy2log [P] (slot p on GPU p // (P / G)) under an EPConfig: the
    columns of `EPResult.layers_frame` plus gpu_load [G]."""
    g, per_node, msg = config.gpus, config.gpus_per_node, config.message_bytes
    per_gpu = len(phy2log) // g
    copies = {e: [p for p in range(len(phy2log)) if phy2log[p] == e] for e in range(layer.num_experts)}
    n, k = layer.tokens, layer.k
    seen = dict.fromkeys(range(layer.num_experts), 0)  # `even`: assignments of e so far, in row order
    load = [0] * g
    local = intra = inter = nodedup = rdma = 0
    sent_intra, sent_inter = [0] * g, [0] * g
    for t in range(n):
        src = t * g // n if config.source == "contiguous" else t % g
        dests: list[int] = []
        for j in range(k):
            e = int(layer.experts[t, j])
            if e < 0:
                continue
            r = len(copies[e])
            copy = (t * k + j) % r if config.replica == "vllm" else seen[e] % r
            seen[e] += 1
            gpu = copies[e][copy] // per_gpu
            load[gpu] += 1
            nodedup += gpu != src
            if gpu not in dests:
                dests.append(gpu)
        for gpu in dests:
            if gpu == src:
                local += 1
            elif gpu // per_node == src // per_node:
                intra += 1
                sent_intra[src] += 1
            else:
                inter += 1
                sent_inter[src] += 1
        rdma += len({gpu // per_node for gpu in dests} - {src // per_node})
    link = [
        sent_intra[i] * float(msg) / (config.nvlink_gbps * 1e9)
        + sent_inter[i] * float(msg) / (config.internode_gbps * 1e9)
        for i in range(g)
    ]
    a2a = 2.0 * max(link)
    compute = float(max(load)) * config.expert_flops_per_token / (config.gpu_tflops * 1e12)
    share = float("nan")
    if config.expert_flops_per_token > 0 and a2a + compute > 0:
        share = a2a / (a2a + compute)
    mean = sum(load) / g
    return {
        "layer": layer.layer,
        "ep_balancedness": mean / max(load) if max(load) > 0 else float("nan"),
        "max_gpu_load": max(load),
        "mean_gpu_load": mean,
        "dispatch_bytes_local": local * msg,
        "dispatch_bytes_intra": intra * msg,
        "dispatch_bytes_inter": inter * msg,
        "dispatch_bytes_nodedup": nodedup * msg,
        "dispatch_bytes_node_dedup_rdma": rdma * msg,
        "combine_bytes": (local + intra + inter) * msg,
        "a2a_time_s": a2a,
        "compute_time_s": compute,
        "comm_share": share,
        "gpu_load": np.array(load, dtype=np.int64),
    }


# ---- quantisation and routing (docs: "Quantisation and routing") ------------------------------------------


def quantisation(loaded, batch: list[list[int]], dtype: str, target: str) -> dict:
    """Route `batch` through the model and through a deep copy whose `target` weights are fake-quantised,
    compare per token, and score each sequence by two plain forwards. → {"layers": [{layer, site,
    flip_rate, top1_agreement, tokens}], "flipped": {(layer, site): [rows]}, "delta_logprob": float}."""
    import copy
    import dataclasses

    import torch

    from moeviz.capture import capture
    from moeviz.models.sites import find_moe_sites
    from moeviz.trace import Trace
    from moeviz.whatif.quant import fake_quantise, target_weights

    twin = copy.deepcopy(loaded.model)
    sites = find_moe_sites(twin)
    with torch.no_grad():
        for t in target_weights(twin, sites, target):
            t.param.copy_(fake_quantise(t.param, dtype, t.input_dim))
    quantised = dataclasses.replace(loaded, model=twin, sites=sites)

    def route(model):
        parts = [capture(model, token_ids=batch[i : i + 8]) for i in range(0, len(batch), 8)]
        return parts[0] if len(parts) == 1 else Trace.concat(parts)

    before, after = route(loaded), route(quantised)
    layers, flipped = [], {}
    for b in before.layers:
        a = after.layer(b.layer, b.site)
        flips, top1, rows = [], [], []
        for i in range(len(b.token_rows)):
            s, s2 = {e for e in b.experts[i] if e >= 0}, {e for e in a.experts[i] if e >= 0}
            flips.append(1.0 - len(s & s2) / b.k)
            top1.append(b.experts[i][np.argmax(b.weights[i])] == a.experts[i][np.argmax(a.weights[i])])
            if s != s2:
                rows.append(int(b.token_rows[i]))
        layers.append(
            {
                "layer": b.layer,
                "site": b.site,
                "flip_rate": float(np.mean(flips)),
                "top1_agreement": float(np.mean(top1)),
                "tokens": len(flips),
            }
        )
        flipped[(b.layer, b.site)] = rows

    def logprob(model, ids):
        with torch.inference_mode():
            logits = model.model(input_ids=torch.tensor([ids])).logits[0]
            logp = torch.log_softmax(logits.float(), dim=-1)[:-1]
            return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()

    deltas = [logprob(quantised, ids) - logprob(loaded, ids) for ids in batch if len(ids) > 1]
    return {"layers": layers, "flipped": flipped, "delta_logprob": float(np.concatenate(deltas).mean())}


# ---- speculative prefetch (docs: "Expert offloading cache") ------------------------------------------------


def _router_inputs(loaded, ids: list[int]) -> dict:
    """Per MoE site index: the hidden state [N, H] its router received in one plain forward of `ids`."""
    import torch

    inputs: dict[int, torch.Tensor] = {}

    def keeper(i: int):
        def keep(_module, args) -> None:
            inputs[i] = args[0].reshape(-1, args[0].shape[-1])

        return keep

    handles = [site.router.register_forward_pre_hook(keeper(i)) for i, site in enumerate(loaded.sites)]
    try:
        with torch.inference_mode():
            loaded.model(input_ids=torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return inputs


def _predicted(row: list[float], k: int, groups: int, keep: int, group_score: str | None) -> set[int]:
    """The k best experts of one token's selection scores among the `keep` best groups of `groups`."""
    e = len(row)
    eligible = list(range(e))
    if 1 < groups and keep < groups:  # noqa: SIM300 (reads as the range it is)
        size = e // groups

        def score(g: int) -> float:
            members = sorted(row[g * size : (g + 1) * size], reverse=True)
            return members[0] if group_score == "max" else members[0] + members[1]

        best = sorted(range(groups), key=lambda g: -score(g))[:keep]
        eligible = [x for x in eligible if x // size in best]
    return set(sorted(eligible, key=lambda x: -row[x])[:k])


def prefetch(loaded, batch: list[list[int]], offset: int = 1) -> dict[tuple[int, int], tuple[float, int]]:
    """Per predicted layer (layer, from_layer): (recall, tokens). Per sequence: a plain forward records each
    router's input; router ℓ+offset scores layer ℓ's input (its own score function and bias), the group
    limit keeps the `topk_group` best groups (group score: sum of the best two, or the max), the k best
    eligible experts are the prediction; recall = mean over tokens of |predicted ∩ dispatched| / k."""
    import torch

    from moeviz.capture import capture

    sums: dict[tuple[int, int], list] = {}
    for ids in batch:
        inputs = _router_inputs(loaded, ids)
        trace = capture(loaded, token_ids=[ids])
        for i, site in enumerate(loaded.sites[: len(loaded.sites) - offset]):
            nxt = loaded.sites[i + offset]
            actual = trace.layer(nxt.layer, nxt.site)
            with torch.inference_mode():
                logits = nxt.router_logits(nxt.router(inputs[i]))
                scores = nxt.router_scores(logits.float(), selection=True).numpy()
            dispatched = {
                int(r): set(row[row >= 0].tolist())
                for r, row in zip(actual.token_rows, actual.experts, strict=True)
            }
            total = sums.setdefault((nxt.layer, site.layer), [0.0, 0])
            for t in range(len(ids)):
                row = [float(v) for v in scores[t]]
                chosen = _predicted(
                    row, actual.k, actual.n_group or 1, actual.topk_group or 1, actual.group_score
                )
                total[0] += len(chosen & dispatched[t]) / actual.k
                total[1] += 1
    return {key: (s / n, n) for key, (s, n) in sums.items()}
