"""`moeviz diff A B [--model M] [--replay] [--format text|json]`: where two routings of the same tokens choose
different experts (`moeviz.analysis.engine_diff`), and with --replay how much of the next-token log-prob gap
the routing explains (`moeviz.interventions.replay`).

A and B are moeviz routing files (`moeviz capture --out`, `moeviz import --out`). A is the side replayed
(the inference engine's rollout, say), B the reference (the training side): the model for --replay is
loaded at --dtype, or, with --dtype auto, at B's dtype when B is a moeviz capture. The replay compares with
A's own log-probs when A is a moeviz capture (the model is run at A's dtype: mode "gap"), else it reports
the shift forcing A's routing causes (mode "shift").
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

from moeviz.cli.exits import EXIT_VERDICT
from moeviz.cli.flags import DTYPES, MODEL_HELP, add_model_flags, load_kwargs, load_progress
from moeviz.cli.output import Column, json_text, note_lines, text_table
from moeviz.errors import InputError

LAYER_COLUMNS = [
    Column("layer"),
    Column("site", align="<"),
    Column("pairs", "{:,}"),
    Column("mismatched", "{:,}"),
    Column("router_mismatch", "{:.4f}"),
    Column("top1_mismatch", "{:.4f}"),
    Column("jaccard", "{:.4f}"),
    Column("kl", "{:.3g}"),
    Column("tv", "{:.3g}"),
]
QUARTILE_COLUMNS = [
    Column("quartile"),
    Column("margin_low", "{:.4g}"),
    Column("margin_high", "{:.4g}"),
    Column("pairs", "{:,}"),
    Column("mismatched", "{:,}"),
    Column("router_mismatch", "{:.4f}"),
]
DIFFERING_COLUMNS = [
    Column("seq"),
    Column("pos"),
    Column("token", align="<"),
    Column("layer"),
    Column("experts_a", align="<"),
    Column("experts_b", align="<"),
    Column("margin", "{:.4g}"),
]
REPLAY_COLUMNS = [
    Column("gap", align="<"),
    Column("mean_delta", "{:+.4g}"),
    Column("k3_kl", "{:.4g}"),
    Column("extreme_fraction", "{:.4f}"),
    Column("tokens", "{:,}"),
]


def add_parser(commands: Any) -> None:
    diff = commands.add_parser(
        "diff",
        help="compare two routings of the same tokens (captures or imports); --replay one in the model",
        description="Align two routing files of the same token ids by sequence and position and report where "
        "they choose different expert sets: per layer and overall, by router-margin quartile, per token. Two "
        "runs of one engine must give exactly 0 (else: non-determinism). With --replay, run --model with A's "
        "expert sets forced (its own scores renormalised over them, R3) and report the next-token log-prob "
        "gap: mean Δ, k3 KL and the fraction of tokens with |Δ| > ln 2.",
    )
    diff.add_argument("a", type=Path, metavar="A", help="routing file of the side to replay (e.g. a rollout)")
    diff.add_argument("b", type=Path, metavar="B", help="routing file of the reference side (e.g. training)")
    model = diff.add_mutually_exclusive_group()
    add_model_flags(diff, group=model, model_help=MODEL_HELP + " (for --replay)")
    diff.add_argument(
        "--replay", action="store_true", help="replay A's expert sets in --model (needs --model)"
    )
    diff.add_argument("--format", choices=["text", "json"], default="text")
    diff.add_argument(
        "--differing",
        type=int,
        default=10,
        metavar="N",
        help="text: list the first N differing (token, layer)",
    )
    diff.add_argument(
        "--fail-on-mismatch",
        action="store_true",
        help=f"exit with code {EXIT_VERDICT} when the two routings are not identical",
    )
    diff.set_defaults(check=functools.partial(_check_flags, diff), run=run_diff)


def _check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.replay and args.model is None:
        raise InputError("--replay runs the model: give it with --model")
    if args.model is not None and not args.replay:
        raise InputError("--model is used only by --replay")
    if args.differing < 0:
        raise InputError(f"--differing must be 0 or more, got {args.differing}")


def read_trace(path: Path):
    """A moeviz routing file of per-token routing; InputError for a missing file or an expert-count table."""
    from moeviz.trace import ExpertLoad, read_routing_file

    if not path.exists():
        raise InputError(f"{path} does not exist")
    routing = read_routing_file(path)
    if isinstance(routing, ExpertLoad):
        raise InputError(
            f"{path} holds expert counts ({routing.source}), not per-token routing: diff needs which experts "
            "each token chose"
        )
    return routing


def run_diff(args: argparse.Namespace) -> int:
    from moeviz.analysis.engine_diff import engine_diff

    a, b = read_trace(args.a), read_trace(args.b)
    result = engine_diff(a, b)
    replayed = _replay(args, a, b) if args.replay else None
    payload = result.to_json(replayed.to_json() if replayed is not None else None)
    if args.format == "json":
        print(json_text(payload))
    else:
        print(format_diff(result, replayed, args))
    return EXIT_VERDICT if args.fail_on_mismatch and not result.identical else 0


def _replay(args: argparse.Namespace, a, b):
    import moeviz
    from moeviz.analysis.engine_diff import is_capture
    from moeviz.interventions.replay import replay

    kwargs = load_kwargs(args)
    if kwargs["dtype"] == "auto" and is_capture(b) and b.model.dtype in DTYPES:
        kwargs["dtype"] = b.model.dtype  # run the reference side as it ran
    loaded = moeviz.load_model(args.model, **kwargs, progress=load_progress())
    infer_model = None
    if is_capture(a) and a.model.dtype in DTYPES:
        if a.model.dtype == loaded.info.dtype:
            infer_model = loaded
        else:
            infer_kwargs = {**kwargs, "dtype": a.model.dtype}
            infer_model = moeviz.load_model(args.model, **infer_kwargs, progress=load_progress())
    return replay(loaded, a, infer_model=infer_model, ids_from=b)


def format_diff(result, replayed, args: argparse.Namespace) -> str:
    """The text screen: sources, the verdict line, overall figures, per-layer table, margin quartiles, the
    first differing (token, layer) and the replay."""
    lines = [f"A: {args.a} ({result.sources[0]})", f"B: {args.b} ({result.sources[1]})"]
    if result.identical:
        lines.append(
            f"identical: every expert set agrees ({result.pairs:,} (token, layer) pairs, "
            f"{result.tokens:,} tokens)"
        )
    else:
        lines.append(
            f"{result.mismatched:,} of {result.pairs:,} (token, layer) pairs choose different experts "
            f"(router mismatch {result.router_mismatch:.4f}); {result.tokens_any_layer:.1%} of "
            f"{result.tokens:,} tokens differ in at least one layer; "
            f"{result.routers_per_token_mean:.3f} routers differ per token on average"
        )
    if result.nondeterministic:
        lines.append(
            "non-determinism: both sides name the same source (engine, model, dtype, device) but do not "
            "route identically (or one capture is faulty)"
        )
    lines.append(
        f"top-1 mismatch {_fmt(result.top1_mismatch)}, mean jaccard {_fmt(result.jaccard)}; "
        f"aligned by {result.aligned_by.replace('_', ' ')}"
    )
    lines += ["", *text_table(LAYER_COLUMNS, result.layers.to_dict("records"))]
    quartiles = result.margin_quartile_frame()
    if len(quartiles):
        lines += ["", f"by router-margin quartile (margins of side {result.margin_side.upper()}):"]
        lines += text_table(QUARTILE_COLUMNS, quartiles.to_dict("records"))
    if args.differing and result.mismatched:
        shown = result.differing_frame(limit=args.differing)
        lines += ["", f"first {len(shown)} of {result.mismatched:,} differing (token, layer):"]
        lines += text_table(DIFFERING_COLUMNS, shown.to_dict("records"))
    if replayed is not None:
        lines += ["", f"replay of A's routing ({replayed.mode}: π_infer = {replayed.reference}):"]
        rows = [{"gap": "after replay" if replayed.mode == "gap" else "shift", **replayed.after}]
        if replayed.before is not None:
            rows.insert(0, {"gap": "before replay", **replayed.before})
        lines += text_table(REPLAY_COLUMNS, rows)
        lines.append(
            f"{replayed.pairs_replayed:,} of {replayed.pairs:,} (token, layer) pairs forced to A's set "
            "(where the replayed forward's own set differed from it)"
        )
        lines += note_lines(replayed.notes)
    lines += note_lines(result.notes)
    return "\n".join(lines)


def _fmt(value: float) -> str:
    return "–" if value != value else f"{value:.4f}"


__all__ = ["add_parser", "format_diff", "run_diff"]
