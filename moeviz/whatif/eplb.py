"""DeepSeek's Expert Parallelism Load Balancer (EPLB), ported to numpy.

A port of `rebalance_experts` from deepseek-ai/EPLB (`eplb.py`, MIT licence,
https://github.com/deepseek-ai/EPLB), written anew from its algorithm:

- `balanced_packing`: put n weighted items into m packs of exactly n/m items each, heaviest item first,
  each into the lightest pack that still has room (the lowest pack id on ties).
- `replicate_experts`: turn E logical experts into P ≥ E physical slots; every extra slot goes to the
  expert whose load per replica is largest at that moment (the lowest expert id on ties).
- hierarchical policy (used when `num_groups % num_nodes == 0`): pack expert groups to nodes, replicate
  experts inside each node, then pack each node's physical experts to its GPUs. Otherwise the global policy:
  the same steps with one group and one node.

Physical slot p lives on GPU p // (P / num_gpus). The result is greedy, not optimal.

Differences from the torch original, none of which changes a result on the README example:
weights are float64 (the original casts to float32), and the descending sort is stable (equal weights keep
ascending id order; torch's sort does not promise an order for ties).
"""

from __future__ import annotations

import numpy as np

from moeviz.errors import InputError


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack each row's n items into `num_packs` packs of n / num_packs items, loads as even as greed gets.

    weight [X, n] → (pack_index [X, n], rank_in_pack [X, n]): the pack of each item and its position in it
    (the order items entered the pack)."""
    weight = np.asarray(weight, dtype=np.float64)
    rows, n = weight.shape
    if num_packs < 1 or n % num_packs:
        raise InputError(f"cannot pack {n} items into {num_packs} packs of equal count")
    per_pack = n // num_packs
    if per_pack == 1:
        # One item per pack: item i is pack i (the original's shortcut, kept so ids stay put).
        return np.tile(np.arange(n, dtype=np.int64), (rows, 1)), np.zeros((rows, n), dtype=np.int64)
    pack_index = np.full((rows, n), -1, dtype=np.int64)
    rank_in_pack = np.full((rows, n), -1, dtype=np.int64)
    for row in range(rows):
        pack_load = np.zeros(num_packs)
        pack_count = np.zeros(num_packs, dtype=np.int64)
        for item in np.argsort(-weight[row], kind="stable"):
            # Full packs are out of the running; argmin returns the lowest id among equally light packs.
            pack = int(np.argmin(np.where(pack_count < per_pack, pack_load, np.inf)))
            pack_index[row, item] = pack
            rank_in_pack[row, item] = pack_count[pack]
            pack_load[pack] += weight[row, item]
            pack_count[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate each row's `num_log` experts into `num_phy` slots, lowering the largest load per copy.

    weight [X, num_log] → (phy2log [X, num_phy], rank [X, num_phy], logcnt [X, num_log]): slot p holds
    logical expert phy2log[p] as its copy number rank[p]; logcnt counts each expert's copies. The first
    num_log slots are the experts themselves, in order."""
    weight = np.asarray(weight, dtype=np.float64)
    rows, num_log = weight.shape
    if num_phy < num_log:
        raise InputError(f"{num_phy} physical slots cannot hold {num_log} experts")
    phy2log = np.tile(np.arange(num_phy, dtype=np.int64), (rows, 1))
    rank = np.zeros((rows, num_phy), dtype=np.int64)
    logcnt = np.ones((rows, num_log), dtype=np.int64)
    every_row = np.arange(rows)
    for slot in range(num_log, num_phy):
        busiest = np.argmax(weight / logcnt, axis=1)  # first maximum: the lowest id on ties
        phy2log[:, slot] = busiest
        rank[:, slot] = logcnt[every_row, busiest]
        logcnt[every_row, busiest] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse permutation: perm [X, n] → inv [X, n] with inv[x, perm[x, i]] = i."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def _rebalance_hierarchical(
    weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [L, E] → (phy2log [L, P], phyrank [L, P], logcnt [L, E]) by EPLB's three steps."""
    layers, num_log = weight.shape
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_phy // num_gpus
    log_per_node = num_log // num_nodes

    # Step 1: whole expert groups to nodes, so group-limited routing stays inside few nodes.
    group_load = weight.reshape(layers, num_groups, group_size).sum(-1)
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    # "mlog" numbers the logical experts node by node: node n holds mlog ids [n·E/M, (n+1)·E/M).
    group_start = (group_node * groups_per_node + group_rank) * group_size
    log2mlog = (group_start[:, :, None] + np.arange(group_size)).reshape(layers, num_log)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicas inside each node (one row per (layer, node)).
    mlog_load = np.take_along_axis(weight, mlog2log, axis=1).reshape(layers * num_nodes, log_per_node)
    phy2mlog, phyrank, mlogcnt = replicate_experts(mlog_load, num_phy // num_nodes)

    # Step 3: each node's physical experts to its GPUs, by load per copy.
    phy_load = np.take_along_axis(mlog_load / mlogcnt, phy2mlog, axis=1)
    gpu, rank_on_gpu = balanced_packing(phy_load, num_gpus // num_nodes)
    pphy2phy = _inverse(gpu * phy_per_gpu + rank_on_gpu)

    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(layers, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(num_nodes) * log_per_node)[None, :, None]).reshape(layers, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(layers, -1), log2mlog, axis=1)
    return pphy2log, pphyrank, logcnt


def _check(num_log: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    if min(num_groups, num_nodes, num_gpus) < 1:
        raise InputError("groups, nodes and GPUs must each be at least 1")
    if num_gpus % num_nodes:
        raise InputError(f"{num_gpus} GPUs do not split evenly over {num_nodes} nodes")
    if num_replicas < num_log:
        raise InputError(f"{num_replicas} physical slots cannot hold {num_log} experts")
    if num_replicas > num_log * num_gpus:  # checked before the [L, P] tables are allocated
        raise InputError(
            f"{num_replicas:,} physical slots exceed E·G = {num_log}·{num_gpus} = {num_log * num_gpus:,}: a "
            f"GPU would hold more than {num_log} slots, two copies of one expert"
        )
    if num_replicas % num_gpus:
        raise InputError(f"{num_replicas} physical slots do not split evenly over {num_gpus} GPUs")
    if num_log % num_groups:
        raise InputError(f"{num_log} experts do not split into {num_groups} equal groups")


def is_hierarchical(num_groups: int, num_nodes: int) -> bool:
    """EPLB's choice: the hierarchical policy when expert groups divide evenly over nodes."""
    return num_groups % num_nodes == 0


def rebalance_experts(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB's entry point: place `num_replicas` physical experts (a multiple of `num_gpus`) on the GPUs.

    weight [L, E]: load of each logical expert per layer (e.g. tokens routed to it).
    Returns phy2log [L, P] (logical expert of each physical slot; slot p on GPU p // (P / num_gpus)),
    log2phy [L, E, R] (the physical slots of each expert by copy number, -1 padded, R = most copies),
    logcnt [L, E] (copies of each expert)."""
    weight = np.asarray(weight, dtype=np.float64)
    if weight.ndim != 2:
        raise InputError(f"weight must be [layers, experts], got shape {weight.shape}")
    layers, num_log = weight.shape
    if not is_hierarchical(num_groups, num_nodes):
        num_groups, num_nodes = 1, 1  # the global policy
    _check(num_log, num_replicas, num_groups, num_nodes, num_gpus)
    phy2log, phyrank, logcnt = _rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    most = int(logcnt.max())
    log2phy = np.full((layers, num_log * most), -1, dtype=np.int64)
    np.put_along_axis(
        log2phy, phy2log * most + phyrank, np.broadcast_to(np.arange(num_replicas), phy2log.shape), axis=1
    )
    return phy2log, log2phy.reshape(layers, num_log, most), logcnt
