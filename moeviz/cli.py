"""The `moeviz` command: capture routing from the shell, and start the app.

Exit codes: 0 success, 2 bad flags or bad input (nothing written), 1 unexpected failure.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from moeviz.errors import InputError, MoevizError

EXIT_BAD_INPUT = 2
EXIT_VERDICT = 3  # `report --fail-on`: the routing verdict reached the given level
APP_SCRIPT = Path(__file__).resolve().parents[1] / "app" / "streamlit_app.py"
# Streamlit runs a full gc.collect(2) after every script run; with torch and transformers loaded that adds
# 0.2-0.4 s to every click (Python's generational collector still runs on its own). Uploads are prompt
# files: 1 MB is far beyond any context (the app checks the size again).
APP_FLAGS = ("--runner.postScriptGC", "false", "--server.maxUploadSize", "1")


def _add_model_and_input(command: argparse.ArgumentParser, corpus: bool = False) -> None:
    """--model, --trust-remote-code and the mutually exclusive inputs shared by capture and report."""
    command.add_argument("--model", required=True, help="local Hugging Face folder or sample:NAME")
    command.add_argument(
        "--trust-remote-code", action="store_true", help="run modelling code shipped in the folder"
    )
    source = command.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="input text")
    source.add_argument("--text-file", type=Path, help="file whose text is the input")
    source.add_argument("--token-ids", help="comma-separated token ids, for models without a tokenizer")
    if corpus:
        source.add_argument(
            "--corpus", type=Path, help="folder with one sub-folder (or file name) per domain"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeviz", description="A microscope for Mixture-of-Experts models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cap = commands.add_parser("capture", help="run a model on an input and write its routing table (Parquet)")
    _add_model_and_input(cap)
    cap.add_argument("--out", required=True, type=Path, help="output .parquet file")
    cap.add_argument("--generate", type=int, default=0, metavar="N", help="also generate N tokens (greedy)")

    rep = commands.add_parser("report", help="run a model and judge its routing health, layer by layer")
    _add_model_and_input(rep, corpus=True)
    rep.add_argument("--format", choices=["text", "json", "markdown"], default="text")
    rep.add_argument(
        "--fail-on",
        choices=["warning", "collapsed"],
        help=f"exit with code {EXIT_VERDICT} when the model verdict reaches this level",
    )
    rep.add_argument("--devices", type=int, help="also report expert-parallel balancedness over D devices")
    rep.add_argument("--chunk-tokens", type=int, default=512, help="corpus: tokens per sequence")
    rep.add_argument(
        "--max-chunks", type=int, default=64, help="corpus: at most this many sequences per domain"
    )
    rep.add_argument("--batch-size", type=int, default=8, help="corpus: sequences per forward")
    rep.add_argument(
        "--checkpoints",
        metavar="DIR|A,B,C",
        help="checkpoint timeline of a series on --corpus instead of one model (see `moeviz report "
        "--checkpoints DIR --corpus PATH --help`)",
    )

    from moeviz.store.cli import add_trace_parser

    add_trace_parser(commands)

    app = commands.add_parser(
        "app", help="start the Streamlit app; extra arguments go to `streamlit run` (e.g. --server.port 8502)"
    )
    app.add_argument("streamlit_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["app"] and not {"-h", "--help"} & set(argv[1:2]):
        return run_app(argv[1:])  # everything after `app` belongs to Streamlit, flags included
    checkpoints = any(a == "--checkpoints" or a.startswith("--checkpoints=") for a in argv)
    try:
        if argv[:1] == ["report"] and checkpoints:
            from moeviz.store.cli import run_checkpoint_report

            return run_checkpoint_report(argv[1:])  # its own parser: no --model, store flags
        args = build_parser().parse_args(argv)
        if args.command == "trace":
            from moeviz.store.cli import run_trace

            return run_trace(args)
        if args.command == "capture":
            return run_capture(args)
        if args.command == "report":
            return run_report(args)
        return run_app(args.streamlit_args)
    except MoevizError as exc:
        print(f"moeviz: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def run_capture(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    inputs = _capture_inputs(args)
    out = _checked_output(args.out)
    if args.generate < 0:
        raise InputError(f"--generate must be >= 0, got {args.generate}")
    with tqdm(total=3, desc="moeviz capture", unit="step", file=sys.stderr, leave=False) as bar:
        from transformers.utils import logging as hf_logging

        import moeviz

        hf_logging.disable_progress_bar()  # one progress bar: ours
        from moeviz.analysis import layer_summary_frame

        bar.set_postfix_str("loading model")
        loaded = moeviz.load_model(args.model, trust_remote_code=args.trust_remote_code)
        bar.update()
        bar.set_postfix_str("running forward" if not args.generate else f"generating {args.generate} tokens")
        trace = moeviz.capture(loaded, generate=args.generate, **inputs)
        bar.update()
        bar.set_postfix_str("writing parquet")
        trace.to_parquet(out)
        bar.update()
    print(format_summary(trace, layer_summary_frame(trace), out))
    return 0


def run_report(args: argparse.Namespace) -> int:
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    import moeviz
    from moeviz.report import RENDERERS, build_report

    for name in ("chunk_tokens", "max_chunks", "batch_size", "devices"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    inputs = None if args.corpus is not None else _capture_inputs(args)
    corpus = None
    if args.corpus is not None:
        from moeviz.corpus import read_corpus

        corpus = read_corpus(args.corpus)  # fail on a bad corpus before loading the model
    hf_logging.disable_progress_bar()
    loaded = moeviz.load_model(args.model, trust_remote_code=args.trust_remote_code)
    seq_domains = None
    if corpus is None:
        trace = moeviz.capture(loaded, **inputs)
    else:
        batches, seq_domains = _corpus_batches(loaded, corpus, args)
        traces = []
        with tqdm(
            total=sum(len(b) for b in batches), desc="routing corpus", unit="seq", file=sys.stderr
        ) as bar:
            for batch in batches:
                traces.append(moeviz.capture(loaded, token_ids=batch))
                bar.update(len(batch))
        trace = moeviz.Trace.concat(traces)
    try:
        report = build_report(trace, seq_domains, devices=args.devices)
    except ValueError as exc:  # e.g. experts that do not split evenly over --devices
        raise InputError(str(exc)) from exc
    print(RENDERERS[args.format](report))
    return EXIT_VERDICT if args.fail_on and report.collapse.fails(args.fail_on) else 0


def _corpus_batches(loaded, corpus, args) -> tuple[list[list[list[int]]], list[str]]:
    """Token windows of each document (≤ --max-chunks per domain), grouped into batches of --batch-size."""
    from moeviz.corpus import chunk_token_ids

    if loaded.tokenizer is None:
        raise InputError("--corpus needs a model with a tokenizer")
    length = min(args.chunk_tokens, loaded.max_length or args.chunk_tokens)
    sequences, domains, per_domain = [], [], {}
    for doc in corpus:
        room = args.max_chunks - per_domain.get(doc.domain, 0)
        if room <= 0:
            continue
        chunks = chunk_token_ids(loaded.tokenizer(doc.text)["input_ids"], length, room)
        per_domain[doc.domain] = per_domain.get(doc.domain, 0) + len(chunks)
        sequences += chunks
        domains += [doc.domain] * len(chunks)
    batches = [sequences[i : i + args.batch_size] for i in range(0, len(sequences), args.batch_size)]
    return batches, domains


def _capture_inputs(args: argparse.Namespace) -> dict:
    if args.text is not None:
        if not args.text.strip():
            raise InputError("--text is empty")
        return {"texts": args.text}
    if args.text_file is not None:
        path: Path = args.text_file
        if not path.is_file():
            raise InputError(f"--text-file {path} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"--text-file {path} is not UTF-8 text: {exc}") from exc
        if not text.strip():
            raise InputError(f"--text-file {path} is empty")
        return {"texts": text}
    try:
        ids = [int(part) for part in args.token_ids.split(",") if part.strip()]
    except ValueError as exc:
        raise InputError(f"--token-ids must be comma-separated integers, got {args.token_ids!r}") from exc
    if not ids:
        raise InputError("--token-ids is empty")
    return {"token_ids": [ids]}


def _checked_output(out: Path) -> Path:
    if out.suffix != ".parquet":
        raise InputError(f"--out must name a .parquet file, got {out}")
    parent = out.expanduser().resolve().parent
    if not parent.is_dir():
        raise InputError(f"--out: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"--out: folder {parent} is not writable")
    return out


def format_summary(trace, summary, out: Path) -> str:
    """One screen: the model, then per MoE layer tokens, load entropy, max share and dead experts."""
    lines = [
        f"{trace.model.source} ({trace.model.architecture}): {len(trace.tokens)} tokens, "
        f"{len(trace.layers)} MoE layers -> {out}",
        f"{'layer':>5} {'site':<9} {'tokens':>7} {'experts':>7} {'k':>2} {'load_entropy':>12} "
        f"{'max_share':>9} {'dead':>4} {'dropped':>7}",
    ]
    for row in summary.itertuples():
        lines.append(
            f"{row.layer:>5} {row.site:<9} {row.tokens:>7} {row.experts:>7} {row.top_k:>2} "
            f"{row.load_entropy:>12.3f} {row.max_share:>9.3f} {row.dead_experts:>4} {row.dropped:>7}"
        )
    lines.extend(f"note: {note}" for note in trace.model.notes)
    return "\n".join(lines)


def run_app(streamlit_args: Sequence[str]) -> int:
    """Replace this process with `streamlit run app/streamlit_app.py ...` (Streamlit's env config applies)."""
    extra = list(streamlit_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = [sys.executable, "-m", "streamlit", "run", str(APP_SCRIPT), *APP_FLAGS, *extra]
    os.execv(sys.executable, argv)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
