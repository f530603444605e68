"""SGLang's `return_routed_experts` (format "sglang-routed"), read exactly as SGLang sends it
(docs/engine-formats.md, "SGLang"): saved `/generate` responses (`meta_info["routed_experts"]`) or OpenAI
responses (`sglext.routed_experts`): base64 of the flat [seq_len − 1 − start, num_hidden_layers, k] logical
ids, int32 unless `routed_experts_dtype` says uint16/uint8 → a Trace.

Sources (repo:path@commit): sgl-project/sglang python/sglang/srt/layers/moe/topk.py@000328a8,
state_capturer/base.py@0564b521, state_capturer/routed_experts_wire.py@a6463a10,
managers/scheduler_components/batch_result_processor.py@003ddbce, managers/tokenizer_manager.py@001067ff,
entrypoints/openai/protocol.py@004c82e0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeviz.engines.layout import RoutingLayout
from moeviz.engines.responses import decode_base64, read_responses, token_list
from moeviz.engines.routed import RoutedSequence, routed_trace
from moeviz.engines.tokens import agreed_token_ids, ids_for
from moeviz.errors import EngineFormatError
from moeviz.trace import UNKNOWN_TOKEN, Trace

# routed_experts_wire.py: the dtypes a payload may be sent in; int32 when the response names none
_WIRE_DTYPES: dict[str, np.dtype] = {
    "int32": np.dtype("<i4"),
    "uint16": np.dtype("<u2"),
    "uint8": np.dtype("u1"),
}


def read(fmt: str, files: Sequence[Path], layout: RoutingLayout, token_ids) -> Trace:
    """Read saved SGLang responses (format "sglang-routed") for the model `layout`."""
    return read_routed(files, layout, token_ids)


@dataclass
class _Response:
    label: str
    payload: str
    dtype: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    prompt_ids: np.ndarray | None
    output_ids: np.ndarray | None
    start: int | None  # routed_experts_start_len where the saved object states it


def read_routed(
    files: Sequence[Path], layout: RoutingLayout, token_ids: list[np.ndarray] | None = None
) -> Trace:
    """Saved SGLang responses with routed experts (/generate or OpenAI; JSON object, list, or JSONL)."""
    responses = [r for f in files for r in _responses(Path(f))]
    given = ids_for(token_ids, len(responses), f"the {len(responses)} responses given")
    sequences, notes = [], []
    for response, user in zip(responses, given, strict=True):
        sequence, note = _routed_sequence(response, layout, user)
        sequences.append(sequence)
        if note:
            notes.append(note)
    dtypes = sorted({(r.dtype or "int32").strip().lower() for r in responses})
    notes.insert(
        0,
        "SGLang return_routed_experts: logical expert ids (captured before the EPLB remap), one row per "
        f"position from routed_experts_start_len to seq_len − 2 (the last sampled token never runs), "
        f"every hidden layer with dense layers written as 0; sent as {', '.join(dtypes)}",
    )
    return routed_trace(layout, sequences, source="sglang-routed", notes=notes, ranked=False)


def _responses(path: Path) -> list[_Response]:
    return [_response(label, item) for label, item in read_responses(path, "sglang-routed")]


def _response(label: str, item: dict) -> _Response:
    if isinstance(item.get("meta_info"), dict):  # /generate (tokenizer_manager: out_dict)
        meta = item["meta_info"]
        payload, dtype = meta.get("routed_experts"), meta.get("routed_experts_dtype")
        prompt_n, completion_n = meta.get("prompt_tokens"), meta.get("completion_tokens")
        prompt_ids, output_ids = item.get("prompt_token_ids"), item.get("output_ids")
        start = meta.get("routed_experts_start_len")
        where = 'meta_info["routed_experts"]'
    elif "choices" in item or "sglext" in item:  # OpenAI completions / chat: response-level SglExt
        ext = item.get("sglext") or {}
        if not isinstance(ext, dict):
            raise EngineFormatError(f"{label}: sglext is a {type(ext).__name__}, not an object")
        payload, dtype = ext.get("routed_experts"), ext.get("routed_experts_dtype")
        choices = item.get("choices") or []
        # SGLang builds sglext from the first choice only (serving_*: process_routed_experts_from_ret(ret[0]))
        first = choices[0] if choices and isinstance(choices[0], dict) else {}
        prompt_ids = first.get("prompt_token_ids", ext.get("input_ids"))
        output_ids = first.get("token_ids")
        if output_ids is None and isinstance(ext.get("output_ids"), list) and ext["output_ids"]:
            output_ids = ext["output_ids"][0]
        usage = item.get("usage")
        if not isinstance(usage, dict):
            usage = {}
        prompt_n = usage.get("prompt_tokens")
        completion_n = usage.get("completion_tokens") if len(choices) <= 1 else None  # summed over n
        start = None
        where = "sglext.routed_experts"
    else:
        raise EngineFormatError(
            f"{label}: neither a /generate response (meta_info) nor an OpenAI one (choices, sglext); keys "
            f"{sorted(map(str, item))[:12]}"
        )
    if payload is None:
        raise EngineFormatError(
            f"{label}: no {where}: request return_routed_experts: true from a server started with "
            "--enable-return-routed-experts"
        )
    if not isinstance(payload, str):
        raise EngineFormatError(f"{label}: {where} is a {type(payload).__name__}, not a base64 string")
    if dtype is not None and not isinstance(dtype, str):
        raise EngineFormatError(f"{label}: routed_experts_dtype is {dtype!r}, not a dtype name")
    return _Response(
        label=label,
        payload=payload,
        dtype=dtype,
        prompt_tokens=_count(label, "prompt_tokens", prompt_n),
        completion_tokens=_count(label, "completion_tokens", completion_n),
        prompt_ids=token_list(prompt_ids, f"{label}, prompt token ids"),
        output_ids=token_list(output_ids, f"{label}, output ids"),
        start=_count(label, "routed_experts_start_len", start),
    )


def _count(label: str, what: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EngineFormatError(f"{label}: {what} is {value!r}, not a count")
    return value


def _decode_payload(response: _Response, layout: RoutingLayout) -> np.ndarray:
    """[R, num_hidden_layers, k] ids, a read-only view of the decoded bytes in the sender's dtype."""
    name = "int32" if response.dtype is None else response.dtype.strip().lower()
    if name not in _WIRE_DTYPES:
        raise EngineFormatError(
            f"{response.label}: routed_experts_dtype {response.dtype!r}; SGLang sends "
            f"{', '.join(_WIRE_DTYPES)}"
        )
    dtype = _WIRE_DTYPES[name]
    raw = decode_base64(response.payload, f"{response.label}: routed_experts")
    n_layers, k = layout.num_hidden_layers, layout.top_k
    if len(raw) % dtype.itemsize:
        raise EngineFormatError(
            f"{response.label}: {len(raw)} bytes of routed experts is not a whole number of {name} ids"
        )
    count = len(raw) // dtype.itemsize
    if count % (n_layers * k):
        raise EngineFormatError(
            f"{response.label}: {count} {name} ids is not a multiple of num_hidden_layers × k = "
            f"{n_layers} × {k}; SGLang returns [seq_len − 1 − start, num_hidden_layers, k]: is --model the "
            "model that served this response (and the dtype the one it sent)?"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(-1, n_layers, k)


def _routed_sequence(
    response: _Response, layout: RoutingLayout, given: np.ndarray | None
) -> tuple[RoutedSequence, str | None]:
    label = response.label
    experts = _decode_payload(response, layout)
    rows = len(experts)
    prompt_n, completion_n = response.prompt_tokens, response.completion_tokens
    for what, ids, n in (
        ("prompt token ids", response.prompt_ids, prompt_n),
        ("output ids", response.output_ids, completion_n),
    ):
        if ids is not None and n is not None and len(ids) != n:
            raise EngineFormatError(
                f"{label}: {len(ids)} {what} but the response counts {n} {what.split()[0]} tokens"
            )
    if prompt_n is None and response.prompt_ids is not None:
        prompt_n = len(response.prompt_ids)
    if completion_n is None and response.output_ids is not None:
        completion_n = len(response.output_ids)
    note = None
    known = None
    if prompt_n is not None and completion_n is not None:
        total = prompt_n + completion_n
        # batch_result_processor: rows cover [start, seq_len − 1), seq_len = prompt + generated tokens
        start = total - 1 - rows
        if start < 0 or start > prompt_n:
            raise EngineFormatError(
                f"{label}: {rows} rows of routing for {total} tokens ({prompt_n} prompt + {completion_n} "
                f"generated); SGLang returns seq_len − 1 − start rows with start in [0, {prompt_n}], i.e. "
                f"{max(completion_n - 1, 0)} to {max(total - 1, 0)}"
            )
        if response.start is not None and response.start != start:
            raise EngineFormatError(
                f"{label}: routed_experts_start_len {response.start}, but {rows} rows for {total} tokens "
                f"start at position {start}"
            )
        known = np.full(total, UNKNOWN_TOKEN, np.int64)
        if response.prompt_ids is not None:
            known[:prompt_n] = response.prompt_ids
        if response.output_ids is not None:
            known[prompt_n:] = response.output_ids
        if start:
            note = f"{label}: routing starts at position {start} (routed_experts_start_len)"
    else:
        start = response.start or 0
        note = (
            f"{label}: the response does not count its tokens, so its {rows} rows are taken to start at "
            f"position {start}"
        )
    if given is not None:
        token_ids = agreed_token_ids(label, known, given)
    elif known is not None and (known >= 0).any():
        token_ids = known
    else:
        token_ids = None
    sequence = RoutedSequence(
        experts=experts, token_ids=token_ids, start=start, prompt_len=prompt_n, label=label
    )
    return sequence, note
