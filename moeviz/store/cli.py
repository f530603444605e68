"""`moeviz trace` and `moeviz report --checkpoints`: the store from the shell (wired in moeviz.cli)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from moeviz.errors import InputError

EXIT_INTERRUPTED = 130


def _add_plan_args(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--corpus", required=True, type=Path, help="folder (one sub-folder per domain) or JSONL"
    )
    command.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default 8)")
    command.add_argument("--chunk-tokens", type=int, default=256, help="tokens per sequence (default 256)")
    command.add_argument("--max-batches", type=int, help="stop after this many batches (a fixed prefix)")
    command.add_argument("--trust-remote-code", action="store_true", help="run modelling code in the folder")


def add_trace_parser(commands) -> argparse.ArgumentParser:
    """The `trace` subcommand."""
    trace = commands.add_parser(
        "trace",
        help="stream a corpus through a model (or a checkpoint series) into a Parquet routing store",
        description="Route a whole corpus in batches into a store folder (resumable with --resume).",
    )
    trace.add_argument(
        "--model",
        required=True,
        help="model folder, sample:NAME, a folder of checkpoint folders, or A,B,C (checkpoint folders)",
    )
    _add_plan_args(trace)
    trace.add_argument("--out", required=True, type=Path, help="store folder (created; shared by many runs)")
    trace.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    trace.add_argument("--label", help="model label in the store (default: from the folder name)")
    trace.add_argument("--checkpoint", default=None, help="checkpoint label for one model (default: final)")
    trace.add_argument("--confidence", action="store_true", help="also store per-token entropy and margin")
    trace.add_argument("--quiet", action="store_true", help="no progress bar")
    return trace


def checkpoint_report_parser() -> argparse.ArgumentParser:
    """`moeviz report --checkpoints ...` (dispatched before the ordinary report parser)."""
    rep = argparse.ArgumentParser(prog="moeviz report", description="Checkpoint timeline of a training run.")
    rep.add_argument("--checkpoints", required=True, help="a folder of checkpoint folders, or A,B,C")
    _add_plan_args(rep)
    rep.add_argument("--store", type=Path, help="keep the traces in this store (reused with resume)")
    rep.add_argument("--format", choices=["text", "json"], default="text")
    return rep


def _settings(args: argparse.Namespace):
    from moeviz.store.writer import TraceSettings

    for name in ("batch_size", "chunk_tokens", "max_batches"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return TraceSettings(
        batch_size=args.batch_size,
        chunk_tokens=args.chunk_tokens,
        max_batches=args.max_batches,
        confidence=getattr(args, "confidence", False),
    )


def _is_series(spec: str) -> bool:
    path = Path(spec)
    return "," in spec or (path.is_dir() and not (path / "config.json").is_file())


def run_trace(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    import moeviz
    from moeviz.store.checkpoints import trace_series
    from moeviz.store.layout import check_label, list_runs
    from moeviz.store.plan import check_corpus
    from moeviz.store.writer import trace_corpus

    settings = _settings(args)
    check_corpus(args.corpus)  # bad input fails before anything is loaded or written
    if args.label:
        check_label(args.label, "model")
    if args.checkpoint:
        check_label(args.checkpoint, "checkpoint")
    hf_logging.disable_progress_bar()
    progress = not args.quiet
    try:
        if _is_series(args.model):
            if args.checkpoint:
                raise InputError("--checkpoint labels one model; a series takes its labels from the folders")
            trace_series(
                args.model,
                args.corpus,
                args.out,
                model=args.label,
                settings=settings,
                resume=args.resume,
                progress=progress,
            )
        else:
            loaded = moeviz.load_model(args.model, trust_remote_code=args.trust_remote_code)
            trace_corpus(
                loaded,
                args.corpus,
                args.out,
                model=args.label,
                checkpoint=args.checkpoint or "final",
                settings=settings,
                resume=args.resume,
                progress=progress,
            )
    except KeyboardInterrupt:
        print(
            "moeviz: interrupted; every completed batch is saved. "
            "Continue with the same command plus --resume.",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    for run in list_runs(args.out):
        state = "complete" if run.complete else f"{len(run.parts)} batches (incomplete)"
        print(f"{run.model}/{run.checkpoint}: {run.tokens} tokens, {run.rows} rows, {state} -> {run.path}")
    return 0


def run_checkpoint_report(argv: list[str]) -> int:
    from transformers.utils import logging as hf_logging

    from moeviz.store.checkpoints import checkpoint_timeline, render_timeline, resolve_series, trace_series
    from moeviz.store.plan import check_corpus

    args = checkpoint_report_parser().parse_args(argv)
    settings = _settings(args)
    check_corpus(args.corpus)
    name, _ = resolve_series(args.checkpoints)
    hf_logging.disable_progress_bar()
    store = args.store or Path(tempfile.mkdtemp(prefix="moeviz-timeline-"))
    try:
        trace_series(args.checkpoints, args.corpus, store, settings=settings, resume=True)
        timeline = checkpoint_timeline(store, model=name)
    finally:
        if args.store is None:
            shutil.rmtree(store, ignore_errors=True)
    if args.format == "json":
        frames = ("saturation", "collapse", "drift", "specialisation", "crossings")
        payload = {
            "model": timeline.model,
            "checkpoints": timeline.checkpoints,
            **{f: json.loads(getattr(timeline, f).to_json(orient="records")) for f in frames},
        }
        print(json.dumps(payload, indent=1))
    else:
        print(render_timeline(timeline))
    return 0
