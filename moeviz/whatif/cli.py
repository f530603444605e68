"""`moeviz whatif ep|offload|capacity|quant`: the deployment simulators from the shell.

Parsed by the one argparse tree of moeviz.cli (`add_whatif_parser`), run by `run_whatif`. The routing comes
from a prompt captured here (--text, --text-file, --token-ids, optionally --generate N), a trace written by
`moeviz capture` (--trace F.parquet) or a corpus store written by `moeviz trace` (--store DIR); `quant` runs
the model itself, so it takes a prompt only. The definitions every number follows: docs/deployment-whatifs.md.
Bad flags or input exit 2 (`moeviz: error: ...`, or argparse's usage error for a flag combination).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moeviz.cli_flags import (
    DTYPES,
    MODEL_HELP,
    add_model_flags,
    add_prompt_inputs,
    load_kwargs,
    prompt_inputs,
)
from moeviz.errors import InputError
from moeviz.jsonable import dumps

DEFAULT_CFS = "1.0,1.25,1.5,2.0"
EP_COLUMNS = {  # layers_frame column -> the text table's shorter header
    "layer": "layer",
    "ep_balancedness": "ep_balancedness",
    "max_gpu_load": "max_load",
    "mean_gpu_load": "mean_load",
    "dispatch_bytes_local": "local",
    "dispatch_bytes_intra": "intra",
    "dispatch_bytes_inter": "inter",
    "dispatch_bytes_nodedup": "nodedup",
    "dispatch_bytes_node_dedup_rdma": "node_rdma",
    "combine_bytes": "combine",
    "a2a_time_s": "a2a_s",
    "compute_time_s": "compute_s",
    "comm_share": "comm_share",
}
EXPERT_DTYPES = ("bf16", "fp16", "fp32", "fp8", "int8", "int4", "loaded")
MODEL_LOADED = (
    "The model is loaded even with --trace/--store: the simulator needs its sizes (hidden size, expert "
    "bytes, expert FLOPs)"
)


def add_whatif_parser(commands) -> argparse.ArgumentParser:
    """The `whatif` subcommand and its four simulators (dest: args.whatif)."""
    whatif = commands.add_parser(
        "whatif",
        help="deployment what-ifs from real routing: EP/All-to-All, offloading, capacity, quantisation",
        description="Replay a model's real routing through a deployment: expert parallelism and All-to-All "
        "(ep), an expert offloading cache (offload), capacity-factor drops (capacity), or run it with "
        "fake-quantised weights (quant). Definitions: docs/deployment-whatifs.md.",
    )
    sims = whatif.add_subparsers(dest="whatif", required=True, metavar="SIMULATOR")

    ep = sims.add_parser(
        "ep",
        help="expert parallelism: load per GPU, ep_balancedness, All-to-All bytes and time",
        description="Place the experts on GPUs and count each GPU's load and the All-to-All dispatch bytes "
        f"(DeepEP's per-GPU de-duplication). {MODEL_LOADED}.",
    )
    _add_inputs(ep)
    cluster = ep.add_argument_group("cluster and placement")
    cluster.add_argument("--gpus", type=int, required=True, metavar="G", help="GPUs the experts spread over")
    cluster.add_argument("--gpus-per-node", type=int, required=True, metavar="n", help="GPUs per node")
    cluster.add_argument(
        "--redundant",
        type=int,
        default=0,
        metavar="R",
        help="redundant expert slots (replicas), a multiple of --gpus as EPLB requires (default 0)",
    )
    cluster.add_argument(
        "--placement",
        choices=["contiguous", "eplb", "traffic"],
        default="contiguous",
        help="contiguous: expert e on GPU e // (E/G); eplb: DeepSeek's EPLB rebalance_experts; traffic: "
        "co-chosen experts kept on one GPU/node under a balance constraint (default contiguous)",
    )
    cluster.add_argument(
        "--source",
        choices=["contiguous", "round-robin"],
        default="contiguous",
        help="the GPU a token starts on: contiguous = token t of N on floor(t*G/N), round-robin = t mod G",
    )
    cluster.add_argument(
        "--replica",
        choices=["even", "vllm"],
        default="even",
        help="copy of a replicated expert a token uses: even = i-th token to choose it -> copy i mod r "
        "(EPLB's load model), vllm = (t*k + j) mod r (vLLM's rule)",
    )
    cluster.add_argument(
        "--message-dtype", choices=["bf16", "fp8"], default="bf16", help="dtype of a dispatched token"
    )
    cluster.add_argument(
        "--fit-fraction",
        type=float,
        metavar="F",
        help="fit the placement on the first F of the tokens (sequences when there are several) and "
        "evaluate it on the rest; default: fit and evaluate on the same tokens (the output says so)",
    )
    cost = ep.add_argument_group("time model")
    cost.add_argument(
        "--nvlink-gbps",
        type=float,
        metavar="GBPS",
        help="intra-node GB/s per GPU, one direction (default 450)",
    )
    cost.add_argument(
        "--internode-gbps",
        type=float,
        metavar="GBPS",
        help="inter-node GB/s per GPU (default 50: a 400 Gb/s NIC)",
    )
    cost.add_argument(
        "--gpu-tflops", type=float, metavar="TFLOPS", help="achieved dense TFLOP/s per GPU (default 400)"
    )
    ep.set_defaults(check=functools.partial(_check_flags, ep))

    offload = sims.add_parser(
        "offload",
        help="expert offloading: per-layer GPU cache hit rate, bytes moved, stall",
        description="Each MoE layer keeps --cache experts on the GPU, the rest in CPU RAM; every step needs "
        f"all of its token's experts resident. Each sequence is decoded on its own, cold. {MODEL_LOADED}.",
    )
    _add_inputs(offload)
    cache = offload.add_argument_group("cache")
    cache.add_argument("--cache", type=int, required=True, metavar="C", help="experts cached per MoE layer")
    cache.add_argument(
        "--policy",
        choices=["lru", "lfu", "belady", "all"],
        default="all",
        help="eviction policy; belady (farthest next use) is the optimum (default: all three)",
    )
    cache.add_argument(
        "--bandwidth",
        type=float,
        default=16.0,
        metavar="GBPS",
        help="host-to-GPU GB/s for the stall model (default 16: PCIe 4.0 x16)",
    )
    cache.add_argument(
        "--expert-dtype",
        choices=EXPERT_DTYPES,
        default="bf16",
        help="dtype an expert is stored and moved in, for the bytes (fp8/int8/int4 with their scales; "
        "loaded = the loaded tensors' own dtype) (default bf16)",
    )
    cache.add_argument(
        "--step-time",
        type=float,
        metavar="S",
        help="compute seconds per decode step per layer, added to the stall for the tokens/s bound "
        "(default: none, the bound counts the stall only)",
    )
    cache.add_argument(
        "--prefetch",
        action="store_true",
        help="also report speculative prefetch recall (layer l+1's router on layer l's input; runs the model "
        "on the prompt, so --text/--text-file/--token-ids only)",
    )
    offload.set_defaults(check=functools.partial(_check_flags, offload))

    capacity = sims.add_parser(
        "capacity",
        help="capacity-factor replay: the tokens a capacity factor would drop",
        description="Replay the routing under expert capacity C = ceil((T*k/E)*CF) per dispatch group (one "
        "sequence), Megatron's get_capacity. --trace/--store need no model weights: the model is loaded only "
        "to route --text/--text-file/--token-ids.",
    )
    _add_inputs(capacity)
    drop = capacity.add_argument_group("capacity")
    drop.add_argument(
        "--cf", default=DEFAULT_CFS, metavar="CF,...", help=f"capacity factors (default {DEFAULT_CFS})"
    )
    drop.add_argument(
        "--policy",
        choices=["probs", "position"],
        default="probs",
        help="which assignments an over-full expert keeps: probs = the largest combination weights "
        "(Megatron's default), position = the first arrivals (default probs)",
    )
    drop.add_argument(
        "--buckets", type=int, default=10, help="position buckets of the drop curve (default 10)"
    )
    drop.add_argument(
        "--exact",
        action="store_true",
        help="compute C in exact arithmetic (default: Megatron's float order, which can land one above)",
    )
    capacity.set_defaults(check=functools.partial(_check_flags, capacity))

    quant = sims.add_parser(
        "quant",
        help="quantisation: how often fake-quantised weights change the chosen experts",
        description="Run the same tokens through the model with the targeted weights fake-quantised per "
        "output channel (symmetric absmax) and compare the routing; the loaded model is never modified. "
        "Runs the model, so it takes a prompt, not a --trace or --store.",
    )
    _add_inputs(quant, quant=True)
    q = quant.add_argument_group("quantisation")
    q.add_argument(
        "--dtype",
        choices=["int8", "fp8", "int4"],
        default="int8",
        help="format: int8 (round half to even), fp8 (e4m3), int4 (groups of 128) (default int8)",
    )
    q.add_argument(
        "--target",
        choices=["experts", "router", "both"],
        default="experts",
        help="weights quantised (default experts)",
    )
    quant.set_defaults(check=functools.partial(_check_flags, quant))
    return whatif


def _add_inputs(command: argparse.ArgumentParser, *, quant: bool = False) -> None:
    """--model and its load flags, the input (a prompt, a trace or a store) and --format."""
    if quant:  # --dtype is the quantisation format here: the weights load at the checkpoint's own dtype
        command.add_argument("--model", required=True, help=MODEL_HELP)
        command.add_argument(
            "--trust-remote-code", action="store_true", help="run modelling code shipped in the folder"
        )
        command.add_argument(
            "--load-dtype", choices=DTYPES, default="auto", help="dtype the weights load in (default auto)"
        )
        command.add_argument(
            "--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda:N, mps"
        )
    else:
        add_model_flags(command)
    source = command.add_mutually_exclusive_group(required=True)
    add_prompt_inputs(source)
    hidden = argparse.SUPPRESS if quant else None  # accepted only to refuse them with a clear message
    source.add_argument(
        "--trace", type=Path, metavar="F.parquet", help=hidden or "a trace written by `moeviz capture`"
    )
    source.add_argument(
        "--store", type=Path, metavar="DIR", help=hidden or "a corpus store written by `moeviz trace`"
    )
    if not quant:
        command.add_argument("--run-model", metavar="NAME", help="--store: the run's model label")
        command.add_argument("--checkpoint", metavar="C", help="--store: the run's checkpoint label")
        command.add_argument(
            "--generate",
            type=int,
            default=0,
            metavar="N",
            help="with a prompt: also generate N tokens (greedy) and replay them in decode order",
        )
    command.add_argument("--format", choices=["text", "json"], default="text")


def _check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag combinations that cannot work: a usage error (exit 2) before anything loads."""
    routed = args.trace is not None or args.store is not None
    if args.whatif == "quant":
        if routed:
            given = "--trace" if args.trace is not None else "--store"
            parser.error(
                "quant runs the model on the tokens itself: give --text, --text-file or --token-ids, "
                f"not {given}"
            )
        return
    if args.store is None:
        for flag, value in (("--run-model", args.run_model), ("--checkpoint", args.checkpoint)):
            if value is not None:
                parser.error(f"{flag} only applies to --store")
    if routed and getattr(args, "prefetch", False):
        parser.error(
            "--prefetch runs the model on a prompt (--text, --text-file, --token-ids), not on a trace"
        )
    if routed and args.generate:
        parser.error(
            "--generate applies to a prompt (--text, --text-file, --token-ids), not to a stored trace"
        )


