"""`moeviz capture`: run a model on a prompt, write its routing table (Parquet) and print one line per MoE
layer; with `--engine vllm`, the routing vLLM itself dispatched (`moeviz.engines.vllm`, run in the vLLM
environment that `make vllm` builds). Also the quiet capture that `report` and `whatif` share
(`capture_quietly`, `warn_routing`), and the engine flags `trace` shares (`add_engine_flags`)."""

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
from moeviz.cli.progress import progress_bar
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
    add_engine_flags(cap)
    cap.set_defaults(run=run_capture)


ENGINES = ("transformers", "vllm")


def add_engine_flags(command: argparse.ArgumentParser) -> None:
    """--engine (who runs the model: moeviz's transformers capture, or vLLM) and --vllm-routing."""
    command.add_argument(
        "--engine",
        choices=ENGINES,
        default="transformers",
        help="transformers (moeviz's own capture) or vllm: the routing vLLM dispatched, run in the vLLM "
        "environment (`make vllm`, or MOEVIZ_VLLM_PYTHON)",
    )
    command.add_argument(
        "--vllm-routing",
        choices=("auto", "capture-fn", "routed-experts"),
        default="auto",
        help="--engine vllm: how routing is read: capture-fn (the router's capture seam: ids, weights, "
        "logits), routed-experts (enable_return_routed_experts: ids; GPU only); auto = capture-fn on "
        "CPU, routed-experts on a GPU",
    )


def check_engine_flags(args: argparse.Namespace) -> None:
    """Refuse the flags that only moeviz's own capture takes when --engine vllm runs the model (vLLM places
    and loads the model itself), and --vllm-routing without it."""
    if args.engine != "vllm":
        if args.vllm_routing != "auto":
            raise InputError("--vllm-routing needs --engine vllm")
        return
    given = {
        "--trust-remote-code": args.trust_remote_code,
        "--device": args.device != "auto",
        "--device-map": getattr(args, "device_map", None) is not None,
        "--offload-folder": getattr(args, "offload_folder", None) is not None,
        "--max-memory": getattr(args, "max_memory", None) is not None,
        "--adapter": getattr(args, "adapter", None) is not None,
    }
    misplaced = [flag for flag, value in given.items() if value]
    if misplaced:
        raise InputError(f"{misplaced[0]} does not apply to --engine vllm (vLLM loads and places the model)")


def run_capture(args: argparse.Namespace) -> int:
    inputs = prompt_inputs(args)
    out = _checked_output(args.out)
    if args.generate < 0:
        raise InputError(f"--generate must be >= 0, got {args.generate}")
    check_engine_flags(args)
    if args.engine == "vllm":
        return _run_vllm_capture(args, inputs, out)
    placement = placement_kwargs(args)
    with progress_bar(total=3, desc="moeviz capture", unit="step") as bar:
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


def _run_vllm_capture(args: argparse.Namespace, inputs: dict[str, Any], out: Path) -> int:
    from moeviz.analysis import balance_frame
    from moeviz.engines.vllm import capture_vllm

    with progress_bar(total=2, desc="moeviz capture (vLLM)", unit="step") as bar:
        trace = capture_vllm(
            args.model,
            inputs.get("texts"),
            token_ids=inputs.get("token_ids"),
            generate=args.generate,
            dtype=args.dtype,
            routing=args.vllm_routing,
            progress=bar.set_postfix_str,
        )
        bar.update()
        bar.set_postfix_str("writing parquet")
        trace.to_parquet(out)
        bar.update()
    print(format_summary(trace, balance_frame(trace), out))
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
