"""Flags shared by the `moeviz` commands, each defined once (same name, default and help everywhere), and
the keyword arguments they become (`load_kwargs`, `placement_kwargs`, `trace_settings`, `prompt_inputs`).

Imports nothing heavy at module level: the device check and the store's settings load inside functions."""

from __future__ import annotations

import argparse
import json
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moeviz.errors import InputError

MODEL_HELP = "local Hugging Face folder or sample:NAME"
CORPUS_HELP = (
    "a folder of .txt files (one sub-folder, or file name, per domain) or a JSONL file (one object per "
    'line: "text", optional "domain")'
)
BATCH_SIZE = 8
REPORT_CHUNK_TOKENS = 512  # report --corpus and the checkpoint timeline: tokens per sequence
DTYPES = ("auto", "float32", "bfloat16", "float16")
TEXT_FILE_LIMIT = 16 * 2**20  # --text-file: bytes (a prompt; also stops endless inputs such as /dev/zero)


def add_model_flags(
    command: argparse.ArgumentParser,
    *,
    model_help: str = MODEL_HELP,
    group: Any = None,
    dtype_flag: str = "--dtype",
) -> None:
    """--model and the flags that say how to load it, for every command that loads a model (capture,
    report, trace, whatif): add a model-loading flag here and pass it on in `load_kwargs`. With `group` (a
    mutually exclusive group), --model goes into it instead of being required on its own. `dtype_flag`
    renames --dtype where a command's --dtype means something else (`whatif quant`: --load-dtype)."""
    if group is None:
        command.add_argument("--model", required=True, help=model_help)
    else:
        group.add_argument("--model", help=model_help)
    command.add_argument(
        "--trust-remote-code", action="store_true", help="run modelling code shipped in the folder"
    )
    command.add_argument(
        dtype_flag,
        choices=DTYPES,
        default="auto",
        help="dtype of the weights: auto = the checkpoint's own (fp16 loads as fp32 on a CPU)",
    )
    command.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda:N, mps")
    command.add_argument(
        "--adapter",
        type=Path,
        metavar="DIR",
        help="a PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) over --model",
    )


def load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of `moeviz.load_model` from the flags `add_model_flags` added (`adapter` only when
    --adapter is given)."""
    dtype = getattr(args, "load_dtype", args.dtype)  # --load-dtype where --dtype is another flag's
    kwargs = {"trust_remote_code": args.trust_remote_code, "dtype": dtype, "device": args.device}
    if getattr(args, "adapter", None) is not None:
        kwargs["adapter"] = args.adapter
    return kwargs


def add_placement_flags(command: argparse.ArgumentParser) -> None:
    """--device-map, --offload-folder and --max-memory (a model spread over GPUs, CPU and disk), passed on by
    `placement_kwargs` (capture, report, trace)."""
    command.add_argument(
        "--device-map",
        help="spread the model (needs accelerate): auto, a device, or JSON {module: device|cpu|disk}",
    )
    command.add_argument("--offload-folder", type=Path, help="where a device map's 'disk' modules go")
    command.add_argument(
        "--max-memory",
        metavar="DEV=SIZE,...",
        help="with --device-map: memory budget per device, e.g. 0=70GiB,cpu=8GiB",
    )


def placement_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of `moeviz.load_model` from the flags `add_placement_flags` added."""
    kwargs: dict[str, Any] = {}
    text = args.device_map
    if text is not None:
        if text.lstrip().startswith("{"):
            try:
                kwargs["device_map"] = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InputError(f"--device-map is not valid JSON: {exc.msg}") from None
            if not isinstance(kwargs["device_map"], dict):
                raise InputError("--device-map JSON must be an object {module: device}")
        else:
            kwargs["device_map"] = int(text) if text.isdigit() else text
        if getattr(args, "ray", None) is None:  # Ray workers place the model on their own machines
            _check_map_devices(kwargs["device_map"], text)
    elif args.offload_folder is not None or args.max_memory is not None:
        raise InputError("--offload-folder and --max-memory need --device-map (e.g. --device-map auto)")
    if args.offload_folder is not None:
        kwargs["offload_folder"] = args.offload_folder
    if args.max_memory is not None:
        budget: dict[int | str, str] = {}
        for part in filter(None, (p.strip() for p in args.max_memory.split(","))):
            device, sep, size = part.partition("=")
            if not sep or not device.strip() or not size.strip():
                raise InputError(
                    f"--max-memory takes DEVICE=SIZE pairs (e.g. 0=70GiB,cpu=8GiB), got {part!r}"
                )
            device = device.strip()
            budget[int(device) if device.isdigit() else device] = size.strip()
        kwargs["max_memory"] = budget
    return kwargs


# --device-map values that are strategies or places, not devices that must exist here
MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential", "cpu", "disk", "meta")