def run_whatif(args: argparse.Namespace) -> int:
    """`moeviz whatif SIMULATOR ...`: values checked, routing gathered, simulator run, result printed."""
    run = {"ep": _run_ep, "offload": _run_offload, "capacity": _run_capacity, "quant": _run_quant}[
        args.whatif
    ]
    _check_values(args)
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one progress bar: ours
    with tqdm(total=3, desc=f"moeviz whatif {args.whatif}", unit="step", file=sys.stderr, leave=False) as bar:
        text = run(args, bar)
    print(text)
    return 0


def _check_values(args: argparse.Namespace) -> None:
    """Flag values that cannot work, refused (InputError, exit 2) before the model loads."""
    if getattr(args, "generate", 0) < 0:
        raise InputError(f"--generate must be >= 0, got {args.generate}")
    if args.trace is not None and not args.trace.is_file():
        raise InputError(f"--trace {args.trace} is not a file (a .parquet written by `moeviz capture`)")
    if args.store is not None and not args.store.is_dir():
        raise InputError(f"--store {args.store} is not a folder (a store written by `moeviz trace`)")
    if args.whatif == "ep":  # EPConfig checks the cluster flags (built before the model loads)
        if args.fit_fraction is not None and not 0.0 < args.fit_fraction < 1.0:
            raise InputError(f"--fit-fraction must be between 0 and 1 (exclusive), got {args.fit_fraction}")
    elif args.whatif == "offload":
        if args.cache < 1:
            raise InputError(f"--cache must be >= 1, got {args.cache}")
        if not args.bandwidth > 0:
            raise InputError(f"--bandwidth must be > 0 GB/s, got {args.bandwidth}")
        if args.step_time is not None and not args.step_time >= 0:
            raise InputError(f"--step-time must be >= 0 seconds, got {args.step_time}")
    elif args.whatif == "capacity":
        args.cf = _capacity_factors(args.cf)
        if args.buckets < 1:
            raise InputError(f"--buckets must be >= 1, got {args.buckets}")


