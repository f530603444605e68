"""`moeviz trace` and `moeviz report --checkpoints`: the store from the shell (both parsed by the one tree
of moeviz.cli; `report`'s flags are defined there)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from moeviz.cli_flags import (
    CORPUS_HELP,
    EXIT_INTERRUPTED,
    add_batching_flags,
    add_model_flags,
    add_placement_flags,
    load_kwargs,
    load_progress,
    placement_kwargs,
)
from moeviz.errors import InputError

TRACE_CHUNK_TOKENS = 256  # trace: tokens per sequence (the sample models' training length)


def add_trace_parser(commands) -> argparse.ArgumentParser:
    """The `trace` subcommand."""
    trace = commands.add_parser(
        "trace",
        help="stream a corpus through a model (or a checkpoint series) into a Parquet routing store",
        description="Route a whole corpus in batches into a store folder (resumable with --resume).",
    )
    add_model_flags(
        trace,
        model_help="model folder, sample:NAME, a folder of checkpoint folders, or A,B,C (checkpoint folders)",
    )
    trace.add_argument("--corpus", required=True, type=Path, help=CORPUS_HELP)
    add_batching_flags(trace, chunk_tokens=TRACE_CHUNK_TOKENS)
    trace.add_argument("--max-batches", type=int, help="stop after this many batches (a fixed prefix)")
    trace.add_argument("--out", required=True, type=Path, help="store folder (created; shared by many runs)")
    trace.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    trace.add_argument("--label", help="model label in the store (default: from the folder name)")
    trace.add_argument("--checkpoint", default=None, help="checkpoint label for one model (default: final)")
    trace.add_argument("--confidence", action="store_true", help="also store per-token entropy and margin")
    trace.add_argument("--quiet", action="store_true", help="no progress bar")
    add_placement_flags(trace)
    ray = trace.add_argument_group("Ray (pip install 'moeviz[ray]')")
    ray.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="trace on Ray workers: alone, a local Ray with --workers; or a cluster (auto, ray://host:10001)",
    )
    ray.add_argument("--workers", type=int, help="Ray workers, each loading the model once (default 2)")
    ray.add_argument("--cpus-per-worker", type=int, help="CPUs (and torch threads) per worker (default 1)")
    ray.add_argument(
        "--gpus-per-worker",
        type=float,
        help="GPUs per worker (default 0); with GPUs --device-map defaults to auto",
    )
    return trace


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


def _ray_options(args: argparse.Namespace):
    """RayOptions from the flags, or None without --ray (then the Ray-only flags are refused)."""
    flags = {"workers": 2, "cpus_per_worker": 1, "gpus_per_worker": 0.0}
    given = [name for name in flags if getattr(args, name, None) is not None]
    if getattr(args, "ray", None) is None:
        if given:
            raise InputError(f"--{given[0].replace('_', '-')} needs --ray")
        return None
    from moeviz.store.distributed import RayOptions, require_ray

    require_ray()  # a missing package fails before anything is loaded or written
    values = {name: getattr(args, name) for name in given}
    return RayOptions(address=None if args.ray == "local" else args.ray, **{**flags, **values})


def _is_series(spec: str) -> bool:
    path = Path(spec)
    return "," in spec or (path.is_dir() and not (path / "config.json").is_file())


def run_trace(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from moeviz.corpus import check_corpus
    from moeviz.models import load_model
    from moeviz.store.checkpoints import write_series
    from moeviz.store.layout import check_label, list_runs
    from moeviz.store.writer import write_corpus

    settings = _settings(args)
    check_corpus(args.corpus)  # bad input fails before anything is loaded or written
    if args.label:
        check_label(args.label, "model")
    if args.checkpoint:
        check_label(args.checkpoint, "checkpoint")
    ray = _ray_options(args)
    placement = placement_kwargs(args)
    hf_logging.disable_progress_bar()
    series = _is_series(args.model)
    if series and args.checkpoint:
        raise InputError("--checkpoint labels one model; a series takes its labels from the folders")
    # RUN_KEYWORDS, what every writer takes; a single model also takes its checkpoint label
    common = {"model": args.label, "settings": settings, "resume": args.resume, "progress": not args.quiet}
    checkpoint = args.checkpoint or "final"
    try:
        if ray is not None:
            from moeviz.store.distributed import write_corpus_ray, write_series_ray

            if series:
                write_series_ray(
                    args.model, args.corpus, args.out, options=ray, **load_kwargs(args), **placement, **common
                )
            else:
                write_corpus_ray(
                    args.model,
                    args.corpus,
                    args.out,
                    checkpoint=checkpoint,
                    options=ray,
                    **load_kwargs(args),
                    **placement,
                    **common,
                )
        elif series:
            write_series(args.model, args.corpus, args.out, **load_kwargs(args), **placement, **common)
        else:
            progress = None if args.quiet else load_progress()
            loaded = load_model(args.model, **load_kwargs(args), **placement, progress=progress)
            write_corpus(loaded, args.corpus, args.out, checkpoint=checkpoint, **common)
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


def run_checkpoint_report(args: argparse.Namespace) -> int:
    """`moeviz report --checkpoints SERIES --corpus PATH`: trace each checkpoint on the same batch plan and
    print the timeline (flags: the `report` parser in moeviz.cli)."""
    from transformers.utils import logging as hf_logging

    from moeviz.corpus import check_corpus
    from moeviz.store.checkpoints import checkpoint_timeline, render_timeline, resolve_series, write_series

    settings = _settings(args)
    check_corpus(args.corpus)
    name, _ = resolve_series(args.checkpoints)
    hf_logging.disable_progress_bar()
    store = args.store or Path(tempfile.mkdtemp(prefix="moeviz-timeline-"))
    try:
        write_series(args.checkpoints, args.corpus, store, settings=settings, resume=True)
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
