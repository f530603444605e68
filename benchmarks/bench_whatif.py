"""Deployment what-if benchmark: the simulators over a store of ~1 M routed tokens × 8 MoE layers.

Targets: expert parallelism < 2 s (also at E = 256 on 32 GPUs with 32 redundant slots), all cache
policies at one C < 5 s, capacity replay for 4 CFs < 2 s. CPU time (`time.process_time`, one torch/numpy
thread) over 3 interleaved repeats, median and spread. The capacity replay also runs as it was at `--baseline`
(a git revision), side by side on the same routes, with the ratio of the medians; its three frames, under both
drop policies, must be identical to the baseline's (checked and recorded). So does the offloading replay
at `--offload-baseline`, its misses (every layer and step) identical.
The routing is synthetic but shaped like real routing: Zipf-skewed expert popularity and temporal locality
(a token repeats its predecessor's experts half of the time), so caches and placements have something to
find. Reading the store into `Routes` is timed separately.

Run: .venv/bin/python benchmarks/bench_whatif.py [--experts 8] [--tokens 1048576]
     .venv/bin/python benchmarks/bench_whatif.py --experts 256 --gpus 32 --gpus-per-node 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from record import Figure, flags, record

from moeviz.store.layout import append_manifest
from moeviz.store.schema import store_schema
from moeviz.store.writer import finish_run, prepare_run
from moeviz.testing.scale_traces import SYNTHETIC_RUN
from moeviz.whatif.capacity import replay_capacity
from moeviz.whatif.ep import EPConfig, simulate_ep
from moeviz.whatif.offload import POLICIES, simulate_offload_policies
from moeviz.whatif.routes import routes_from_store

LAYERS, K, SEQ = 8, 2, 1024
CHUNK = 65536
REPO = Path(__file__).resolve().parents[1]
BASELINE = "52d47fb"  # the revision before the capacity replay counted drops by level
CAPACITY_BASELINE = "3f7f090"  # the capacity replay before it sorted packed keys a few groups at a time
OFFLOAD_BASELINE = "867f6e5"  # the offloading replay before it batched cache sizes
TARGETS = {"expert parallelism": 2.0, "offload cache": 5.0, "capacity replay": 2.0}  # s, by name prefix


def baseline_module(revision: str, path: str) -> types.ModuleType:
    """The module at `path` as it was at git `revision`, loaded beside today's (its imports are today's)."""
    source = subprocess.run(
        ["git", "show", f"{revision}:{path}"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    name = f"baseline_{revision}_{Path(path).stem}"
    module = types.ModuleType(name)
    module.__file__ = f"{revision}:{path}"
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def synthetic_experts(rng: np.random.Generator, tokens: int, experts: int) -> np.ndarray:
    """[tokens, K] distinct experts per token: Zipf popularity, half of the tokens repeat the previous set."""
    popularity = 1.0 / np.arange(1, experts + 1) ** 0.8
    popularity = rng.permutation(popularity / popularity.sum())
    fresh = np.empty((tokens, K), dtype=np.int64)
    for start in range(0, tokens, CHUNK):  # chunks draw the same numbers as one call, in less memory
        keys = rng.random((min(CHUNK, tokens - start), experts)) ** (1.0 / popularity)  # weighted sampling
        top = np.argpartition(-keys, K - 1, axis=1)[:, :K]  # without replacement: the K largest keys
        order = np.argsort(-np.take_along_axis(keys, top, axis=1), axis=1)
        fresh[start : start + len(keys)] = np.take_along_axis(top, order, axis=1)
    repeat = rng.random(tokens) < 0.5
    repeat[::SEQ] = False  # a sequence starts fresh
    source = np.maximum.accumulate(np.where(repeat, 0, np.arange(tokens)))
    return fresh[source]


def write_store(root: Path, tokens: int, experts: int) -> None:
    rng = np.random.default_rng(0)
    folder, _ = prepare_run(root, "synthetic", "final", dict(SYNTHETIC_RUN), resume=False)
    layers = []
    for layer in range(LAYERS):
        chosen = synthetic_experts(rng, tokens, experts)
        n = tokens * K
        weight = rng.random((tokens, K), dtype=np.float32)
        weight = -np.sort(-weight / weight.sum(1, keepdims=True), axis=1)
        zeros = pa.array(np.zeros(n, np.int32))
        dictionary = lambda value, zeros=zeros: pa.DictionaryArray.from_arrays(zeros, pa.array([value]))  # noqa: E731
        token = np.repeat(np.arange(tokens), K)
        columns = {
            "model": dictionary("synthetic"),
            "checkpoint": dictionary("final"),
            "batch": pa.array(np.full(n, layer, np.int32)),
            "doc": pa.array((token // SEQ).astype(np.int32)),
            "domain": dictionary(""),
            "seq": pa.array((token // SEQ).astype(np.int64)),
            "pos": pa.array((token % SEQ).astype(np.int32)),
            "token_id": pa.array(rng.integers(0, 32000, n).astype(np.int32)),
            "layer": pa.array(np.full(n, layer, np.int16)),
            "site": dictionary("mlp"),
            "rank": pa.array(np.tile(np.arange(K, dtype=np.int8), tokens)),
            "expert": pa.array(chosen.reshape(-1).astype(np.int16)),
            "weight": pa.array(weight.reshape(-1)),
            "score": pa.array(weight.reshape(-1)),
            "lse": pa.array(np.zeros(n, np.float32)),
        }
        name = f"part-{layer:06d}.parquet"
        table = pa.Table.from_pydict(columns, schema=store_schema())
        pq.write_table(table, folder / name, compression="zstd")
        entry = {"batch": layer, "file": name, "rows": n, "bytes": (folder / name).stat().st_size}
        append_manifest(folder / "manifest.jsonl", {**entry, "tokens": tokens, "token_hash": ""})
        layers.append(
            {
                "site": "mlp",
                "layer": layer,
                "num_experts": experts,
                "k": K,
                "score_fn": "softmax",
                "bias": None,
            }
        )
    finish_run(folder, LAYERS, layers)


def identical_frames(new, was) -> bool:
    """Two CapacityResults with equal frames: same columns, dtypes, index and values, bit for bit."""
    return all(
        getattr(new, frame)().equals(getattr(was, frame)())
        and getattr(new, frame)().index.equals(getattr(was, frame)().index)
        for frame in ("layers_frame", "experts_frame", "position_frame")
    )


def timed(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2**20)
    parser.add_argument("--cache", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=None, help="default 4 (2 when E is not a multiple)")
    parser.add_argument("--gpus-per-node", type=int, default=2)
    parser.add_argument("--baseline", default=CAPACITY_BASELINE, help="git revision to compare with")
    parser.add_argument("--offload-baseline", default=OFFLOAD_BASELINE, help="git revision for offloading")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "store"
        write_store(root, args.tokens, args.experts)
        read = []
        for _ in range(3):
            read.append(timed(lambda: routes_from_store(root)))
        routes = routes_from_store(root)
    old_capacity = baseline_module(args.baseline, "moeviz/whatif/capacity.py")
    old_offload = baseline_module(args.offload_baseline, "moeviz/whatif/offload.py")
    gpus = args.gpus or (4 if args.experts % 4 == 0 else 2)
    ep = EPConfig(gpus=gpus, gpus_per_node=args.gpus_per_node, hidden_size=4096)
    eplb = EPConfig(
        gpus=gpus, gpus_per_node=args.gpus_per_node, redundant=gpus, placement="eplb", hidden_size=4096
    )
    cfs = (1.0, 1.25, 1.5, 2.0)
    old, old_offloading = f" [{args.baseline}]", f" [{args.offload_baseline}]"
    offloading = f"offload cache C={args.cache}, {len(POLICIES)} policies ({', '.join(POLICIES)})"
    contenders = {
        f"expert parallelism, contiguous, {gpus} GPUs": lambda: simulate_ep(routes, ep),
        f"expert parallelism, EPLB fit + replay, {gpus} GPUs + {gpus} redundant": lambda: simulate_ep(
            routes, eplb
        ),
        offloading: lambda: simulate_offload_policies(routes, args.cache, POLICIES),
        offloading + old_offloading: lambda: old_offload.simulate_offload_policies(
            routes, args.cache, POLICIES
        ),
        "capacity replay, 4 CFs (probs)": lambda: replay_capacity(routes, cfs, policy="probs"),
        f"capacity replay, 4 CFs (probs){old}": lambda: old_capacity.replay_capacity(
            routes, cfs, policy="probs"
        ),
        "capacity replay, 4 CFs (position)": lambda: replay_capacity(routes, cfs, policy="position"),
        f"capacity replay, 4 CFs (position){old}": lambda: old_capacity.replay_capacity(
            routes, cfs, policy="position"
        ),
    }
    same = all(
        identical_frames(
            replay_capacity(routes, cfs, policy=p), old_capacity.replay_capacity(routes, cfs, policy=p)
        )
        for p in ("probs", "position")
    )
    peers = {f"{name}{old}": name for name in contenders if f"{name}{old}" in contenders}
    peers[offloading + old_offloading] = offloading  # each baseline beside today's, not a contender
    same_offload = all(
        np.array_equal(getattr(new, array), getattr(was, array))
        for new, was in zip(
            simulate_offload_policies(routes, args.cache, POLICIES),
            old_offload.simulate_offload_policies(routes, args.cache, POLICIES),
            strict=True,
        )
        for array in ("misses", "step_misses")
    )
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(3):  # interleaved
        for name, run in contenders.items():
            times[name].append(timed(run))
    shape = f"E={args.experts}, k={K}, sequences of {SEQ}"
    print(f"{routes.tokens:,} routed tokens × {len(routes.layers)} layers, {shape}")
    figures = []
    command = f"python benchmarks/bench_whatif.py{flags(parser, args)}"
    for name, values in {"read the store into Routes": read, **times}.items():
        spread = f"{min(values):.2f}–{max(values):.2f}"
        ratio = ""
        if name in peers:
            ratio = f"; today's is {statistics.median(times[peers[name]]) / statistics.median(values):.2f}×"
        print(f"  {name}: {statistics.median(values):.2f} s CPU (spread {spread}){ratio}")
        median = statistics.median(values)
        target = next((limit for prefix, limit in TARGETS.items() if name.startswith(prefix)), None)
        if name in peers:
            target = None  # the baseline is the peer, not a contender for the target
        figures.append(
            Figure(
                "Deployment what-ifs",
                f"{name}, {routes.tokens:,} routed tokens × {len(routes.layers)} layers, {shape}",
                f"{median:.2f} s CPU ({spread}){ratio}",
                command,
                f"< {target:g} s" if target else "",
                median < target if target else None,
            )
        )
    identical = f"capacity replay frames (layers, experts, positions; both policies) = [{args.baseline}]'s"
    print(f"  {identical}: {same}")
    answer = "identical" if same else "DIFFERENT"
    figures.append(Figure("Deployment what-ifs", f"{identical}, {shape}", answer, command, "identical", same))
    identical = f"offload misses (every layer and step, 3 policies) = [{args.offload_baseline}]'s"
    print(f"  {identical}: {same_offload}")
    answer = "identical" if same_offload else "DIFFERENT"
    figures.append(
        Figure("Deployment what-ifs", f"{identical}, {shape}", answer, command, "identical", same_offload)
    )
    record("whatif" if args.experts == 8 else f"whatif_e{args.experts}", figures)


if __name__ == "__main__":
    main()