def _capacity_factors(text: str) -> list[float]:
    try:
        cfs = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--cf takes comma-separated numbers, e.g. {DEFAULT_CFS}; got {text!r}") from None
    if not cfs:
        raise InputError("--cf is empty")
    bad = [cf for cf in cfs if not cf > 0]
    if bad:
        raise InputError(f"--cf: a capacity factor must be > 0, got {bad[0]}")
    return cfs


# ---------------------------------------------------------------- inputs


def _load(args: argparse.Namespace, bar) -> Any:
    """The model, its bytes drawn in the bar's postfix."""
    from moeviz.models import load_model

    def loading(done: int, total: int) -> None:
        bar.set_postfix_str(f"loading model {done / 2**20:,.1f}/{total / 2**20:,.1f} MiB")

    bar.set_postfix_str("loading model")
    if args.whatif == "quant":
        kwargs = {
            "trust_remote_code": args.trust_remote_code,
            "dtype": args.load_dtype,
            "device": args.device,
        }
    else:
        kwargs = load_kwargs(args)
    loaded = load_model(args.model, **kwargs, progress=loading)
    bar.update()
    return loaded


def _routes(args: argparse.Namespace, bar, loaded=None):
    """(routes, notes): the routing to replay, from the prompt (run through `loaded`), --trace or --store."""
    from moeviz.whatif.routes import routes_from_store, routes_from_trace

    notes: list[str] = []
    if args.store is not None:
        bar.set_postfix_str("reading store")
        routes = routes_from_store(args.store, model=args.run_model, checkpoint=args.checkpoint)
        notes += routes.notes
    elif args.trace is not None:
        from moeviz.trace import Trace

        bar.set_postfix_str("reading trace")
        trace = Trace.from_parquet(args.trace)
        routes = routes_from_trace(trace)
    else:
        import warnings

        from moeviz.capture.routing import RoutingWarning, capture

        inputs = prompt_inputs(args)
        bar.set_postfix_str("running forward" if not args.generate else f"generating {args.generate} tokens")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RoutingWarning)
            trace = capture(loaded, generate=args.generate, **inputs)
        routes = routes_from_trace(trace)
    if args.trace is not None or args.store is not None:
        notes += _model_mismatch(routes, loaded)
    bar.update()
    return routes, notes


