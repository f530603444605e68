"""`moeviz trace`: stream a corpus through a model, or through every checkpoint of a training run, into a
Parquet routing store. It is the library's `moeviz.store.write_corpus` (one model) and `write_series` (a
checkpoint series), or with --ray `moeviz.store.distributed.write_corpus_ray` / `write_series_ray`."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

from moeviz.cli.capture import add_engine_flags, check_engine_flags
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
        model_help="model folder, sample:NAME, a folder of checkpoint folders, or A,B,C (checkpoint "
        "folders); the checkpoints are full models or PEFT adapters of one base (see --base)",
    )
    what = trace.add_mutually_exclusive_group(required=True)
    what.add_argument("--corpus", type=Path, help=CORPUS_HELP)
    what.add_argument(
        "--import",
        dest="import_files",
        nargs="+",
        metavar="FORMAT FILE",
        help="instead of a corpus: routing an engine wrote (FORMAT then its files, as `moeviz import`), "
        "written to the store as one run",
    )
    trace.add_argument("--token-ids", type=Path, metavar="F", help="--import: token ids the files lack")
    add_batching_flags(trace, chunk_tokens=TRACE_CHUNK_TOKENS)
    trace.add_argument("--max-batches", type=int, help="stop after this many batches (a fixed prefix)")
    trace.add_argument("--out", required=True, type=Path, help="store folder (created; shared by many runs)")
    trace.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    trace.add_argument("--label", help="model label in the store (default: from the folder name)")
    trace.add_argument("--checkpoint", default=None, help="checkpoint label for one model (default: final)")
    trace.add_argument(
        "--base",
        metavar="MODEL",
        help="a series of PEFT adapters (checkpoint-N/ folders with adapter_config.json): the base model "
        "each is merged into, a folder or sample:NAME (default: the base their config names, if it is a "
        "folder here); the base alone is traced too, as checkpoint 'base'",
    )
    trace.add_argument("--confidence", action="store_true", help="also store per-token entropy and margin")
    trace.add_argument("--quiet", action="store_true", help="no progress bar")
    add_placement_flags(trace)
    add_engine_flags(trace)
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
    trace.set_defaults(check=functools.partial(_check_trace_flags, trace), run=run_trace)


def _check_trace_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--base for anything but a checkpoint series: a usage error (exit 2)."""
    if args.base is None:
        return
    if args.import_files is not None:
        parser.error("--base does not apply to --import (an import reads routing, it merges no adapter)")
    if not _is_series(args.model):
        parser.error(
            "--base only applies to a series of adapters (--model a folder of checkpoint folders or A,B,C); "
            "to merge one adapter into --model use --adapter"
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
    from moeviz.store.layout import check_label
    from moeviz.store.writer import write_corpus

    check_engine_flags(args)
    if args.adapter is not None and (args.import_files or _is_series(args.model)):
        raise InputError(
            "--adapter merges over one model: not with --import or a series "
            "(a series of adapters takes --base)"
        )
    if args.import_files is not None:
        if args.engine == "vllm":
            raise InputError("--engine vllm runs a corpus through vLLM; --import reads files it wrote")
        return _run_import(args)
    if args.token_ids is not None:
        raise InputError("--token-ids only applies to --import")
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
    if args.engine == "vllm" and (series or ray is not None):
        raise InputError(
            f"--engine vllm traces one model in one vLLM engine, not {'--ray' if ray else 'a series'}"
        )
    if series and args.checkpoint:
        raise InputError("--checkpoint labels one model; a series takes its labels from the folders")
    # RUN_KEYWORDS, what every writer takes; a single model also takes its checkpoint label
    label = args.label or (_adapter_label(args) if args.adapter is not None else None)
    common = {"model": label, "settings": settings, "resume": args.resume, "progress": not args.quiet}
    checkpoint = args.checkpoint or "final"
    try:
        if ray is not None:
            from moeviz.store.distributed import write_corpus_ray, write_series_ray

            if series:
                write_series_ray(
                    args.model,
                    args.corpus,
                    args.out,
                    options=ray,
                    base=args.base,
                    **load_kwargs(args),
                    **placement,
                    **common,
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
        elif args.engine == "vllm":
            _run_vllm(args, checkpoint, common)
        elif series:
            write_series(
                args.model, args.corpus, args.out, base=args.base, **load_kwargs(args), **placement, **common
            )
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
    _print_runs(args.out)
    return 0


def _adapter_label(args: argparse.Namespace) -> str:
    """The store label of a model traced with --adapter and no --label: "<model>+<adapter folder>", so that
    the fine-tune's run sits beside its base's instead of resuming it."""
    from moeviz.store.layout import slug
    from moeviz.store.writer import default_label

    return slug(f"{default_label(args.model)}+{Path(args.adapter).name}")


def _run_vllm(args: argparse.Namespace, checkpoint: str, common: dict[str, Any]) -> None:
    """The corpus through one vLLM engine: each batch captured by the session (`write_corpus`'s `capture`);
    the run's default label is `vllm-<model>`, so it sits beside the transformers run of the same model."""
    from moeviz.engines.vllm import VllmSession
    from moeviz.store.writer import write_corpus

    def say(message: str) -> None:
        if not message.startswith("sequence "):  # the engine's start; per-sequence progress is the bar's
            print(f"moeviz: {message}", file=sys.stderr)

    progress = None if args.quiet else say
    with VllmSession(args.model, dtype=args.dtype, routing=args.vllm_routing, progress=progress) as session:
        write_corpus(
            session, args.corpus, args.out, checkpoint=checkpoint, capture=session.capture_batch, **common
        )


def _run_import(args: argparse.Namespace) -> int:
    """`trace --import FORMAT FILE...`: imported per-token routing as one complete run of the store."""
    from moeviz.engines import FORMATS, import_routing
    from moeviz.engines.layout import routing_layout
    from moeviz.engines.tokens import read_token_ids
    from moeviz.store.layout import check_label
    from moeviz.store.writer import default_label, write_trace
    from moeviz.trace import ExpertLoad

    fmt, *files = args.import_files
    if fmt not in FORMATS:
        raise InputError(f"--import: unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if not files:
        raise InputError(f"--import {fmt}: give the files after the format")
    flags = {"--resume": args.resume, "--ray": args.ray, "--max-batches": args.max_batches}
    misplaced = [flag for flag, value in flags.items() if value]
    if misplaced:
        raise InputError(f"{misplaced[0]} does not apply to --import (an import is written as one batch)")
    label = check_label(args.label or default_label(args.model), "model")
    checkpoint = check_label(args.checkpoint or "final", "checkpoint")
    token_ids = None
    if args.token_ids is not None:
        token_ids = read_token_ids(args.token_ids, routing_layout(args.model).vocab_size)
    routing = import_routing(fmt, files, args.model, token_ids=token_ids)
    if isinstance(routing, ExpertLoad):
        raise InputError(
            f"{fmt} files hold expert counts, not per-token routing: a store keeps tokens; "
            "write the counts with `moeviz import` instead"
        )
    write_trace(routing, args.out, model=label, checkpoint=checkpoint, source=f"import:{fmt}")
    _print_runs(args.out)
    return 0


def _print_runs(store: Path) -> None:
    """One line per run of the store: tokens, rows, complete or not, folder."""
    from moeviz.store.layout import list_runs

    for run in list_runs(store):
        state = "complete" if run.complete else f"{len(run.parts)} batches (incomplete)"
        print(f"{run.model}/{run.checkpoint}: {run.tokens} tokens, {run.rows} rows, {state} -> {run.path}")
