"""`moeviz import FORMAT FILE... --model M --out F.parquet`: read routing another engine wrote (SGLang, vLLM,
Megatron, public traces; `moeviz.engines`) and write it as a moeviz routing file — a trace for per-token
routing, a load table for expert counts — that `report`, `whatif`, `diff` and the app read."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moeviz.cli.capture import SUMMARY_COLUMNS, _checked_output, format_summary
from moeviz.cli.flags import MODEL_HELP
from moeviz.cli.output import Column, note_lines, text_table
from moeviz.cli.progress import progress_bar

LOAD_SUMMARY_COLUMNS = [
    Column("layer", width=5),
    Column("steps", width=5),
    Column("slots", width=9),
    Column("experts", width=7),
    Column("load_entropy", "{:.3f}", width=12),
    Column("max_share", "{:.3f}", width=9),
    Column("dead_experts", header="dead", width=4),
]


def add_parser(commands: Any) -> None:
    from moeviz.engines import FORMATS  # the registry only: no format module loads with the parser

    formats = "; ".join(f"{name}: {what}" for name, (_, what) in FORMATS.items())
    imp = commands.add_parser(
        "import",
        help="read routing an engine wrote (SGLang, vLLM, Megatron, public traces) into a moeviz file",
        description="Read routing files exactly as their engine writes them, check them against the "
        "model's config (no weights needed) and write a moeviz routing file. Formats: " + formats,
    )
    imp.add_argument("format", choices=list(FORMATS), metavar="FORMAT", help=", ".join(FORMATS))
    imp.add_argument("files", nargs="+", type=Path, metavar="FILE", help="the engine's files")
    imp.add_argument("--model", required=True, help=MODEL_HELP + " (its config.json is enough)")
    tokens = imp.add_mutually_exclusive_group()
    tokens.add_argument(
        "--token-ids",
        type=Path,
        metavar="F",
        help="token ids the file lacks: JSON [ids] or [[ids], …], or Parquet (token_ids list / token_id)",
    )
    tokens.add_argument(
        "--text",
        action="append",
        metavar="T",
        help="a sequence's text, tokenised with the model's tokenizer (repeat for several sequences)",
    )
    imp.add_argument("--out", required=True, type=Path, help="output .parquet file")
    imp.set_defaults(run=run_import)


def run_import(args: argparse.Namespace) -> int:
    from moeviz.engines import import_routing
    from moeviz.engines.layout import routing_layout
    from moeviz.engines.tokens import read_token_ids
    from moeviz.trace import ExpertLoad

    out = _checked_output(args.out)
    with progress_bar(total=2, desc="moeviz import", unit="step") as bar:
        bar.set_postfix_str(f"reading {args.format}")
        token_ids = None
        if args.token_ids is not None:
            token_ids = read_token_ids(args.token_ids, routing_layout(args.model).vocab_size)
        routing = import_routing(args.format, args.files, args.model, token_ids=token_ids, texts=args.text)
        bar.update()
        bar.set_postfix_str("writing parquet")
        routing.to_parquet(out)
        bar.update()
    if isinstance(routing, ExpertLoad):
        print(format_load_summary(routing, out))
    else:
        from moeviz.analysis import balance_frame

        print(format_summary(routing, balance_frame(routing), out))
    return 0


def format_load_summary(load: Any, out: Path) -> str:
    """One screen for an imported load table: the model and source, then per MoE layer its steps, slots,
    experts, normalised load entropy, max share and dead experts."""
    from moeviz.analysis.balance import balance_from_counts

    counts = load.layer_counts()
    rows = []
    for layer, layer_counts in zip(load.layers, counts, strict=True):
        stats = balance_from_counts(layer_counts, int(layer_counts.sum()) // load.top_k, load.top_k)
        rows.append(
            {
                "layer": layer,
                "steps": load.counts.shape[0],
                "slots": int(layer_counts.sum()),
                "experts": load.num_experts,
                "load_entropy": stats.load_entropy,
                "max_share": stats.max_share,
                "dead_experts": stats.dead_experts,
            }
        )
    head = (
        f"{load.model.source} ({load.model.architecture}): expert counts from {load.source}, "
        f"{len(load.layers)} MoE layers, {load.counts.shape[0]} steps -> {out}"
    )
    table = text_table(LOAD_SUMMARY_COLUMNS, rows)
    return "\n".join([head, *table, *note_lines(load.model.notes)])


__all__ = ["SUMMARY_COLUMNS", "add_parser", "format_load_summary", "run_import"]
