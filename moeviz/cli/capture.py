"""`moeviz capture`: run a model on a prompt, write its routing table (Parquet) and print one line per MoE
layer. Also the quiet capture that `report` and `whatif` share (`capture_quietly`, `warn_routing`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from moeviz.cli.flags import (
    add_input_group,
    add_model_flags,
    add_placement_flags,
    load_kwargs,
    placement_kwargs,
    prompt_inputs,
)
from moeviz.cli.output import Column, note_lines, text_table
from moeviz.errors import InputError

# `balance_frame`'s columns, as the summary shows them (the widths keep short numbers in a fixed layout)
SUMMARY_COLUMNS = [
    Column("layer", width=5),
    Column("site", align="<", width=9),
    Column("tokens", width=7),
    Column("experts", width=7),
    Column("top_k", header="k", width=2),
    Column("load_entropy", "{:.3f}", width=12),
    Column("max_share", "{:.3f}", width=9),
    Column("dead_experts", header="dead", width=4),
    Column("dropped", width=7),
    Column("dropped_fraction", "{:.3f}", width=16),
]


def add_parser(commands: Any) -> None:
    cap = commands.add_parser("capture", help="run a model on an input and write its routing table (Parquet)")
    add_model_flags(cap)
    add_placement_flags(cap)
    add_input_group(cap)
    cap.add_argument("--out", required=True, type=Path, help="output .parquet file")
    cap.add_argument("--generate", type=int, default=0, metavar="N", help="also generate N tokens (greedy)")
    cap.set_defaults(run=run_capture)


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
        trace = capture_quietly(loaded, generate=args.generate, **inputs)
        bar.update()
        bar.set_postfix_str("writing parquet")
        trace.to_parquet(out)
        bar.update()
    print(format_summary(trace, balance_frame(trace), out))
    warn_routing(trace)
    return 0


def capture_quietly(*args: Any, **kwargs: Any) -> Any:
    """`moeviz.capture`, its `RoutingWarning` held back: `warn_routing` says it once, as a line."""
    import warnings

    import moeviz
    from moeviz.capture import RoutingWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RoutingWarning)
        return moeviz.capture(*args, **kwargs)


def warn_routing(trace: Any) -> None:
    """A `moeviz: warning:` line on stderr naming the layers whose router scores are not finite."""
    from moeviz.capture import routing_warning

    message = routing_warning(trace.layers)
    if message is not None:
        print(f"moeviz: warning: {message}", file=sys.stderr)


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


def format_summary(trace: Any, summary: Any, out: Path) -> str:
    """One screen: the model, then per MoE layer (rows of `balance_frame`) tokens, experts, k, load entropy,
    max share (f = c/(kT), dropped slots included in kT), dead experts, dropped slots and their fraction."""
    head = (
        f"{trace.model.source} ({trace.model.architecture}): {len(trace.tokens)} tokens, "
        f"{len(trace.layers)} MoE layers -> {out}"
    )
    table = text_table(SUMMARY_COLUMNS, summary.to_dict("records"))
    return "\n".join([head, *table, *note_lines(trace.model.notes)])
