"""`moeviz finetune-diff --model BASE --adapter DIR --text T`: what a LoRA fine-tune did to the routing. The
base and the base + adapter run the same tokens; printed: the engine diff of the two routings (router
mismatch per layer, tokens that moved), each expert's load shift with its bootstrap band, the router-weight
delta per layer (norm, rank) and the collapse verdicts before and after (`moeviz.analysis.finetune_diff`).

Two routing files already captured (`moeviz capture --adapter`) diff with `moeviz diff A B`.
"""

from __future__ import annotations

import argparse
from typing import Any

from moeviz.cli.exits import EXIT_VERDICT
from moeviz.cli.flags import add_input_group, add_model_flags, load_kwargs, load_progress, prompt_inputs
from moeviz.cli.output import Column, json_text, note_lines, text_table
from moeviz.errors import InputError

LAYER_COLUMNS = [
    Column("layer"),
    Column("site", align="<"),
    Column("pairs", "{:,}"),
    Column("router_mismatch", "{:.4f}"),
    Column("top1_mismatch", "{:.4f}"),
    Column("moved_experts", "{:,}", header="moved"),
    Column("norm", "{:.4g}", header="router_delta"),
    Column("relative", "{:.4g}", header="relative"),
    Column("rank", "{}"),
    Column("verdict_base", align="<"),
    Column("verdict_tuned", align="<"),
]
SHIFT_COLUMNS = [
    Column("layer"),
    Column("expert"),
    Column("share_base", "{:.4f}"),
    Column("share_tuned", "{:.4f}"),
    Column("shift", "{:+.4f}"),
    Column("shift_low", "{:+.4f}", header="low"),
    Column("shift_high", "{:+.4f}", header="high"),
]


def add_parser(commands: Any) -> None:
    command = commands.add_parser(
        "finetune-diff",
        help="what a LoRA adapter did to the routing: base vs base + adapter on the same tokens",
        description="Run --model and --model with --adapter merged on the same input, then report what the "
        "fine-tune changed: router mismatch per layer, each expert's load shift with its bootstrap band, the "
        "router-weight delta per layer (Frobenius norm, rank) and whether the collapse verdict got worse.",
    )
    add_model_flags(command)
    add_input_group(command)
    command.add_argument("--format", choices=["text", "json"], default="text")
    command.add_argument("--level", type=float, default=0.9, help="bootstrap band level (default 0.9)")
    command.add_argument("--draws", type=int, default=1000, help="bootstrap resamples (default 1000)")
    command.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    command.add_argument(
        "--shifts", type=int, default=10, metavar="N", help="text: list the N largest load shifts that moved"
    )
    command.add_argument(
        "--fail-on-degraded",
        action="store_true",
        help=f"exit with code {EXIT_VERDICT} when the fine-tune's collapse verdict is worse than the base's",
    )
    command.set_defaults(check=_check_flags, run=run_finetune_diff)


def _check_flags(args: argparse.Namespace) -> None:
    if args.adapter is None:
        raise InputError("finetune-diff compares --model with --model + --adapter: give --adapter DIR")
    if not 0 < args.level < 1:
        raise InputError(f"--level must be in (0, 1), got {args.level}")
    if args.draws < 1:
        raise InputError(f"--draws must be >= 1, got {args.draws}")
    if args.shifts < 0:
        raise InputError(f"--shifts must be 0 or more, got {args.shifts}")


def run_finetune_diff(args: argparse.Namespace) -> int:
    import gc

    import moeviz
    from moeviz.analysis.finetune_diff import finetune_diff, router_weights
    from moeviz.cli.capture import capture_quietly, warn_routing

    inputs = prompt_inputs(args)
    kwargs = load_kwargs(args)
    base_kwargs = {k: v for k, v in kwargs.items() if k != "adapter"}
    base = moeviz.load_model(args.model, **base_kwargs, progress=load_progress("loading base"))
    base_weights = router_weights(base)
    base_trace = capture_quietly(base, **inputs)
    del base
    gc.collect()  # one model in memory at a time
    tuned = moeviz.load_model(args.model, **kwargs, progress=load_progress("loading base + adapter"))
    tuned_weights = router_weights(tuned)
    tuned_trace = capture_quietly(tuned, **inputs)
    del tuned
    result = finetune_diff(
        base_trace,
        tuned_trace,
        base_weights=base_weights,
        tuned_weights=tuned_weights,
        level=args.level,
        draws=args.draws,
        seed=args.seed,
    )
    if args.format == "json":
        print(json_text(result.to_json()))
    else:
        print(format_finetune_diff(result, args.shifts))
    warn_routing(tuned_trace)
    return EXIT_VERDICT if args.fail_on_degraded and result.degraded else 0


def format_finetune_diff(result: Any, shifts: int = 10) -> str:
    """The text screen: the two sides, the headline figures, a table per layer, the largest load shifts."""
    from moeviz.analysis.finetune_diff import adapter_summary

    routing = result.routing
    base, tuned = routing.a, routing.b
    lines = [
        f"base:  {base.model.source} ({base.model.dtype}, {base.model.device})",
        f"tuned: {tuned.model.source} + {adapter_summary(tuned) or 'no adapter'}",
        f"{routing.mismatched:,} of {routing.pairs:,} (token, layer) pairs choose different experts (router "
        f"mismatch {routing.router_mismatch:.4f}); {routing.tokens_any_layer:.1%} of {routing.tokens:,} "
        "tokens moved in at least one layer",
        f"balance: {result.verdict_base} → {result.verdict_tuned}"
        + (" (degraded)" if result.degraded else " (not degraded)"),
    ]
    layers = routing.layers.merge(result.balance, on=["layer", "site"], how="left")
    moved = result.load_shift.groupby(["layer", "site"], as_index=False)["moved"].sum()
    layers = layers.merge(moved.rename(columns={"moved": "moved_experts"}), on=["layer", "site"], how="left")
    if result.router_delta is not None:
        delta = result.router_delta[["layer", "site", "norm", "relative", "rank"]]
        layers = layers.merge(delta, on=["layer", "site"], how="left")
    else:
        layers = layers.assign(norm=float("nan"), relative=float("nan"), rank=None)
    lines += ["", *text_table(LAYER_COLUMNS, layers.to_dict("records"))]
    largest = result.moved_experts().head(shifts)
    if shifts and len(largest):
        level = f"{result.level:.0%}"
        lines += [
            "",
            f"largest load shifts whose {level} bootstrap band excludes 0 (share = slots/(k·tokens)):",
        ]
        lines += text_table(SHIFT_COLUMNS, largest.to_dict("records"))
    reasons = result.balance.loc[result.balance["degraded"], ["layer", "reasons_tuned"]]
    lines += [f"degraded layer {row.layer}: {row.reasons_tuned}" for row in reasons.itertuples()]
    lines += note_lines([*routing.notes, *tuned.model.notes])
    return "\n".join(lines)


__all__ = ["add_parser", "format_finetune_diff", "run_finetune_diff"]