def _model_mismatch(routes, loaded) -> list[str]:
    """Refuse routes whose layers route over other expert counts than --model's; note another model name."""
    if loaded is None:
        return []
    experts = {(site.layer, site.site): site.num_experts for site in loaded.sites}
    for layer in routes.layers:
        want = experts.get((layer.layer, layer.site))
        if want is not None and want != layer.num_experts:
            raise InputError(
                f"the routes' layer {layer.layer} has {layer.num_experts} experts, --model "
                f"{loaded.info.source} has {want}: give the model the routing was captured from"
            )
    if routes.model != loaded.info.source:
        return [f"routing captured from {routes.model}; sizes taken from --model {loaded.info.source}"]
    return []


# ---------------------------------------------------------------- simulators


def _run_ep(args: argparse.Namespace, bar) -> str:
    from dataclasses import replace

    from moeviz.whatif.ep import EPConfig, fit_placement, simulate_ep
    from moeviz.whatif.model_size import expert_flops_per_token, model_size

    overrides = {
        name: getattr(args, name)
        for name in ("nvlink_gbps", "internode_gbps", "gpu_tflops")
        if getattr(args, name) is not None
    }
    config = EPConfig(  # checks the flags before the model loads; the model's sizes come after
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        redundant=args.redundant,
        placement=args.placement,
        source=args.source,
        replica=args.replica,
        message_dtype=args.message_dtype,
        **overrides,
    )
    loaded = _load(args, bar)
    routes, notes = _routes(args, bar, loaded)
    size = model_size(loaded.model)
    config = replace(
        config,
        hidden_size=int(size.hidden_size),
        expert_flops_per_token=float(expert_flops_per_token(loaded)),
    )
    bar.set_postfix_str(f"placing experts ({args.placement})")
    if args.fit_fraction is not None:
        fit, evaluate, fitted = routes.split(args.fit_fraction)
        result = simulate_ep(evaluate, config, fit_placement(fit, config))
    else:
        fitted = "fitted and evaluated on the same tokens (in-sample; --fit-fraction evaluates out of sample)"
        result = simulate_ep(routes, config)
    if args.placement == "contiguous":
        fitted = "contiguous placement: nothing fitted"
    bar.update()
    payload = {**result.to_json(), "fit": fitted, "config": _config_json(config), "notes": notes}
    if args.format == "json":
        return dumps(payload)
    head = [
        f"{payload['model']}: {payload['tokens']} tokens, {len(routes.layers)} MoE layers; placement "
        f"{args.placement} over {args.gpus} GPUs ({args.gpus_per_node} per node), {args.redundant} redundant "
        f"slots; source {args.source}, replica {args.replica}, messages {args.message_dtype}",
        f"placement: {fitted}",
        f"definition: {result.definition}",
    ]
    frame = result.layers_frame().rename(columns=EP_COLUMNS)[list(EP_COLUMNS.values())]
    totals = {EP_COLUMNS.get(key, key): value for key, value in payload["totals"].items()}
    tail = [
        f"ep_balancedness_over_layers (Σ mean / Σ max, vLLM): {result.ep_balancedness_over_layers:.4f}",
        "total: "
        + ", ".join(
            f"{key} {_number(v)}" for key, v in totals.items() if key != "ep_balancedness_over_layers"
        ),
        "bytes: local = to the token's own GPU (no link), intra/inter = de-duplicated per destination GPU "
        "(DeepEP), nodedup = one message per remote (token, expert), node_rdma = once per remote node",
    ]
    return _render(head, frame, tail, notes)


