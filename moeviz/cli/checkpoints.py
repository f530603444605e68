"""`moeviz checkpoints SERIES --corpus PATH`: trace every checkpoint of a training run on the same batch plan
(`moeviz.store.write_series`) and print its timeline (`moeviz.store.checkpoints.checkpoint_timeline`) as
text or JSON. `moeviz report --checkpoints SERIES` is the same command (moeviz.cli.report)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

from moeviz.cli.flags import CORPUS_HELP, REPORT_CHUNK_TOKENS, add_batching_flags, trace_settings
from moeviz.cli.output import json_text

SERIES_HELP = (
    "a training run: a folder of checkpoint folders, or A,B,C (checkpoint folders in training order); "
    "the checkpoints are full models or PEFT adapters of one base (see --base)"
)
TIMELINE_FRAMES = ("saturation", "collapse", "drift", "specialisation", "crossings")


def add_parser(commands: Any) -> None:
    command = commands.add_parser(
        "checkpoints",
        help="a training run's checkpoint timeline: every checkpoint traced on one corpus",
        description="Trace every checkpoint of a training run on the same batches of --corpus and print "
        "the timeline: router saturation vs the final checkpoint, collapse indicators, expert drift, domain "
        "specialisation and the first checkpoint past each collapse threshold. "
        "`moeviz report --checkpoints SERIES` is the same command.",
    )
    command.add_argument("checkpoints", metavar="SERIES", help=SERIES_HELP)
    command.add_argument("--corpus", required=True, type=Path, help=CORPUS_HELP)
    command.add_argument("--format", choices=["text", "json"], default="text")
    add_batching_flags(command, chunk_tokens=REPORT_CHUNK_TOKENS)
    add_timeline_flags(command)
    command.set_defaults(run=run_checkpoints)


def add_timeline_flags(command: Any) -> None:
    """The flags only a checkpoint timeline takes (here and in `report --checkpoints`)."""
    command.add_argument("--max-batches", type=int, help="trace only this many batches (a fixed prefix)")
    command.add_argument("--store", type=Path, help="keep the traces in this store (reused with resume)")
    command.add_argument(
        "--base",
        metavar="MODEL",
        help="a series of PEFT adapters (checkpoint-N/ folders with adapter_config.json): the base model "
        "they were trained on, a folder or sample:NAME (default: the base their config names, if it is a "
        "folder here); the base alone is the timeline's first checkpoint, 'base'",
    )


def run_checkpoints(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from moeviz.corpus import check_corpus
    from moeviz.store.checkpoints import checkpoint_timeline, render_timeline, resolve_series, write_series

    settings = trace_settings(args)
    check_corpus(args.corpus)
    base = getattr(args, "base", None)
    name, _ = resolve_series(args.checkpoints, base)
    hf_logging.disable_progress_bar()
    store = args.store or Path(tempfile.mkdtemp(prefix="moeviz-timeline-"))
    try:
        write_series(args.checkpoints, args.corpus, store, settings=settings, resume=True, base=base)
        timeline = checkpoint_timeline(store, model=name)
    finally:
        if args.store is None:
            shutil.rmtree(store, ignore_errors=True)
    if args.format == "json":
        frames = {frame: getattr(timeline, frame).to_dict("records") for frame in TIMELINE_FRAMES}
        print(json_text({"model": timeline.model, "checkpoints": timeline.checkpoints, **frames}))
    else:
        print(render_timeline(timeline))
    return 0
