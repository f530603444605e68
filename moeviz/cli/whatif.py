"""`moeviz whatif ep|offload|capacity|quant`: the deployment simulators' flags, their checks, and the run.

The routing comes from a prompt captured here (--text, --text-file, --token-ids, optionally --generate N), a
trace written by `moeviz capture` or `moeviz import` (--trace F.parquet; `ep` also takes a load table of an
engine's expert counts) or a corpus store written by `moeviz trace` (--store DIR); `quant` runs the model
itself, so it takes a prompt only. Each simulator's run and screen:
moeviz.cli.whatif_runs. The definitions every number follows: docs/deployment-whatifs.md. Bad flags or input
exit 2 (`moeviz: error: ...`, or argparse's usage error for a flag combination).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path
from typing import Any

from moeviz.cli.flags import add_model_flags, add_prompt_inputs, prompt_inputs
from moeviz.errors import InputError

DEFAULT_CFS = "1.0,1.25,1.5,2.0"
EXPERT_DTYPES = ("bf16", "fp16", "fp32", "fp8", "int8", "int4", "loaded")
MODEL_LOADED = (
    "The model is loaded even with --trace/--store: the simulator needs its sizes (hidden size, expert "
    "bytes, expert FLOPs)"
)


def add_parser(commands: Any) -> None:
    """The `whatif` command and its four simulators (dest: args.whatif)."""
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
        f"(DeepEP's per-GPU de-duplication). {MODEL_LOADED}; a load table of expert counts (--trace, from "
        "`moeviz import`) needs only the model's config and gives placement and balancedness, not traffic.",
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
        help="redundant expert slots (replicas): E + R a multiple of --gpus, as EPLB requires, R at most "
        "E*(G-1) and E + R at most 65536 (512 for traffic) (default 0)",
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
        help="fit the placement on a share F of the sequences (of the tokens, with one sequence; of the "
        "steps, with a load table), drawn as --split says, and evaluate it on the rest; default: fit and "
        "evaluate on the same tokens (the output says so)",
    )
    cluster.add_argument(
        "--split",
        choices=["shuffled", "ordered"],
        default="shuffled",
        help="with --fit-fraction: shuffled = the fit part drawn at random (seed 0; a corpus lists its "
        "sequences domain by domain), ordered = the first ones (default shuffled)",
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
        "sequence, or --group-tokens N), Megatron's get_capacity. --trace/--store need no model weights: "
        "the model is loaded only to route --text/--text-file/--token-ids.",
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
        "--buckets",
        type=int,
        default=10,
        help="position buckets of the drop curve, at most the tokens replayed (default 10)",
    )
    drop.add_argument(
        "--exact",
        action="store_true",
        help="compute C in exact arithmetic (default: Megatron's float order, which can land one above)",
    )
    drop.add_argument(
        "--group-tokens",
        type=int,
        metavar="N",
        help="dispatch group = a batch of N consecutive tokens, the sequences packed in order (default: "
        "one group per sequence)",
    )
    drop.add_argument(
        "--max-drop",
        type=float,
        metavar="PCT",
        help="also report the smallest CF (to 0.01) whose replay drops less than PCT %% of the assignments",
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
    whatif.set_defaults(run=run_whatif)


def _add_inputs(command: argparse.ArgumentParser, *, quant: bool = False) -> None:
    """--model and its load flags, the input (a prompt, a trace or a store) and --format."""
    # quant: --dtype is the quantisation format; the weights load at --load-dtype (default: their own)
    add_model_flags(command, dtype_flag="--load-dtype" if quant else "--dtype")
    source = command.add_mutually_exclusive_group(required=True)
    add_prompt_inputs(source)
    hidden = argparse.SUPPRESS if quant else None  # accepted only to refuse them with a clear message
    source.add_argument(
        "--trace",
        type=Path,
        metavar="F.parquet",
        help=hidden or "a trace written by `moeviz capture` or `moeviz import` (ep: also a load table)",
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
    _check_values(args)
    from transformers.utils import logging as hf_logging

    from moeviz.cli.progress import progress_bar
    from moeviz.cli.whatif_runs import SIMULATORS

    run = SIMULATORS[args.whatif]

    hf_logging.disable_progress_bar()  # one progress bar: ours
    args.routing_warnings = []  # `whatif_runs` adds capture's warning on non-finite router scores
    with progress_bar(total=3, desc=f"moeviz whatif {args.whatif}", unit="step") as bar:
        text = run(args, bar)
    print(text)
    for message in args.routing_warnings:  # after the result, as `capture` and `report` print it
        print(f"moeviz: warning: {message}", file=sys.stderr)
    return 0


def _check_values(args: argparse.Namespace) -> None:
    """Flag values that cannot work, refused (InputError, exit 2) before the model loads."""
    if args.trace is None and args.store is None:
        prompt_inputs(args)  # an empty --text, an unreadable or oversized --text-file: before the load
    if getattr(args, "generate", 0) < 0:
        raise InputError(f"--generate must be >= 0, got {args.generate}")
    if args.trace is not None and not args.trace.is_file():
        raise InputError(
            f"--trace {args.trace} is not a file (a .parquet written by `moeviz capture` or `moeviz import`)"
        )
    if args.store is not None and not args.store.is_dir():
        raise InputError(f"--store {args.store} is not a folder (a store written by `moeviz trace`)")
    if args.whatif == "ep":  # EPConfig checks the cluster flags (built before the model loads)
        if args.fit_fraction is not None and not 0.0 < args.fit_fraction < 1.0:
            raise InputError(f"--fit-fraction must be between 0 and 1 (exclusive), got {args.fit_fraction}")
        if args.redundant < 0:
            raise InputError(f"--redundant must be >= 0, got {args.redundant}")
    elif args.whatif == "offload":
        if args.cache < 1:
            raise InputError(f"--cache must be >= 1, got {args.cache}")
        if not (math.isfinite(args.bandwidth) and args.bandwidth > 0):
            raise InputError(f"--bandwidth must be a finite number > 0 GB/s, got {args.bandwidth}")
        if args.step_time is not None and not (math.isfinite(args.step_time) and args.step_time >= 0):
            raise InputError(f"--step-time must be a finite number >= 0 seconds, got {args.step_time}")
    elif args.whatif == "capacity":
        args.cf = _capacity_factors(args.cf)
        if args.buckets < 1:  # the upper bound, the tokens replayed, is checked once they are read
            raise InputError(f"--buckets must be >= 1, got {args.buckets}")
        if args.group_tokens is not None and args.group_tokens < 1:
            raise InputError(f"--group-tokens must be >= 1, got {args.group_tokens}")
        if args.max_drop is not None and not 0 < args.max_drop <= 100:
            raise InputError(f"--max-drop is a percentage in (0, 100], got {args.max_drop}")


def _capacity_factors(text: str) -> list[float]:
    try:
        cfs = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--cf takes comma-separated numbers, e.g. {DEFAULT_CFS}; got {text!r}") from None
    if not cfs:
        raise InputError("--cf is empty")
    bad = [cf for cf in cfs if not (math.isfinite(cf) and cf > 0)]
    if bad:
        raise InputError(f"--cf: a capacity factor must be > 0 and finite, got {bad[0]}")
    return list(dict.fromkeys(cfs))  # a repeated CF once: each would be replayed and totalled again