def _config_json(config) -> dict[str, Any]:
    from dataclasses import asdict

    return {key: value for key, value in asdict(config).items() if isinstance(value, (int, float, str))}


def _run_offload(args: argparse.Namespace, bar) -> str:
    import pandas as pd

    from moeviz.whatif.model_size import expert_bytes
    from moeviz.whatif.offload import POLICIES, simulate_offload

    loaded = _load(args, bar)
    routes, notes = _routes(args, bar, loaded)
    nbytes = int(expert_bytes(loaded, None if args.expert_dtype == "loaded" else args.expert_dtype))
    policies = POLICIES if args.policy == "all" else (args.policy,)
    results = []
    for policy in policies:
        bar.set_postfix_str(f"simulating {policy}")
        results.append(
            simulate_offload(
                routes,
                args.cache,
                policy,
                expert_bytes=nbytes,
                bandwidth_gbps=args.bandwidth,
                step_time_s=args.step_time,
            )
        )
    prefetch = None
    if args.prefetch:
        from moeviz.whatif.prefetch import DEFINITION as PREFETCH
        from moeviz.whatif.prefetch import prefetch_recall

        bar.set_postfix_str("prefetch recall")
        inputs = prompt_inputs(args)
        one = {"text": inputs["texts"]} if "texts" in inputs else {"token_ids": inputs["token_ids"][0]}
        prefetch = prefetch_recall(loaded, **one)
    bar.update()
    definitions = list(dict.fromkeys(r.definition for r in results))
    first = results[0].to_json()
    payload = {
        **first,
        "definition": "; ".join(definitions),
        "layers": [row for r in results for row in r.to_json()["layers"]],
        "expert_bytes": nbytes,
        "expert_dtype": args.expert_dtype,
        "bandwidth_gbps": args.bandwidth,
        "notes": notes,
    }
    if prefetch is not None:
        payload["prefetch"] = prefetch.to_dict(orient="records")
        payload["prefetch_definition"] = PREFETCH
    if args.format == "json":
        return dumps(payload)
    frame = pd.concat([r.layers_frame() for r in results], ignore_index=True)
    head = [
        f"{payload['model']}: {payload['tokens']} tokens in {routes.sequences} sequence(s), "
        f"{len(routes.layers)} MoE layers; cache {args.cache} experts per layer, one expert "
        f"{nbytes:,} bytes ({args.expert_dtype}), {args.bandwidth:g} GB/s",
        *(f"definition: {d}" for d in definitions),
    ]
    tail = []
    for policy, rows in frame.groupby("policy", sort=False):
        hits, misses = int(rows.hits.sum()), int(rows.misses.sum())
        rate = hits / (hits + misses) if hits + misses else float("nan")
        tail.append(
            f"total {policy}: hit rate {rate:.4f}, {misses:,} misses, {int(rows.bytes.sum()):,} bytes, "
            f"stall {rows.stall_s.sum():.4g} s"
        )
    if prefetch is not None:
        tail.append(f"prefetch ({PREFETCH}), on the prompt's tokens:")
        tail += [
            f"  layer {row.from_layer} -> {row.layer}: recall {row.recall:.4f} over {row.tokens} tokens"
            for row in prefetch.itertuples()
        ]
    return _render(head, frame, tail, notes)


