"""The `moeviz` command: capture routing from the shell, judge it, trace corpora, and start the app.

One argparse tree: `capture`, `report` (one model, or with --checkpoints a training run's timeline),
`trace` (moeviz.store.cli),
`whatif` (moeviz.whatif.cli) and `app`. Exit codes: 0 success, 2 bad flags or bad input (nothing written),
3 `report --fail-on` verdict reached, 1 unexpected failure.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from moeviz.cli_flags import (
    CORPUS_HELP,
    EXIT_INTERRUPTED,
    add_batching_flags,
    add_model_flags,
    add_placement_flags,
    add_prompt_inputs,
    load_kwargs,
    load_progress,
    placement_kwargs,
    prompt_inputs,
)
from moeviz.errors import InputError, MoevizError

EXIT_BAD_INPUT = 2
EXIT_VERDICT = 3  # `report --fail-on`: the routing verdict reached the given level
# a full disk, a quota, an unwritable or read-only output: exit 2 with one line, not a traceback
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR}
REPORT_CHUNK_TOKENS = 512  # report --corpus and report --checkpoints: tokens per sequence
REPORT_MAX_CHUNKS = 64  # report --corpus: sequences per domain
# Streamlit runs a full gc.collect(2) after every script run; with torch and transformers loaded that adds
# 0.2-0.4 s to every click (Python's generational collector still runs on its own). Uploads are prompt
# files: 1 MB is far beyond any context (the app checks the size again).
# server.maxUploadSize is in MB: the server takes 2**20 bytes per unit, the browser 10**6 (2**20 on Windows)
# and refuses a larger file itself, without a word. 2 lets through any file the prompt form may refuse with
# its own message (over 1 MiB, `PROMPT_FILE_LIMIT` in app/components/prompt.py).
APP_FLAGS = ("--runner.postScriptGC", "false", "--server.maxUploadSize", "2")


def _add_inputs(command: argparse.ArgumentParser, corpus: bool = False) -> None:
    """The mutually exclusive inputs shared by capture and report (report also takes --corpus)."""
    source = command.add_mutually_exclusive_group(required=True)
    add_prompt_inputs(source)
    if corpus:
        source.add_argument("--corpus", type=Path, help=CORPUS_HELP)


def package_version() -> str:
    """The installed distribution's version; the package's own when it is not installed (a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moeviz")
    except PackageNotFoundError:
        from moeviz import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeviz", description="A microscope for Mixture-of-Experts models.")
    parser.add_argument("--version", action="version", version=f"moeviz {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cap = commands.add_parser("capture", help="run a model on an input and write its routing table (Parquet)")
    add_model_flags(cap)
    add_placement_flags(cap)
    _add_inputs(cap)
    cap.add_argument("--out", required=True, type=Path, help="output .parquet file")
    cap.add_argument("--generate", type=int, default=0, metavar="N", help="also generate N tokens (greedy)")

    rep = commands.add_parser(
        "report",
        help="judge a model's routing health layer by layer, or a training run's checkpoint timeline",
        description="Run one --model on an input and judge its routing, layer by layer; or, with "
        "--checkpoints, trace every checkpoint of a training run on --corpus and print its timeline.",
    )
    subject = rep.add_mutually_exclusive_group(required=True)
    subject.add_argument(
        "--checkpoints",
        metavar="DIR|A,B,C",
        help="a training run instead of one model: a folder of checkpoint folders, or A,B,C (needs --corpus)",
    )
    add_model_flags(rep, group=subject)
    _add_inputs(rep, corpus=True)
    rep.add_argument("--format", choices=["text", "json", "markdown"], default="text")
    add_batching_flags(rep, chunk_tokens=REPORT_CHUNK_TOKENS)
    one = rep.add_argument_group("one model (--model)")
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
    run = rep.add_argument_group("checkpoint timeline (--checkpoints)")
    run.add_argument("--max-batches", type=int, help="trace only this many batches (a fixed prefix)")
    run.add_argument("--store", type=Path, help="keep the traces in this store (reused with resume)")
    rep.set_defaults(check=functools.partial(_check_report_flags, rep))

    from moeviz.store.cli import add_trace_parser

    add_trace_parser(commands)

    from moeviz.whatif.cli import add_whatif_parser

    add_whatif_parser(commands)

    app = commands.add_parser(
        "app", help="start the Streamlit app; extra arguments go to `streamlit run` (e.g. --server.port 8502)"
    )
    app.add_argument("streamlit_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _check_report_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags of one branch of `report` given to the other: a usage error (exit 2)."""
    if args.checkpoints is not None:
        if args.corpus is None:
            parser.error("--checkpoints needs --corpus (the texts every checkpoint is traced on)")
        misplaced = {
            "--fail-on": args.fail_on,
            "--devices": args.devices,
            "--max-chunks": args.max_chunks,
            "--trust-remote-code": args.trust_remote_code or None,
            "--dtype": None if args.dtype == "auto" else args.dtype,
            "--device": None if args.device == "auto" else args.device,
            "--device-map": args.device_map,
            "--offload-folder": args.offload_folder,
            "--max-memory": args.max_memory,
        }
        if args.format == "markdown":
            parser.error("--format markdown is for one model; a checkpoint timeline prints text or json")
    else:
        misplaced = {"--max-batches": args.max_batches, "--store": args.store}
    given = [flag for flag, value in misplaced.items() if value is not None]
    if given:
        branch = "one --model" if args.checkpoints is not None else "--checkpoints"
        parser.error(f"{given[0]} only applies to {branch}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the CLI never downloads; the library leaves env alone
    if argv[:1] == ["app"] and not {"-h", "--help"} & set(argv[1:2]):
        return run_app(argv[1:])  # everything after `app` belongs to Streamlit, flags included
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "check", None) is not None:
        args.check(args)
    try:
        if args.command == "trace":
            from moeviz.store.cli import run_trace

            return run_trace(args)
        if args.command == "capture":
            return run_capture(args)
        if args.command == "whatif":
            from moeviz.whatif.cli import run_whatif

            return run_whatif(args)
        if args.command == "report" and args.checkpoints is not None:
            from moeviz.store.cli import run_checkpoint_report

            return run_checkpoint_report(args)
        if args.command == "report":
            return run_report(args)
        return run_app(args.streamlit_args)
    except MoevizError as exc:
        print(f"moeviz: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # `trace` handles its own (its completed batches are kept)
        written = "; nothing was written" if args.command == "capture" else ""
        print(f"moeviz: interrupted{written}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        if exc.errno not in ENVIRONMENT_ERRNOS:
            raise
        print(f"moeviz: error: {_environment_message(args, exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _environment_message(args: argparse.Namespace, exc: OSError) -> str:
    """One line for a full disk or an unwritable output (a traceback would only say where it was noticed)."""
    where = f" ({exc.filename})" if exc.filename else ""
    out = getattr(args, "out", None) or getattr(args, "store", None)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        if args.command == "trace":
            return f"no space left on device; continue with --resume once there is room{where}"
        return f"no space left on device{f' writing {out}' if out else ''}{where}; nothing was written"
    reason = (exc.strerror or os.strerror(exc.errno)).lower()
    return f"cannot write {out}: {reason}{where}" if out else f"{reason}{where}"


# transformers' trailing advice points at a report the one-line refusal does not show; say what it means
_MISMATCH = "You set `ignore_mismatched_sizes` to `False`, thus raising an error. "
_TRANSFORMERS_ADVICE = {
    f"{_MISMATCH}For details look at the above report!": "some weights have other shapes than config.json "
    "declares (the MISMATCH rows of the load report above)",
    "We encountered some issues during automatic conversion of the weights. For details look at the "
    "`CONVERSION` entries of the above report!": "transformers could not convert some weights (the "
    "CONVERSION rows of the load report above)",
    "You may consider adding `ignore_mismatched_sizes=True` to `from_pretrained(...)` if appropriate.": "",
    "For details look at the above report!": "",
}


def one_line(message: str) -> str:
    """A refusal on one line: transformers' advice replaced by what it means, line breaks folded."""
    for advice, meaning in _TRANSFORMERS_ADVICE.items():
        message = message.replace(advice, meaning)
    return " ".join(message.split()).rstrip(" :;")


def run_capture(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    inputs = prompt_inputs(args)
    out = _checked_output(args.out)
    if args.generate < 0:
        raise InputError(f"--generate must be >= 0, got {args.generate}")
    placement = placement_kwargs(args)
    with tqdm(total=3, desc="moeviz capture", unit="step", file=sys.stderr, leave=False) as bar:
        from transformers.utils import logging as hf_logging

        import moeviz

        hf_logging.disable_progress_bar()  # one progress bar: ours
        from moeviz.analysis import balance_frame

        def loading(done: int, total: int) -> None:
            bar.set_postfix_str(f"loading model {done / 2**20:,.1f}/{total / 2**20:,.1f} MiB")

        bar.set_postfix_str("loading model")
        loaded = moeviz.load_model(args.model, **load_kwargs(args), **placement, progress=loading)
        bar.update()
        bar.set_postfix_str("running forward" if not args.generate else f"generating {args.generate} tokens")
        trace = _capture(loaded, generate=args.generate, **inputs)
        bar.update()
        bar.set_postfix_str("writing parquet")
        trace.to_parquet(out)
        bar.update()
    print(format_summary(trace, balance_frame(trace), out))
    _warn_routing(trace)
    return 0


def _capture(*args, **kwargs):
    """`moeviz.capture`, its `RoutingWarning` held back: `_warn_routing` says it once, as a line."""
    import warnings

    from moeviz.capture.routing import RoutingWarning, capture

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RoutingWarning)
        return capture(*args, **kwargs)


def _warn_routing(trace) -> None:
    """A `moeviz: warning:` line on stderr naming the layers whose router scores are not finite."""
    from moeviz.capture.routing import routing_warning

    message = routing_warning(trace.layers)
    if message is not None:
        print(f"moeviz: warning: {message}", file=sys.stderr)


def run_report(args: argparse.Namespace) -> int:
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    import moeviz
    from moeviz.report import RENDERERS, build_report

    for name in ("chunk_tokens", "max_chunks", "batch_size", "devices"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    inputs = None if args.corpus is not None else prompt_inputs(args)
    corpus = None
    if args.corpus is not None:
        from moeviz.corpus import read_corpus

        corpus = read_corpus(args.corpus)  # fail on a bad corpus before loading the model
    placement = placement_kwargs(args)
    hf_logging.disable_progress_bar()
    loaded = moeviz.load_model(args.model, **load_kwargs(args), **placement, progress=load_progress())
    seq_domains = None
    if corpus is None:
        trace = _capture(loaded, **inputs)
    else:
        batches, seq_domains = _corpus_batches(loaded, corpus, args)
        traces = []
        with tqdm(
            total=sum(len(b) for b in batches), desc="routing corpus", unit="seq", file=sys.stderr
        ) as bar:
            for batch in batches:
                traces.append(_capture(loaded, token_ids=batch))
                bar.update(len(batch))
        trace = moeviz.Trace.concat(traces)
    try:
        report = build_report(trace, seq_domains, devices=args.devices)
    except ValueError as exc:  # e.g. experts that do not split evenly over --devices
        raise InputError(str(exc)) from exc
    print(RENDERERS[args.format](report))
    _warn_routing(trace)
    return EXIT_VERDICT if args.fail_on and report.collapse.fails(args.fail_on) else 0


def _corpus_batches(loaded, corpus, args) -> tuple[list[list[list[int]]], list[str]]:
    """Token windows of each document (≤ --max-chunks per domain), grouped into batches of --batch-size."""
    from moeviz.corpus import chunk_token_ids

    if loaded.tokenizer is None:
        raise InputError("--corpus needs a model with a tokenizer")
    length = min(args.chunk_tokens, loaded.max_length or args.chunk_tokens)
    max_chunks = args.max_chunks or REPORT_MAX_CHUNKS
    sequences, domains, per_domain = [], [], {}
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


def _checked_output(out: Path) -> Path:
    if out.is_dir():  # checked before the model loads: a forward would be wasted on an unwritable name
        raise InputError(f"--out {out} is a folder; give the name of a .parquet file to write")
    if out.suffix != ".parquet":
        raise InputError(f"--out must name a .parquet file, got {out}")
    parent = out.expanduser().resolve().parent
    if not parent.is_dir():
        raise InputError(f"--out: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"--out: folder {parent} is not writable")
    return out


def format_summary(trace, summary, out: Path) -> str:
    """One screen: the model, then per MoE layer (rows of `balance_frame`) tokens, experts, k, load entropy,
    max share (f = c/(kT), dropped slots included in kT), dead experts, dropped slots and their fraction."""
    lines = [
        f"{trace.model.source} ({trace.model.architecture}): {len(trace.tokens)} tokens, "
        f"{len(trace.layers)} MoE layers -> {out}",
        f"{'layer':>5} {'site':<9} {'tokens':>7} {'experts':>7} {'k':>2} {'load_entropy':>12} "
        f"{'max_share':>9} {'dead':>4} {'dropped':>7} {'dropped_fraction':>16}",
    ]
    for row in summary.itertuples():
        lines.append(
            f"{row.layer:>5} {row.site:<9} {row.tokens:>7} {row.experts:>7} {row.top_k:>2} "
            f"{row.load_entropy:>12.3f} {row.max_share:>9.3f} {row.dead_experts:>4} {row.dropped:>7} "
            f"{row.dropped_fraction:>16.3f}"
        )
    lines.extend(f"note: {note}" for note in trace.model.notes)
    return "\n".join(lines)


def run_app(streamlit_args: Sequence[str]) -> int:
    """Replace this process with `streamlit run <app>/streamlit_app.py ...` (Streamlit's env config applies);
    the app is the checkout's app/ or, installed from a wheel, the copy inside the package."""
    from moeviz.resources import bundled_path

    extra = list(streamlit_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    script = bundled_path("app") / "streamlit_app.py"
    argv = [sys.executable, "-m", "streamlit", "run", str(script), *APP_FLAGS, *extra]
    os.execv(sys.executable, argv)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
