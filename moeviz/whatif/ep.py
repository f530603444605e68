"""Expert parallelism (EP) replayed from real routing: GPU load, dispatch/combine bytes, All-to-All time.

Definitions (docs/deployment-whatifs.md, "Expert parallelism"):

- Placement: P = E + R physical slots over G GPUs, slot p on GPU p // (P / G); nodes hold `gpus_per_node`
  consecutive GPUs. `contiguous`: expert e on GPU e // (E / G), no redundant slots. `eplb`: DeepSeek's
  `rebalance_experts` (moeviz.whatif.eplb) on each layer's token counts, num_groups = the router's n_group
  (1 when it has none), hierarchical when the groups divide by the nodes, else global. `traffic`: moeviz's
  own co-location placement (see `traffic_placement`).
- Token source rank: `contiguous` t · G // N (t = the token's row in the layer, N its rows) or
  `round-robin` t mod G.
- Replica choice for an expert with r copies (copies numbered by ascending physical slot): `even` (EPLB's
  load model: the i-th token that chose e, in row order, goes to copy i mod r) or `vllm` ((t·k + j) mod r
  for slot j, vLLM's `eplb_map_to_physical_and_record`; when r divides k this is j mod r, so the copy
  follows the slot and load does not spread).
- Load of GPU g = (token, expert) assignments it serves; ep_balancedness b = mean_g / max_g per layer
  (SGLang `compute_utilization_rate`), ep_balancedness_over_layers Σ_l mean / Σ_l max (vLLM's log line):
  `moeviz.analysis.balance`'s functions, the ones `moeviz report --devices` uses.
- Dispatch (DeepEP normal kernels, `get_dispatch_layout`): a token is sent once per destination GPU that
  holds any of its experts. Local = its own GPU (no link), intra = another GPU of its node, inter = another
  node. No-dedup = one message per (token, expert) on another GPU (Megatron's All-to-All dispatcher,
  DeepEP low-latency). Node-dedup RDMA = once per (token, destination node ≠ source node) (DeepEP internode
  crosses RDMA once per node, then forwards over NVLink). Slots the model dropped (-1) send nothing.
  Message bytes: bf16 hidden·2; fp8 hidden + hidden/128·4 (one float32 scale per 128 channels).
  Combine bytes = dispatch bytes (every message returns once).
- Modelled All-to-All time per layer (moeviz's model, not an anchor's): each GPU sends its intra-node bytes
  at `nvlink_gbps` and its inter-node bytes (per-GPU dedup) at `internode_gbps`, one after the other; the
  slowest GPU finishes the collective, so a2a = 2 × max_g (intra_g / nvlink + inter_g / internode)
  (dispatch + combine). Bandwidth only: no per-message latency (each transfer's fixed setup cost, a few
  µs over RDMA), so many small messages are timed too short.
  Compute time = max_g load_g · expert_flops_per_token / (gpu_tflops · 1e12) (the busiest GPU holds the
  layer back). comm_share = a2a / (a2a + compute); NaN without a compute model (expert_flops_per_token = 0).
  Bandwidths are GB/s (1e9 bytes/s) per GPU, one direction.
- A load table (an engine's expert counts without tokens, `moeviz.trace.load.ExpertLoad`):
  `simulate_ep_load` places the experts (contiguous or eplb) and gives each GPU's load and ep_balancedness,
  equal to `simulate_ep`'s on the same routing with the `even` replica rule; the traffic and time columns
  need each token's set of experts and are NaN, and `traffic` placement and the `vllm` replica rule are
  refused (they need per-token routing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from moeviz.analysis.balance import ep_balancedness, ep_balancedness_over_layers, expert_counts
from moeviz.errors import InputError
from moeviz.jsonable import jsonable
from moeviz.whatif.eplb import balanced_packing, rebalance_experts, replicate_experts
from moeviz.whatif.routes import LayerRoutes, Routes

PLACEMENTS = ("contiguous", "eplb", "traffic")
SOURCES = ("contiguous", "round-robin")
REPLICAS = ("even", "vllm")
MESSAGE_DTYPES = ("bf16", "fp8")
# `traffic` refines by pairwise swaps, O(P²) per swap and up to 4·P swaps: P ≤ 512 keeps one layer to a few
# seconds (benchmarks/bench_whatif_bounds.py), and covers R ≤ E for DeepSeek-V3's 256 experts.
TRAFFIC_MAX_SLOTS = 512
# Any fitted placement: P = E + R ≤ 65,536 (DeepSeek-V3's 256 experts on each of 256 GPUs). EPLB takes about
# a second per layer there; R ≤ E·(G − 1) alone would let a huge --gpus admit millions of slots.
MAX_SLOTS = 65_536

DEFINITION = (
    "DeepEP dispatch (once per destination GPU; combine = dispatch), load = (token, expert) assignments, "
    "ep_balancedness mean/max per layer (SGLang) and ep_balancedness_over_layers Σmean/Σmax (vLLM); "
    "All-to-All time = bytes ÷ link bandwidth, no per-message latency"
)


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise InputError(f"unknown {name} {value!r}; choose one of {', '.join(options)}")


@dataclass(frozen=True)
class EPConfig:
    """An EP deployment: G GPUs, `gpus_per_node` per node, R redundant slots, and the link/compute model."""

    gpus: int
    gpus_per_node: int
    redundant: int = 0
    placement: str = "contiguous"
    source: str = "contiguous"
    replica: str = "even"
    hidden_size: int = 4096
    message_dtype: str = "bf16"
    nvlink_gbps: float = 450.0
    internode_gbps: float = 50.0
    gpu_tflops: float = 400.0
    expert_flops_per_token: float = 0.0
    traffic_slack: float = 0.10  # `traffic` keeps every GPU's load ≤ (1 + slack) · mean

    def __post_init__(self) -> None:
        _choice("placement", self.placement, PLACEMENTS)
        _choice("token source", self.source, SOURCES)
        _choice("replica rule", self.replica, REPLICAS)
        _choice("message dtype", self.message_dtype, MESSAGE_DTYPES)
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise InputError(f"GPUs ({self.gpus}) and GPUs per node ({self.gpus_per_node}) must be ≥ 1")
        if self.gpus % self.gpus_per_node:
            raise InputError(
                f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}; "
                "make --gpus a multiple of --gpus-per-node"
            )
        if self.redundant < 0:
            raise InputError(f"redundant slots (--redundant) must be ≥ 0, got {self.redundant}")
        if self.redundant and self.placement == "contiguous":
            raise InputError("contiguous placement has no redundant slots; use --placement eplb or traffic")
        if self.hidden_size < 1:
            raise InputError(f"hidden size must be ≥ 1, got {self.hidden_size}")
        if self.message_dtype == "fp8" and self.hidden_size % 128:
            raise InputError(
                f"FP8 messages carry one scale per 128 channels; hidden {self.hidden_size} is not"
            )
        for what, value in (
            ("NVLink bandwidth (--nvlink-gbps, GB/s)", self.nvlink_gbps),
            ("inter-node bandwidth (--internode-gbps, GB/s)", self.internode_gbps),
            ("GPU throughput (--gpu-tflops, TFLOP/s)", self.gpu_tflops),
        ):
            if not (math.isfinite(value) and value > 0):  # NaN passes a `<= 0` check: ask for finite
                raise InputError(f"{what} must be a finite number > 0, got {value}")
        for what, value in (
            ("expert FLOPs per token", self.expert_flops_per_token),
            ("traffic slack", self.traffic_slack),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise InputError(f"{what} must be a finite number ≥ 0, got {value}")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def message_bytes(self) -> int:
        """Bytes of one token message: BF16 hidden·2; FP8 hidden + hidden/128 float32 scales (DeepEP)."""
        if self.message_dtype == "fp8":
            return self.hidden_size + self.hidden_size // 128 * 4
        return self.hidden_size * 2

    def check_experts(self, experts: int) -> None:
        """The check that needs the expert count E: P = E + R slots split evenly over the GPUs (EPLB's only
        rule: R itself need not divide by G)."""
        if (experts + self.redundant) % self.gpus:
            raise InputError(
                f"{experts} experts + {self.redundant} redundant slots do not split evenly over "
                f"{self.gpus} GPUs; choose G dividing {experts + self.redundant} or change --redundant"
            )

    def check_fit(self, experts: int) -> None:
        """`check_experts` and the bounds on fitting a placement, checked before its [L, P] tables are
        allocated: R ≤ E·(G − 1) (beyond it a GPU holds more than E slots, so two copies of one expert
        share a GPU and spread no load), P ≤ MAX_SLOTS, and for `traffic` P ≤ TRAFFIC_MAX_SLOTS."""
        most = experts * (self.gpus - 1)
        if self.redundant > most:
            raise InputError(
                f"redundant slots (--redundant) {self.redundant:,} exceed E·(G − 1) = {experts}·"
                f"{self.gpus - 1} = {most:,}: beyond it a GPU holds more than {experts} slots, so two "
                "copies of one expert share a GPU"
            )
        self.check_experts(experts)
        slots = experts + self.redundant
        if slots > MAX_SLOTS:
            raise InputError(
                f"{experts} experts + {self.redundant:,} redundant slots make {slots:,} slots; a placement "
                f"takes at most {MAX_SLOTS:,} (256 experts on each of 256 GPUs): lower --redundant or --gpus"
            )
        if self.placement == "traffic" and slots > TRAFFIC_MAX_SLOTS:
            raise InputError(
                f"placement traffic refines {slots:,} slots (E + R) by pairwise swaps, O(P³); it takes at "
                f"most {TRAFFIC_MAX_SLOTS} (--redundant ≤ {max(TRAFFIC_MAX_SLOTS - experts, 0)} with "
                f"{experts} experts): use --placement eplb for more"
            )


@dataclass(frozen=True)
class Placement:
    """Physical slots per layer: phy2log [L, P] (logical expert of slot p; slot p on GPU p // (P / gpus))."""

    phy2log: np.ndarray
    layers: list[int]
    gpus: int
    kind: str
    fitted_on: str

    def __post_init__(self) -> None:
        if self.phy2log.ndim != 2 or self.phy2log.shape[0] != len(self.layers):
            raise ValueError(f"phy2log {self.phy2log.shape} does not match {len(self.layers)} layers")
        if self.phy2log.shape[1] % self.gpus:
            raise ValueError(f"{self.phy2log.shape[1]} slots do not split over {self.gpus} GPUs")

    @property
    def slots_per_gpu(self) -> int:
        return self.phy2log.shape[1] // self.gpus


# ---------------------------------------------------------------------------------------------------------
# Fitting a placement


def _num_experts(routes: Routes) -> int:
    sizes = {r.num_experts for r in routes.layers}
    if len(sizes) != 1:
        raise InputError(f"layers route over different expert counts {sorted(sizes)}; simulate one site")
    return sizes.pop()


def co_occurrence(layer: LayerRoutes) -> np.ndarray:
    """A [E, E]: tokens that chose both a and b (symmetric, zero diagonal)."""
    e, k = layer.num_experts, layer.k
    counts = np.zeros(e * e, dtype=np.int64)
    for i in range(k):
        for j in range(i + 1, k):
            a, b = layer.experts[:, i], layer.experts[:, j]
            both = (a >= 0) & (b >= 0)
            counts += np.bincount(a[both] * e + b[both], minlength=e * e)
    pairs = counts.reshape(e, e)
    return pairs + pairs.T


def _grow(w: np.ndarray, aff: np.ndarray, bins: int, size: int, cap: float) -> np.ndarray:
    """Greedy clustering: each bin starts from the heaviest free item and adds the free item with the most
    affinity to the bin that keeps it under `cap` (the lightest free item when none fits). → bin [n]."""
    n = len(w)
    where = np.full(n, -1, dtype=np.int64)
    for b in range(bins):
        free = where < 0
        seed = int(np.argmax(np.where(free, w, -np.inf)))
        where[seed], load, pull = b, w[seed], aff[seed].astype(np.float64)
        for _ in range(size - 1):
            free = where < 0
            fits = free & (load + w <= cap)
            pick = (
                int(np.argmax(np.where(fits, pull, -np.inf)))
                if fits.any()
                else int(np.argmin(np.where(free, w, np.inf)))
            )
            where[pick], load, pull = b, load + w[pick], pull + aff[pick]
    return where


def _refine(where: np.ndarray, w: np.ndarray, aff: np.ndarray, bins: int, cap: float) -> np.ndarray:
    """Pairwise swaps between bins (Kernighan–Lin style), best first, while one cuts the affinity between
    bins and keeps both bins under `cap`. Swaps keep every bin's item count. → bin [n]."""
    where = where.copy()
    n = len(w)
    member = np.zeros((n, bins))
    member[np.arange(n), where] = 1.0
    pull = aff @ member  # [n, bins]: affinity of each item to each bin
    load = w @ member
    for _ in range(4 * n):
        own = pull[np.arange(n), where]
        to_other = pull[:, where]  # [i, j]: affinity of i to j's bin
        # Moving i to j's bin and j to i's: gain = what each gains in the other bin − what it leaves,
        # minus the pair's own affinity counted twice (they stay apart).
        gain = to_other - own[:, None] + to_other.T - own[None, :] - 2 * aff
        new_i = load[where][None, :] - w[None, :] + w[:, None]  # load of j's bin after the swap
        new_j = load[where][:, None] - w[:, None] + w[None, :]  # load of i's bin after the swap
        ok = (where[:, None] != where[None, :]) & (new_i <= cap + 1e-9) & (new_j <= cap + 1e-9)
        gain = np.where(ok, gain, -np.inf)
        best = int(np.argmax(gain))
        i, j = divmod(best, n)
        if not gain[i, j] > 1e-9:
            break
        a, b = where[i], where[j]
        pull[:, a] += aff[:, j] - aff[:, i]
        pull[:, b] += aff[:, i] - aff[:, j]
        load[a] += w[j] - w[i]
        load[b] += w[i] - w[j]
        where[i], where[j] = b, a
    return where


def _partition(w: np.ndarray, aff: np.ndarray, bins: int, slack: float) -> np.ndarray:
    """Split items into `bins` equal-count bins, cutting affinity under load ≤ (1 + slack) · mean (or the
    balanced-packing start's max load, when that is higher). → bin [n]."""
    n = len(w)
    if bins == 1:
        return np.zeros(n, dtype=np.int64)
    size = n // bins
    packed = balanced_packing(w[None, :], bins)[0][0]
    start_max = np.bincount(packed, weights=w, minlength=bins).max()
    cap = max((1.0 + slack) * w.sum() / bins, start_max)
    grown = _grow(w, aff, bins, size, cap)
    start = grown if np.bincount(grown, weights=w, minlength=bins).max() <= cap + 1e-9 else packed
    return _refine(start, w, aff, bins, cap)


def traffic_placement(counts: np.ndarray, pairs: np.ndarray, config: EPConfig) -> np.ndarray:
    """moeviz's `traffic` placement for one layer: counts [E], pairs [E, E] → phy2log [P].

    1. Copies: EPLB's `replicate_experts` gives the R redundant slots to the experts with the most load per
       copy; each copy carries load counts[e] / r_e. Two copies of one expert have no affinity; copies of a
       and b have pairs[a, b] / (r_a · r_b) (tokens assumed split evenly over copies).
    2. Nodes: split the P copies into nodes of P / nodes, greedily growing each node around its heaviest
       free copy with the copies most often chosen together with it, then improving by pairwise swaps that
       cut co-occurrence across nodes. Every node's load stays ≤ (1 + slack) · mean.
    3. GPUs: the same inside each node, GPUs of P / G copies.
    Co-occurrence across nodes is a proxy for inter-node messages (a token whose experts share a node sends
    it one message per GPU instead of one per node); it is greedy, not optimal."""
    p = len(counts) + config.redundant
    phy2log, _, logcnt = replicate_experts(counts[None, :].astype(np.float64), p)
    item = phy2log[0]
    per_copy = counts.astype(np.float64) / logcnt[0]
    w = per_copy[item]
    aff = pairs.astype(np.float64)[np.ix_(item, item)] / np.outer(logcnt[0][item], logcnt[0][item])
    aff[item[:, None] == item[None, :]] = 0.0
    node = _partition(w, aff, config.nodes, config.traffic_slack)
    gpu = np.empty(p, dtype=np.int64)
    for n in range(config.nodes):
        members = np.flatnonzero(node == n)
        inner = _partition(
            w[members], aff[np.ix_(members, members)], config.gpus_per_node, config.traffic_slack
        )
        gpu[members] = n * config.gpus_per_node + inner
    # Slots in GPU order, ascending expert id within a GPU.
    order = np.lexsort((item, gpu))
    return item[order]


def fit_placement(routes: Routes, config: EPConfig) -> Placement:
    """Fit `config.placement` to these routes (every layer on its own token counts)."""
    e = _num_experts(routes)
    config.check_fit(e)
    layers = [r.layer for r in routes.layers]
    fitted_on = f"{routes.tokens} tokens of {routes.model}"
    if config.placement == "traffic":
        phy2log = np.stack(
            [traffic_placement(expert_counts(r), co_occurrence(r), config) for r in routes.layers]
        )
        return Placement(phy2log.astype(np.int64), layers, config.gpus, config.placement, fitted_on)
    weight = np.stack([expert_counts(r) for r in routes.layers])
    return fit_placement_counts(
        weight, layers, config, groups=routes.layers[0].n_group or 1, fitted_on=fitted_on
    )


def fit_placement_counts(
    weight: np.ndarray, layers: list[int], config: EPConfig, *, groups: int = 1, fitted_on: str = ""
) -> Placement:
    """Fit `contiguous` or `eplb` to per-layer expert loads weight [L, E] (token counts: all either needs).
    `groups` = the router's n_group (EPLB's hierarchy). `traffic` needs which experts tokens choose
    together, so per-token routing: InputError here."""
    if config.placement == "traffic":
        raise InputError(
            "placement traffic keeps experts that tokens choose together on one GPU: it needs per-token "
            "expert sets, not counts (use contiguous or eplb)"
        )
    e = weight.shape[1]
    config.check_fit(e)
    p = e + config.redundant
    if config.placement == "contiguous":
        phy2log = np.tile(np.arange(e, dtype=np.int64), (len(layers), 1))
    else:
        if e % groups:
            groups = 1  # a router whose groups do not split the experts cannot use the hierarchy
        phy2log = rebalance_experts(weight.astype(np.float64), p, groups, config.nodes, config.gpus)[0]
    return Placement(
        phy2log=phy2log.astype(np.int64),
        layers=list(layers),
        gpus=config.gpus,
        kind=config.placement,
        fitted_on=fitted_on,
    )


# ---------------------------------------------------------------------------------------------------------
# Simulating one layer


def _copy_table(phy2log: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """phy2log [P] → (copies [E]: r_e, slots [E, max r]: physical slots of each expert, ascending)."""
    copies = np.bincount(phy2log, minlength=experts)
    slots = np.zeros((experts, max(1, int(copies.max()))), dtype=np.int64)
    order = np.argsort(phy2log, kind="stable")  # by expert, ascending slot within an expert
    start = np.r_[0, np.cumsum(copies)[:-1]]
    rank = np.arange(len(phy2log)) - start[phy2log[order]]
    slots[phy2log[order], rank] = order
    return copies, slots


def _gpu_of_assignments(
    experts: np.ndarray, phy2log: np.ndarray, slots_per_gpu: int, replica: str, num_experts: int
) -> np.ndarray:
    """experts [N, k] (−1 = dropped) → serving GPU [N, k] int16 (−1 where dropped).

    Lookups go through tables with a last entry for −1 (numpy reads index −1 as the last entry)."""
    copies, slots = _copy_table(phy2log, num_experts)
    if copies.min() < 1:
        raise InputError(f"the placement holds no copy of expert(s) {np.flatnonzero(copies < 1).tolist()}")
    slot_gpu = (slots // slots_per_gpu).astype(np.int16)  # [E, max r]
    flat = experts.reshape(-1)
    gpu = np.r_[slot_gpu[:, 0], -1].astype(np.int16)[flat]
    if copies.max() > 1:
        replicated = np.flatnonzero(np.r_[copies > 1, False][flat])
        chosen = flat[replicated].astype(np.int32)
        r = copies.astype(np.int32)[chosen]
        if replica == "vllm":
            copy = (replicated % r).astype(np.int32)  # the flat index is t·k + j
        else:
            # The i-th assignment of e in row order → copy i mod r. A stable sort keeps row order inside
            # each expert (numpy sorts ≤ 16-bit keys by radix: linear time).
            keys = chosen.astype(np.uint16) if num_experts < 65536 else chosen
            order = np.argsort(keys, kind="stable")
            counts = np.bincount(chosen, minlength=num_experts)
            start = (np.cumsum(counts) - counts).astype(np.int32)
            copy = np.empty_like(chosen)
            copy[order] = (np.arange(len(order), dtype=np.int32) - start[chosen[order]]) % r[order]
        gpu[replicated] = slot_gpu.reshape(-1)[chosen * slot_gpu.shape[1] + copy]
    return gpu.reshape(experts.shape)


def _first_seen(dest: np.ndarray) -> np.ndarray:
    """dest [k, N] (−1 = none) → [k, N] bool: the first slot of each token with that destination.
    k²/2 vectorised comparisons instead of a sort: k is small."""
    first = dest >= 0
    for j in range(1, dest.shape[0]):
        for i in range(j):
            first[j] &= dest[j] != dest[i]
    return first


def _source_gpu(tokens: int, gpus: int, source: str) -> np.ndarray:
    t = np.arange(tokens, dtype=np.int64)
    return t * gpus // max(tokens, 1) if source == "contiguous" else t % gpus


def _simulate_layer(layer: LayerRoutes, phy2log: np.ndarray, config: EPConfig) -> dict[str, Any]:
    g, per_node = config.gpus, config.gpus_per_node
    served = _gpu_of_assignments(layer.experts, phy2log, len(phy2log) // g, config.replica, layer.num_experts)
    load = np.bincount(served.reshape(-1) + 1, minlength=g + 1)[1:]
    gpu = served.T.copy()  # [k, N]: one contiguous row per slot, for the per-slot comparisons
    node = gpu // per_node  # floor division keeps a dropped slot at −1
    src = _source_gpu(layer.tokens, g, config.source).astype(np.int16)
    src_node = src // per_node

    first_gpu = _first_seen(gpu)
    is_local = gpu == src
    same_node = node == src_node
    local = first_gpu & is_local
    intra = first_gpu & same_node & ~is_local
    inter = first_gpu & ~same_node
    remote_nodes = _first_seen(node) & ~same_node
    remote_pairs = (gpu >= 0) & ~is_local

    msg = config.message_bytes
    every_src = np.broadcast_to(src, gpu.shape)
    sent_intra = np.bincount(every_src[intra], minlength=g) * float(msg)
    sent_inter = np.bincount(every_src[inter], minlength=g) * float(msg)
    link_s = sent_intra / (config.nvlink_gbps * 1e9) + sent_inter / (config.internode_gbps * 1e9)
    a2a = 2.0 * float(link_s.max()) if g else 0.0
    compute = float(load.max()) * config.expert_flops_per_token / (config.gpu_tflops * 1e12)
    peak = float(load.max())
    byte_local, byte_intra, byte_inter = (np.count_nonzero(m) * msg for m in (local, intra, inter))
    return {
        "layer": layer.layer,
        "ep_balancedness": ep_balancedness(load),
        "max_gpu_load": int(peak),
        "mean_gpu_load": float(load.mean()),
        "dispatch_bytes_local": byte_local,
        "dispatch_bytes_intra": byte_intra,
        "dispatch_bytes_inter": byte_inter,
        "dispatch_bytes_nodedup": np.count_nonzero(remote_pairs) * msg,
        "dispatch_bytes_node_dedup_rdma": np.count_nonzero(remote_nodes) * msg,
        "combine_bytes": byte_local + byte_intra + byte_inter,
        "a2a_time_s": a2a,
        "compute_time_s": compute,
        "comm_share": _share(a2a, compute, config),
        "gpu_load": load.astype(np.int64),
    }


def _share(a2a: float, compute: float, config: EPConfig) -> float:
    """Communication's share of the MoE layer time; NaN without a compute model or any time at all."""
    if config.expert_flops_per_token <= 0 or a2a + compute <= 0:
        return float("nan")
    return a2a / (a2a + compute)


# ---------------------------------------------------------------------------------------------------------
# Result


BYTE_COLUMNS = (
    "dispatch_bytes_local",
    "dispatch_bytes_intra",
    "dispatch_bytes_inter",
    "dispatch_bytes_nodedup",
    "dispatch_bytes_node_dedup_rdma",
    "combine_bytes",
)


@dataclass(frozen=True)
class EPResult:
    """One EP simulation: per-layer rows (see `layers_frame`) and the loads per GPU [L, G]."""

    model: str
    tokens: int
    config: EPConfig
    placement: Placement
    same_data: bool
    rows: list[dict[str, Any]] = field(repr=False)
    definition: str = DEFINITION

    @property
    def gpu_load(self) -> np.ndarray:
        """[L, G] assignments served by each GPU."""
        return np.stack([r["gpu_load"] for r in self.rows])

    @property
    def ep_balancedness_over_layers(self) -> float:
        """vLLM's over-layer figure: Σ_l mean_g load / Σ_l max_g load."""
        return ep_balancedness_over_layers(self.gpu_load)

    def layers_frame(self) -> pd.DataFrame:
        """One row per layer: ep_balancedness, loads, dispatch bytes by kind, combine bytes, times, share."""
        return pd.DataFrame([{k: v for k, v in r.items() if k != "gpu_load"} for r in self.rows])

    def gpu_load_frame(self) -> pd.DataFrame:
        """Long form: layer, gpu, load."""
        load = self.gpu_load
        layers = [r["layer"] for r in self.rows]
        return pd.DataFrame(
            {
                "layer": np.repeat(layers, load.shape[1]),
                "gpu": np.tile(np.arange(load.shape[1]), len(layers)),
                "load": load.reshape(-1),
            }
        )

    def totals(self) -> dict[str, Any]:
        """Sums over layers (bytes, times), ep_balancedness_over_layers (vLLM's), and the overall comm
        share."""
        frame = self.layers_frame()
        out: dict[str, Any] = {c: int(frame[c].sum()) for c in BYTE_COLUMNS}
        a2a, compute = float(frame["a2a_time_s"].sum()), float(frame["compute_time_s"].sum())
        out.update(
            ep_balancedness_over_layers=self.ep_balancedness_over_layers,
            a2a_time_s=a2a,
            compute_time_s=compute,
            comm_share=_share(a2a, compute, self.config),
        )
        return jsonable(out)

    def to_json(self) -> dict[str, Any]:
        layers = jsonable(self.rows)
        return {
            "model": self.model,
            "tokens": int(self.tokens),
            "placement": self.placement.kind,
            "ep_balancedness_over_layers": jsonable(self.ep_balancedness_over_layers),
            "definition": self.definition,
            "same_data": bool(self.same_data),
            "fitted_on": self.placement.fitted_on,
            "gpus": self.config.gpus,
            "gpus_per_node": self.config.gpus_per_node,
            "redundant": self.config.redundant,
            "source": self.config.source,
            "replica": self.config.replica,
            "message_dtype": self.config.message_dtype,
            "message_bytes": self.config.message_bytes,
            "layers": layers,
            "totals": self.totals(),
        }


def simulate_ep(routes: Routes, config: EPConfig, placement: Placement | None = None) -> EPResult:
    """Replay `routes` on an EP deployment. placement None = fit `config.placement` on these same routes
    (EPResult.same_data = True: an in-sample figure; fit on `Routes.split`'s first part for an honest one)."""
    e = _num_experts(routes)
    if placement is None:
        config.check_fit(e)  # the bounds before the placement is fitted
    else:
        config.check_experts(e)
    same_data = placement is None
    if placement is None:
        placement = fit_placement(routes, config)
    if placement.gpus != config.gpus:
        raise InputError(f"the placement is for {placement.gpus} GPUs, the deployment has {config.gpus}")
    if placement.layers != [r.layer for r in routes.layers]:
        raise InputError(
            f"the placement covers layers {placement.layers}, the routes {[r.layer for r in routes.layers]}"
        )
    if placement.phy2log.max(initial=-1) >= e:
        raise InputError(f"the placement names expert {int(placement.phy2log.max())}, the routes have {e}")
    rows = [_simulate_layer(r, placement.phy2log[i], config) for i, r in enumerate(routes.layers)]
    return EPResult(
        model=routes.model,
        tokens=routes.tokens,
        config=config,
        placement=placement,
        same_data=same_data,
        rows=rows,
    )


# ---------------------------------------------------------------------------------------------------------
# A load table: per-layer expert counts without tokens (moeviz.trace.load.ExpertLoad)

LOAD_DEFINITION = (
    "load = (token, expert) assignments from the expert counts, a replicated expert's split over its copies "
    "as EPLB's load model (the i-th assignment to copy i mod r); ep_balancedness mean/max per layer (SGLang) "
    "and ep_balancedness_over_layers Σmean/Σmax (vLLM); All-to-All bytes and times need each token's set of "
    "experts, which a load table does not have: not computed"
)
NEEDS_TOKENS = (*BYTE_COLUMNS, "a2a_time_s", "compute_time_s", "comm_share")


def gpu_load_from_counts(counts: np.ndarray, phy2log: np.ndarray, gpus: int) -> np.ndarray:
    """Loads [G] of expert counts [E] placed by phy2log [P]: an expert with r copies (numbered by ascending
    slot) gives copy j ⌊c/r⌋ + [j < c mod r] assignments — what `simulate_ep`'s `even` rule (the i-th
    assignment → copy i mod r) gives the same tokens in any order."""
    counts = np.asarray(counts, dtype=np.int64)
    copies, slots = _copy_table(phy2log, len(counts))
    if copies.min() < 1:
        raise InputError(f"the placement holds no copy of expert(s) {np.flatnonzero(copies < 1).tolist()}")
    per_slot = np.zeros(len(phy2log), dtype=np.int64)
    for j in range(slots.shape[1]):
        has = copies > j
        share = counts[has] // copies[has] + (j < counts[has] % copies[has])
        per_slot[slots[has, j]] = share
    return per_slot.reshape(gpus, -1).sum(axis=1)


def split_load_steps(load, fit_fraction: float, order: str = "shuffled", seed: int = 0):
    """(fit, evaluate, how): steps of a load table to fit a placement on, the rest to judge it on, drawn
    as `Routes.split` draws sequences (`order` shuffled with `seed`, or the first ones). InputError for one
    step."""
    from dataclasses import replace

    from moeviz.whatif.routes import SPLIT_ORDERS, fit_units, split_label

    if not 0.0 < fit_fraction < 1.0:
        raise InputError(f"fit fraction must be in (0, 1), got {fit_fraction}")
    if order not in SPLIT_ORDERS:
        raise InputError(f"unknown split order {order!r}; choose one of {', '.join(SPLIT_ORDERS)}")
    steps = load.counts.shape[0]
    if steps < 2:
        raise InputError("a load table of one step cannot be split into a fit part and an evaluation part")
    fitted = fit_units(np.arange(steps), fit_fraction, order, seed)
    rest = np.setdiff1d(np.arange(steps), fitted)
    fit_part = replace(load, counts=load.counts[fitted], steps=[load.steps[i] for i in fitted])
    rest_part = replace(load, counts=load.counts[rest], steps=[load.steps[i] for i in rest])
    return fit_part, rest_part, split_label(len(fitted), steps, "steps of the load table", order, seed)


@dataclass(frozen=True)
class EPLoadResult(EPResult):
    """The EP what-if of a load table: per layer the GPU loads and ep_balancedness; the traffic columns of
    EPResult are NaN (null in JSON): they need per-token expert sets."""

    definition: str = LOAD_DEFINITION

    def totals(self) -> dict[str, Any]:
        nan = float("nan")
        out: dict[str, Any] = {name: nan for name in NEEDS_TOKENS}
        out["ep_balancedness_over_layers"] = self.ep_balancedness_over_layers
        return jsonable(out)

    def to_json(self) -> dict[str, Any]:
        """EPResult's JSON without the message settings (no messages are simulated without tokens)."""
        out = super().to_json()
        for key in ("source", "message_dtype", "message_bytes"):
            del out[key]
        return out


def simulate_ep_load(
    load, config: EPConfig, placement: Placement | None = None, *, groups: int = 1
) -> EPLoadResult:
    """GPU loads and ep_balancedness of a load table (an ExpertLoad: counts [S, L, E] summed over steps) on
    an EP deployment. placement None = fit `config.placement` (contiguous or eplb; `groups` = the router's
    n_group) on these counts. The `even` replica rule only: `vllm` picks a copy by each token's slot."""
    if config.replica != "even":
        raise InputError(
            f"replica rule {config.replica} picks a copy by each token's slot: it needs per-token routing "
            "(a load table takes --replica even)"
        )
    counts = load.layer_counts()  # [L, E]
    tokens = np.rint(counts.sum(axis=1) / max(load.top_k, 1)).astype(np.int64)
    same_data = placement is None
    if placement is None:
        fitted_on = (
            f"{int(tokens.max(initial=0))} tokens ({load.counts.shape[0]} steps) of {load.model.source}"
        )
        placement = fit_placement_counts(
            counts, list(load.layers), config, groups=groups, fitted_on=fitted_on
        )
    config.check_experts(counts.shape[1])
    if placement.gpus != config.gpus:
        raise InputError(f"the placement is for {placement.gpus} GPUs, the deployment has {config.gpus}")
    if placement.layers != list(load.layers):
        raise InputError(
            f"the placement covers layers {placement.layers}, the load table {list(load.layers)}"
        )
    nan = float("nan")
    rows = []
    for i, layer in enumerate(load.layers):
        gpu = gpu_load_from_counts(counts[i], placement.phy2log[i], config.gpus)
        rows.append(
            {
                "layer": layer,
                "ep_balancedness": ep_balancedness(gpu),
                "max_gpu_load": int(gpu.max()),
                "mean_gpu_load": float(gpu.mean()),
                **{name: nan for name in NEEDS_TOKENS},
                "gpu_load": gpu.astype(np.int64),
            }
        )
    return EPLoadResult(
        model=load.model.source,
        tokens=int(tokens.max(initial=0)),
        config=config,
        placement=placement,
        same_data=same_data,
        rows=rows,
    )