def _run_capacity(args: argparse.Namespace, bar) -> str:
    from moeviz.whatif.capacity import replay_capacity

    if args.trace is None and args.store is None:
        loaded = _load(args, bar)
    else:
        loaded = None
        bar.update()
    routes, notes = _routes(args, bar, loaded)
    bar.set_postfix_str("replaying capacity")
    result = replay_capacity(routes, args.cf, policy=args.policy, buckets=args.buckets, exact=args.exact)
    bar.update()
    payload = {**result.to_json(), "notes": notes}
    if args.format == "json":
        return dumps(payload)
    cfs = ", ".join(f"{c:g}" for c in args.cf)
    head = [
        f"{payload['model']}: {payload['tokens']} tokens in {routes.sequences} sequence(s) (one dispatch "
        f"group each), {len(routes.layers)} MoE layers; policy {args.policy}, CF {cfs}",
        f"definition: {result.definition}",
    ]
    frame, positions = result.layers_frame(), result.position_frame()
    tail = []
    for cf, rows in frame.groupby("cf", sort=True):
        assigned, dropped = int(rows.assigned.sum()), int(rows.dropped.sum())
        share = dropped / assigned if assigned else float("nan")
        curve = positions[positions.cf == cf].sort_values("bucket")
        tail.append(
            f"total CF {cf:g}: {dropped:,} of {assigned:,} assignments dropped ({share:.4f}), "
            f"{int(rows.tokens_all_dropped.sum()):,} token-layers lost every slot; drop rate by position "
            "bucket (start -> end of a sequence): " + " ".join(f"{v:.3f}" for v in curve.drop_rate)
        )
    return _render(head, frame, tail, notes)


def _run_quant(args: argparse.Namespace, bar) -> str:
    from moeviz.whatif.quant import quantisation_flips

    inputs = prompt_inputs(args)
    loaded = _load(args, bar)
    bar.set_postfix_str(f"routing with {args.dtype} {args.target}")
    kwargs = {"text": inputs["texts"]} if "texts" in inputs else {"token_ids": inputs["token_ids"][0]}

    def progress(fraction: float, message: str) -> None:
        bar.set_postfix_str(f"{message} ({fraction:.0%})")

    result = quantisation_flips(loaded, **kwargs, dtype=args.dtype, target=args.target, progress=progress)
    bar.update(2)
    payload = result.to_json()
    if args.format == "json":
        return dumps(payload)
    frame = result.layers_frame()
    head = [
        f"{payload['model']}: {payload['tokens']} tokens, {frame.layer.nunique()} MoE layers; "
        f"{args.dtype} on the {args.target} weights",
        f"definition: {result.definition}",
    ]
    tail = [
        f"mean flip rate over layers: {frame.flip_rate.mean():.4f}",
        f"Δ mean log-prob of the next token (quantised − original): {result.delta_logprob:+.4f}",
    ]
    margins = result.margin_frame()
    if len(margins):
        by_quartile = (
            margins.assign(flips=margins.flip_rate * margins.tokens)
            .groupby("quartile")[["flips", "tokens"]]
            .sum()
        )
        tail.append(
            "flip rate by router-margin quartile (1 = lowest margin): "
            + ", ".join(f"Q{q} {row.flips / max(row.tokens, 1):.4f}" for q, row in by_quartile.iterrows())
        )
    sizes = result.bytes_frame()
    tail.append("model bytes: " + ", ".join(f"{row.format} {row.bytes:,}" for row in sizes.itertuples()))
    return _render(head, frame, tail, [])


# ---------------------------------------------------------------- output


def _render(head: list[str], frame, tail: list[str], notes: list[str]) -> str:
    """The header lines, the per-layer table, the totals and any notes, as one screen of text."""
    table = frame.to_string(index=False, formatters=_formatters(frame))
    return "\n".join([*head, table, *tail, *(f"note: {note}" for note in notes)])


def _formatters(frame) -> dict[str, Callable[[Any], str]]:
    import pandas as pd

    out: dict[str, Callable[[Any], str]] = {}
    for column in frame.columns:
        if pd.api.types.is_float_dtype(frame[column]):
            out[column] = "{:.4g}".format
        elif pd.api.types.is_integer_dtype(frame[column]):
            out[column] = "{:,}".format
    return out


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"
