"""`moeviz report`: judge one model's routing layer by layer (`moeviz.report.build_report`) and print it as
text, JSON or Markdown. The routing is captured here (`--model M` on a prompt or a corpus) or read from a
file (`--trace F.parquet`: a trace written by `moeviz capture` or `moeviz import`, or a load table `moeviz
import` wrote from an engine's expert counts; no model needed). `report --checkpoints SERIES` is an alias of
`moeviz checkpoints SERIES` (moeviz.cli.checkpoints): the same flags, run and output."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

from moeviz.cli import checkpoints
from moeviz.cli.exits import EXIT_VERDICT
from moeviz.cli.flags import (
    BATCH_SIZE,
    REPORT_CHUNK_TOKENS,
    add_batching_flags,
    add_input_group,
    add_model_flags,
    add_placement_flags,
    load_kwargs,
    load_progress,
    placement_kwargs,
    prompt_inputs,
)
from moeviz.cli.output import Column, json_text, markdown_table, note_lines, text_table
from moeviz.cli.progress import progress_bar
from moeviz.errors import InputError

REPORT_MAX_CHUNKS = 64  # report --corpus: sequences per domain
# the per-layer table of the text and Markdown screens (JSON has every key of moeviz.report.LAYER_KEYS)
REPORT_COLUMNS = [
    Column("layer"),
    Column("site"),
    Column("verdict"),
    Column("aux_loss_topk", "{:.3f}"),
    Column("z_loss", "{:.1f}"),
    Column("load_entropy", "{:.3f}"),
    Column("max_share", "{:.3f}"),
    Column("dead_fraction", "{:.2f}"),
    Column("dropped_fraction", "{:.3f}"),
    Column("max_vio", "{:.2f}"),
    Column("cv", "{:.2f}"),
]


def add_parser(commands: Any) -> None:
    rep = commands.add_parser(
        "report",
        help="judge a model's routing health layer by layer, or a training run's checkpoint timeline",
        description="Run one --model on an input and judge its routing, layer by layer; or judge the "
        "routing of a file (--trace: a trace from `moeviz capture` or `moeviz import`, or a load table of "
        "an engine's expert counts from `moeviz import`; no model is loaded); or, with --checkpoints (an "
        "alias of `moeviz checkpoints`), trace every checkpoint of a training run on --corpus and print "
        "its timeline.",
    )
    # Not required by argparse: `_check_report_flags` asks for one, naming --trace after the two it always
    # named, so the message scripts match stays.
    subject = rep.add_mutually_exclusive_group()
    subject.add_argument(
        "--checkpoints",
        metavar="DIR|A,B,C",
        help="a training run instead of one model: a folder of checkpoint folders, or A,B,C (needs --corpus; "
        "the same as `moeviz checkpoints`)",
    )
    add_model_flags(rep, group=subject)
    subject.add_argument(
        "--trace",
        type=Path,
        metavar="F.parquet",
        help="judge the routing in this file instead of running a model: a trace written by `moeviz "
        "capture` or `moeviz import`, or a load table `moeviz import` wrote from expert counts",
    )
    add_input_group(rep, corpus=True, required=False)
    rep.add_argument("--format", choices=["text", "json", "markdown"], default="text")
    add_batching_flags(rep, chunk_tokens=REPORT_CHUNK_TOKENS)
    one = rep.add_argument_group("one model (--model) or one routing file (--trace)")
    one.add_argument(
        "--fail-on",
        choices=["warning", "collapsed"],
        help=f"exit with code {EXIT_VERDICT} when the model verdict reaches this level",
    )
    one.add_argument("--devices", type=int, help="also report expert-parallel balancedness over D devices")
    one.add_argument(
        "--max-chunks",
        type=int,
        help=f"corpus: at most this many sequences per domain (default {REPORT_MAX_CHUNKS})",
    )
    add_placement_flags(one)
    checkpoints.add_timeline_flags(rep.add_argument_group("checkpoint timeline (--checkpoints)"))
    rep.set_defaults(check=functools.partial(_check_report_flags, rep), run=run_report)


INPUT_FLAGS = ("--text", "--text-file", "--token-ids", "--corpus")


def _check_report_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags of one branch of `report` given to another: a usage error (exit 2)."""
    if args.checkpoints is None and args.model is None and args.trace is None:
        parser.error("one of the arguments --checkpoints --model is required (or --trace F.parquet)")
    inputs = {
        "--text": args.text,
        "--text-file": args.text_file,
        "--token-ids": args.token_ids,
        "--corpus": args.corpus,
    }
    if args.trace is not None:
        misplaced = {
            **inputs,
            "--max-chunks": args.max_chunks,
            "--max-batches": args.max_batches,
            "--store": args.store,
            "--base": args.base,
            **_loading_flags(args),
            "--batch-size": None if args.batch_size == BATCH_SIZE else args.batch_size,
            "--chunk-tokens": None if args.chunk_tokens == REPORT_CHUNK_TOKENS else args.chunk_tokens,
        }
        given = [flag for flag, value in misplaced.items() if value is not None]
        if given:
            parser.error(
                f"{given[0]} does not apply to --trace: the routing is read from the file, no model is run"
            )
        return
    if all(value is None for value in inputs.values()):
        parser.error(f"one of the arguments {' '.join(INPUT_FLAGS)} is required")
    if args.checkpoints is not None:
        if args.corpus is None:
            parser.error("--checkpoints needs --corpus (the texts every checkpoint is traced on)")
        misplaced = {
            "--fail-on": args.fail_on,
            "--devices": args.devices,
            "--max-chunks": args.max_chunks,
            **_loading_flags(args),
        }
        if args.format == "markdown":
            parser.error("--format markdown is for one model; a checkpoint timeline prints text or json")
    else:
        misplaced = {"--max-batches": args.max_batches, "--store": args.store, "--base": args.base}
    given = [flag for flag, value in misplaced.items() if value is not None]
    if given:
        branch = "one --model" if args.checkpoints is not None else "--checkpoints"
        parser.error(f"{given[0]} only applies to {branch}")


