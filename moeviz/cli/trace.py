"""`moeviz trace`: stream a corpus through a model, or through every checkpoint of a training run, into a
Parquet routing store. It is the library's `moeviz.store.write_corpus` (one model) and `write_series` (a
checkpoint series), or with --ray `moeviz.store.distributed.write_corpus_ray` / `write_series_ray`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from moeviz.cli.exits import EXIT_INTERRUPTED
from moeviz.cli.flags import (
    CORPUS_HELP,
    add_batching_flags,
    add_model_flags,
    add_placement_flags,
    load_kwargs,
    load_progress,
    placement_kwargs,
    trace_settings,
)
from moeviz.errors import InputError

TRACE_CHUNK_TOKENS = 256  # trace: tokens per sequence (the sample models' training length)


def add_parser(commands: Any) -> None:
    trace = commands.add_parser(
        "trace",
        help="stream a corpus through a model (or a checkpoint series) into a Parquet routing store",
        description="Route a whole corpus in batches into a store folder (resumable with --resume): "
        "moeviz.store.write_corpus for one model, moeviz.store.write_series for a checkpoint series "
        "(with --ray: write_corpus_ray / write_series_ray of moeviz.store.distributed).",
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
    trace.set_defaults(run=run_trace)


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

    settings = trace_settings(args)
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