def _check_map_devices(device_map: Any, text: str) -> None:
    """Refuse (InputError, before anything loads) a --device-map naming a device this machine or torch build
    lacks, e.g. cuda:7 on a CPU-only build; transformers would fail deep in the load with a traceback."""
    from moeviz.errors import LoadOptionError
    from moeviz.models.placement import pick_device

    values = device_map.values() if isinstance(device_map, dict) else [device_map]
    for value in values:
        if isinstance(value, str) and value.strip().lower() in MAP_STRATEGIES:
            continue
        device = f"cuda:{value}" if isinstance(value, int) and not isinstance(value, bool) else value
        try:
            pick_device(device if isinstance(device, str) else str(device))
        except LoadOptionError as exc:
            reason = str(exc).replace("use device='cpu'", "use cpu")
            raise InputError(f"--device-map {text}: {reason}") from None


def load_progress(description: str = "loading model") -> Callable[[int, int], None]:
    """A `load_model(progress=...)` callback drawing the bytes read on stderr; the bar closes when the load
    completes."""
    from moeviz.cli.progress import progress_bar

    bars: list[Any] = []

    def update(done: int, total: int) -> None:
        if not bars:
            bars.append(
                progress_bar(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024)
            )
        bars[0].update(done - bars[0].n)
        if done >= total:
            bars[0].close()

    return update


def add_batching_flags(command: argparse.ArgumentParser, *, chunk_tokens: int) -> None:
    """How a corpus is cut into sequences and batches (report --corpus, checkpoints, trace)."""
    command.add_argument(
        "--batch-size",
        type=int,
        default=BATCH_SIZE,
        help=f"corpus: sequences per forward (default {BATCH_SIZE})",
    )
    command.add_argument(
        "--chunk-tokens",
        type=int,
        default=chunk_tokens,
        help=f"corpus: tokens per sequence (default {chunk_tokens})",
    )


def trace_settings(args: argparse.Namespace) -> Any:
    """The store's `TraceSettings` from the batching flags (trace, checkpoints), each checked to be >= 1."""
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


def add_input_group(command: argparse.ArgumentParser, *, corpus: bool = False, required: bool = True) -> None:
    """The mutually exclusive input of capture and report: a prompt, or (report) --corpus. `required=False`
    where another flag may stand in for it (report --trace); the command then checks it itself."""
    source = command.add_mutually_exclusive_group(required=required)
    add_prompt_inputs(source)
    if corpus:
        source.add_argument("--corpus", type=Path, help=CORPUS_HELP)


def add_prompt_inputs(source: argparse._MutuallyExclusiveGroup) -> None:
    """--text, --text-file, --token-ids into a command's (mutually exclusive) input group."""
    source.add_argument("--text", help="input text")
    source.add_argument("--text-file", type=Path, help="file whose text is the input")
    source.add_argument("--token-ids", help="comma-separated token ids, for models without a tokenizer")


def prompt_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """{"texts": str} or {"token_ids": [[ids]]} from the flags of `add_prompt_inputs`."""
    if args.text is not None:
        if not args.text.strip():
            raise InputError("--text is empty")
        return {"texts": args.text}
    if args.text_file is not None:
        path: Path = args.text_file
        data = read_text_file(path)
        try:
            text = data.decode("utf-8")
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


def read_text_file(path: Path) -> bytes:
    """The bytes of --text-file, at most TEXT_FILE_LIMIT; InputError naming what is wrong with the path."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise InputError(f"--text-file {path} does not exist") from None
    except OSError as exc:
        raise InputError(f"--text-file {path} cannot be read: {exc.strerror}") from None
    limit = f"the {TEXT_FILE_LIMIT // 2**20} MiB limit of --text-file (a prompt, not a corpus: see --corpus)"
    if stat.S_ISDIR(mode):
        raise InputError(
            f"--text-file {path} is a folder; give a text file (a folder of texts is a --corpus)"
        )
    if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):  # a FIFO would block, a socket cannot be read
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a block device"
        raise InputError(f"--text-file {path} is not a regular file ({kind}); give a text file")
    if stat.S_ISREG(mode) and path.stat().st_size > TEXT_FILE_LIMIT:
        raise InputError(f"--text-file {path} is {path.stat().st_size / 2**20:,.1f} MiB, over {limit}")
    try:
        with open(path, "rb") as handle:  # a character device (/dev/stdin on a tty, /dev/zero) may not end
            data = handle.read(TEXT_FILE_LIMIT + 1)
    except OSError as exc:
        raise InputError(f"--text-file {path} cannot be read: {exc.strerror}") from None
    if len(data) > TEXT_FILE_LIMIT:
        raise InputError(f"--text-file {path} did not end within {limit}")
    return data