def _loading_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The model-loading flags, each None unless the user gave it (for the branches that load no model)."""
    return {
        "--trust-remote-code": args.trust_remote_code or None,
        "--dtype": None if args.dtype == "auto" else args.dtype,
        "--device": None if args.device == "auto" else args.device,
        "--device-map": args.device_map,
        "--offload-folder": args.offload_folder,
        "--max-memory": args.max_memory,
        "--adapter": args.adapter,
    }


def run_report(args: argparse.Namespace) -> int:
    if args.checkpoints is not None:
        return checkpoints.run_checkpoints(args)
    if args.trace is not None:
        return run_file_report(args)
    from transformers.utils import logging as hf_logging

    import moeviz
    from moeviz.cli.capture import capture_quietly, warn_routing
    from moeviz.report import build_report

    for name in ("chunk_tokens", "max_chunks", "batch_size", "devices"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    inputs = {} if args.corpus is not None else prompt_inputs(args)
    corpus = None
    if args.corpus is not None:
        from moeviz.corpus import read_corpus

        corpus = read_corpus(args.corpus)  # fail on a bad corpus before loading the model
    placement = placement_kwargs(args)
    hf_logging.disable_progress_bar()
    loaded = moeviz.load_model(args.model, **load_kwargs(args), **placement, progress=load_progress())
    seq_domains = None
    if corpus is None:
        trace = capture_quietly(loaded, **inputs)
    else:
        batches, seq_domains = _corpus_batches(loaded, corpus, args)
        traces = []
        with progress_bar(total=sum(len(b) for b in batches), desc="routing corpus", unit="seq") as bar:
            for batch in batches:
                traces.append(capture_quietly(loaded, token_ids=batch))
                bar.update(len(batch))
        trace = moeviz.Trace.concat(traces)
    try:
        report = build_report(trace, seq_domains, devices=args.devices)
    except ValueError as exc:  # e.g. experts that do not split evenly over --devices
        raise InputError(str(exc)) from exc
    print(SCREENS[args.format](report))
    warn_routing(trace)
    return EXIT_VERDICT if args.fail_on and report.collapse.fails(args.fail_on) else 0


def run_file_report(args: argparse.Namespace) -> int:
    """`report --trace F.parquet`: the report of a routing file (a Trace or an ExpertLoad), no model loaded.
    The warning on non-finite router scores covers the layers that have logits (an import has none)."""
    from moeviz.report import build_report
    from moeviz.trace import Trace, read_routing_file

    if args.devices is not None and args.devices < 1:
        raise InputError(f"--devices must be >= 1, got {args.devices}")
    if not args.trace.is_file():
        raise InputError(
            f"--trace {args.trace} is not a file (a .parquet written by `moeviz capture` or `moeviz import`)"
        )
    routing = read_routing_file(args.trace)
    try:
        report = build_report(routing, devices=args.devices)
    except ValueError as exc:  # e.g. experts that do not split evenly over --devices
        raise InputError(str(exc)) from exc
    print(SCREENS[args.format](report))
    if isinstance(routing, Trace):
        from moeviz.capture import routing_warning

        message = routing_warning([r for r in routing.layers if r.has_logits])
        if message is not None:
            print(f"moeviz: warning: {message}", file=sys.stderr)
    return EXIT_VERDICT if args.fail_on and report.collapse.fails(args.fail_on) else 0


def _corpus_batches(loaded, corpus, args) -> tuple[list[list[list[int]]], list[str]]:
    """Token windows of each document (≤ --max-chunks per domain), grouped into batches of --batch-size."""
    from moeviz.corpus import chunk_token_ids

    if loaded.tokenizer is None:
        raise InputError("--corpus needs a model with a tokenizer")
    length = min(args.chunk_tokens, loaded.max_length or args.chunk_tokens)
    max_chunks = args.max_chunks or REPORT_MAX_CHUNKS
    sequences, domains = [], []
    per_domain: dict[str, int] = {}  # chunks taken so far from each domain
    for doc in corpus:
        room = max_chunks - per_domain.get(doc.domain, 0)
        if room <= 0:
            continue
        chunks = chunk_token_ids(loaded.tokenizer(doc.text)["input_ids"], length, room)
        per_domain[doc.domain] = per_domain.get(doc.domain, 0) + len(chunks)
        sequences += chunks
        domains += [doc.domain] * len(chunks)
    batches = [sequences[i : i + args.batch_size] for i in range(0, len(sequences), args.batch_size)]
    return batches, domains


def report_json(report: Any) -> str:
    """{"model", "tokens", "verdict", "reasons", "notes", ["ep_balancedness_over_layers",] "layers": [...]}:
    "notes" name the numbers the routing cannot give (null in "layers": no router scores, no tokens)."""
    out = {
        "model": report.model,
        "tokens": report.tokens,
        "verdict": report.verdict,
        "reasons": report.collapse.reasons,
        "notes": list(report.notes),
    }
    if report.ep_balancedness_over_layers is not None:
        out["ep_balancedness_over_layers"] = report.ep_balancedness_over_layers
    return json_text({**out, "layers": report.layers.to_dict("records")})


def report_text(report: Any) -> str:
    """One screen: the model and its verdict, the per-layer table, then the reasons and notes."""
    from moeviz.analysis.collapse import NOT_ENOUGH_TOKENS

    rows = report.layers.to_dict("records")
    head = f"{report.model}: {report.tokens} tokens — verdict: {report.verdict.upper()}"
    if report.collapse.layers and not report.collapse.judged:
        head += f" (load {NOT_ENOUGH_TOKENS})"
    out = [head, *text_table(REPORT_COLUMNS, rows, gap=2)]
    if report.ep_balancedness_over_layers is not None:
        value = report.ep_balancedness_over_layers
        out.append(f"  expert-parallel balancedness over layers (Σ mean / Σ max, as vLLM): {value:.3f}")
    out += [f"  {reason}" for reason in report.collapse.reasons]
    out += note_lines(report.collapse.notes, indent="  ")
    out += note_lines(report.notes, indent="  ")
    for row in rows:
        if row.get("specialised_domains"):
            out.append(f"  layer {row['layer']} specialised: " + ", ".join(row["specialised_domains"]))
    return "\n".join(out)


def report_markdown(report: Any) -> str:
    from moeviz.analysis.collapse import NOT_ENOUGH_TOKENS

    judged = report.collapse.judged or not report.collapse.layers
    out = [
        f"## Routing report: `{report.model}`",
        "",
        f"{report.tokens} tokens. Verdict: **{report.verdict}**"
        + ("." if judged else f" (load {NOT_ENOUGH_TOKENS})."),
        "",
        *markdown_table(REPORT_COLUMNS, report.layers.to_dict("records")),
    ]
    if report.collapse.reasons:
        out += ["", *[f"- {reason}" for reason in report.collapse.reasons]]
    if report.notes:
        out += ["", *[f"- note: {note}" for note in report.notes]]
    return "\n".join(out)


SCREENS = {"text": report_text, "json": report_json, "markdown": report_markdown}
