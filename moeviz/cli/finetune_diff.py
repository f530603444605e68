"""`moeviz finetune-diff --model BASE --adapter DIR --text T`: what a LoRA fine-tune did to the routing. The
base and the base + adapter run the same tokens; printed: the engine diff of the two routings (router
mismatch per layer, tokens that moved), each expert's load shift with its bootstrap band, the router-weight
delta per layer (norm, rank) and the collapse verdicts before and after (`moeviz.analysis.finetune_diff`).
On texts labelled by domain (`--corpus`, or `--eval-corpus`: the bundled evaluation slices) also which
experts took each domain and each domain's specialisation score before and after.

Two routing files already captured (`moeviz capture --adapter`) diff with `moeviz diff A B`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moeviz.cli.exits import EXIT_VERDICT
from moeviz.cli.flags import (
    CORPUS_HELP,
    REPORT_CHUNK_TOKENS,
    add_batching_flags,
    add_model_flags,
    add_prompt_inputs,
    load_kwargs,
    load_progress,
    prompt_inputs,
)
from moeviz.cli.output import Column, json_text, note_lines, text_table
from moeviz.errors import InputError

MAX_CHUNKS = 16  # --corpus: sequences per domain unless --max-chunks says otherwise

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
TOOK_COLUMNS = [Column("layer"), Column("domain", align="<"), *SHIFT_COLUMNS[1:]]
SPECIALISATION_COLUMNS = [
    Column("layer"),
    Column("domain", align="<"),
    Column("tokens", "{:,}"),
    Column("top_expert_base", header="top_base"),
    Column("ds_base", "{:.3f}"),
    Column("verdict_base", align="<"),
    Column("top_expert_tuned", header="top_tuned"),
    Column("ds_tuned", "{:.3f}"),
    Column("verdict_tuned", align="<"),
    Column("took", "{}", header="took"),
]


def add_parser(commands: Any) -> None:
    command = commands.add_parser(
        "finetune-diff",
        help="what a LoRA adapter did to the routing: base vs base + adapter on the same tokens",
        description="Run --model and --model with --adapter merged on the same input, then report what the "
        "fine-tune changed: router mismatch per layer, each expert's load shift with its bootstrap band, the "
        "router-weight delta per layer (Frobenius norm, rank) and whether the collapse verdict got worse. On "
        "texts labelled by domain (--corpus, --eval-corpus) also which experts took each domain (their share "
        "of the domain's slots rose, bootstrap band over its tokens above 0) and each domain's "
        "specialisation score before and after.",
    )
    add_model_flags(command)
    source = command.add_mutually_exclusive_group(required=True)
    add_prompt_inputs(source)
    source.add_argument("--corpus", type=Path, help=CORPUS_HELP + "; adds the change per domain")
    source.add_argument(
        "--eval-corpus",
        action="store_true",
        help="the bundled evaluation slices (sample_models/eval: 8 windows of 256 tokens of each of 5 "
        "domains); adds the change per domain",
    )
    add_batching_flags(command, chunk_tokens=REPORT_CHUNK_TOKENS)
    command.add_argument(
        "--max-chunks",
        type=int,
        default=MAX_CHUNKS,
        help=f"--corpus: at most this many sequences per domain (default {MAX_CHUNKS})",
    )
    command.add_argument(
        "--shuffles",
        type=int,
        default=100,
        help="per domain: routing shuffles behind the specialisation verdicts (default 100)",
    )
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
    if args.shuffles < 0:
        raise InputError(f"--shuffles must be 0 or more, got {args.shuffles}")
    for name in ("batch_size", "chunk_tokens", "max_chunks"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.corpus is not None:
        from moeviz.corpus import check_corpus

        check_corpus(args.corpus)  # a bad corpus fails before any model loads


def run_finetune_diff(args: argparse.Namespace) -> int:
    import gc

    import moeviz
    from moeviz.analysis.finetune_diff import finetune_diff, router_weights
    from moeviz.cli.capture import warn_routing

    labelled = args.corpus is not None or args.eval_corpus
    inputs = None if labelled else prompt_inputs(args)
    kwargs = load_kwargs(args)
    base_kwargs = {k: v for k, v in kwargs.items() if k != "adapter"}
    base = moeviz.load_model(args.model, **base_kwargs, progress=load_progress("loading base"))
    base_weights = router_weights(base)
    batches, seq_domains = domain_batches(base, args) if labelled else ([], None)
    base_trace = _capture(base, inputs, batches)
    del base
    gc.collect()  # one model in memory at a time
    tuned = moeviz.load_model(args.model, **kwargs, progress=load_progress("loading base + adapter"))
    tuned_weights = router_weights(tuned)
    tuned_trace = _capture(tuned, inputs, batches)  # an adapter keeps the tokenizer: the same token ids
    del tuned
    result = finetune_diff(
        base_trace,
        tuned_trace,
        base_weights=base_weights,
        tuned_weights=tuned_weights,
        seq_domains=seq_domains,
        level=args.level,
        draws=args.draws,
        seed=args.seed,
        shuffles=args.shuffles,
    )
    if args.format == "json":
        print(json_text(result.to_json()))
    else:
        print(format_finetune_diff(result, args.shifts))
    warn_routing(tuned_trace)
    return EXIT_VERDICT if args.fail_on_degraded and result.degraded else 0


def domain_batches(loaded: Any, args: argparse.Namespace) -> tuple[list[list[list[int]]], list[str]]:
    """The labelled sequences, in batches of --batch-size, and the domain of each sequence: the windows of
    --corpus as `report --corpus` cuts them, or the evaluation slices' (`moeviz.samples.eval_batch`)."""
    if args.corpus is not None:
        from moeviz.cli.report import _corpus_batches
        from moeviz.corpus import read_corpus

        return _corpus_batches(loaded, read_corpus(args.corpus), args)
    from moeviz.samples import eval_batch

    batch = eval_batch(loaded)
    ids, size = batch.token_ids, args.batch_size
    return [ids[i : i + size] for i in range(0, len(ids), size)], batch.domains


def _capture(loaded: Any, inputs: dict[str, Any] | None, batches: list[list[list[int]]]) -> Any:
    """One capture of the prompt, or the batches' captures as one trace (sequences numbered in order)."""
    import moeviz
    from moeviz.cli.capture import capture_quietly

    if inputs is not None:
        return capture_quietly(loaded, **inputs)
    return moeviz.Trace.concat([capture_quietly(loaded, token_ids=batch) for batch in batches])


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
    if result.domain_shift is not None:
        took = result.took_domains()
        lines += [
            "",
            f"{len(took):,} (layer, domain, expert) rows where the expert took the domain (its share of the "
            f"domain's slots rose, {result.level:.0%} bootstrap band over the domain's tokens excludes 0)"
            + (":" if shifts and len(took) else ""),
        ]
        if shifts and len(took):
            lines += text_table(TOOK_COLUMNS, took.head(shifts).to_dict("records"))
        lines += [
            "",
            "specialisation per domain, before → after (ds = max_e share of the domain's tokens sent to e, "
            "top = that expert; took = experts that took the domain):",
            *text_table(SPECIALISATION_COLUMNS, result.specialisation.to_dict("records")),
        ]
    reasons = result.balance.loc[result.balance["degraded"], ["layer", "reasons_tuned"]]
    lines += [f"degraded layer {row.layer}: {row.reasons_tuned}" for row in reasons.itertuples()]
    lines += note_lines([*routing.notes, *tuned.model.notes])
    return "\n".join(lines)


__all__ = ["add_parser", "format_finetune_diff", "run_finetune_diff"]
