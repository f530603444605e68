"""Megatron-Core routing (formats "megatron-trace" and "megatron-replay"; docs/engine-formats.md, "Megatron").

- "megatron-trace": the router trace `router_trace_rank{r}.jsonl` (`--moe-routing-trace-path`), one JSON line
  per router call: {"step", "stage": "pre_dispatch", "block": "decoder" | "mtp", "layer", "rank",
  "num_tokens", "topk", "top_indices": [[k ids] …], ["mtp_idx"], ["logit_offset", "logit_bytes",
  "logit_shape"]}, with the raw pre-top-k router logits in a bf16 sidecar `logits_rank{r}.bin` when
  captured. The trace carries no token ids and no sequence boundaries: each forward pass of the routers
  (a step; a new pass starts when a layer is seen again within a step, as Megatron's own tracer detects
  steps) on each rank is one sequence of `num_tokens` rows, in the router's token order (Megatron's
  [seq, batch] flattened). Multi-token-prediction heads (`block` "mtp") are not decoder layers: skipped.
  `layer` is the block index (`decoder.layers.N`), Megatron's 1-based `layer_number` (the inference
  recorder's `layer_ids`), or the MoE ordinal (`record_indices` without `layer_ids`): told apart by the set
  of numbers against the model's MoE layers. The hook rebuilds ids from a boolean routing map (ascending
  expert id), so only sets compare (`ranked=False`).
- "megatron-replay": the dynamic inference server's response, per choice `moe_topk_indices`
  [prompt + generated − 1, num_moe_layers, k] and `prompt_moe_topk_indices` (its first prompt-length rows),
  with the token ids in `prompt_token_ids` / `generation_token_ids`.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moeviz.engines.layout import RoutingLayout
from moeviz.engines.responses import nested_ids, read_responses, token_list
from moeviz.engines.routed import RoutedSequence, routed_trace
from moeviz.engines.tokens import agreed_token_ids, ids_for
from moeviz.errors import EngineFormatError
from moeviz.trace import Trace

_RANK_FILE = re.compile(r"router_trace_rank(\d+)\.jsonl$")
_BF16_BYTES = 2


def read(fmt: str, files: Sequence[Path], layout: RoutingLayout, token_ids: list[np.ndarray] | None) -> Trace:
    """A Trace of the Megatron-Core routing in `files` (`fmt` "megatron-trace" or "megatron-replay")."""
    if fmt == "megatron-replay":
        return _read_replay(files, layout, token_ids)
    return _read_trace(files, layout, token_ids)


# --- the router trace ----------------------------------------------------------------------------------


@dataclass
class _Call:
    """One router call: one JSON line."""

    ids: np.ndarray  # [num_tokens, k]
    line: int
    logits: dict[str, Any] | None  # logit_offset / logit_bytes / logit_shape, when the line has them


@dataclass
class _Pass:
    """One forward pass of the decoder's routers on one rank."""

    path: Path
    rank: int
    step: int
    index: int  # forward pass within its step
    calls: dict[int, _Call] = field(default_factory=dict)  # the file's layer number -> call

    @property
    def label(self) -> str:
        return f"{self.path.name}, step {self.step}" + (f", forward {self.index}" if self.index else "")


def _read_trace(files: Sequence[Path], layout: RoutingLayout, token_ids: list[np.ndarray] | None) -> Trace:
    notes: list[str] = []
    by_rank: dict[int, list[_Pass]] = {}
    for path in _trace_files(files):
        rank, passes = _read_rank_file(path, layout, notes)
        if rank in by_rank:
            raise EngineFormatError(f"{path}: a second trace of rank {rank}")
        by_rank[rank] = passes
    passes = [p for rank in sorted(by_rank) for p in by_rank[rank]]  # ranks merged in rank order
    if not passes:
        raise EngineFormatError("megatron-trace: the files hold no decoder router call")
    blocks = _layer_numbering(passes, layout, notes)
    sequences = [_pass_sequence(p, blocks, layout, notes) for p in passes]
    _note_multiple_passes(passes, notes)
    _note_identical_ranks(passes, sequences, notes)
    given = ids_for(token_ids, len(sequences), ", ".join(sorted({p.path.name for p in passes})))
    for seq, ids in zip(sequences, given, strict=True):
        seq.token_ids = ids
    if 0 < sum(s.logits is not None for s in sequences) < len(sequences):
        notes.append("router logits are missing for some forward passes: none are kept")
    return routed_trace(layout, sequences, source="megatron-trace", notes=notes, ranked=False)


def _trace_files(files: Sequence[Path]) -> list[Path]:
    out: list[Path] = []
    for path in files:
        if path.is_dir():
            found = sorted(path.glob("router_trace_rank*.jsonl"))
            if not found:
                raise EngineFormatError(f"{path}: no router_trace_rank{{r}}.jsonl in this folder")
            out.extend(found)
        else:
            out.append(path)
    return out


def _read_rank_file(path: Path, layout: RoutingLayout, notes: list[str]) -> tuple[int, list[_Pass]]:
    named = _RANK_FILE.search(path.name)
    rank = int(named.group(1)) if named else None
    passes: list[_Pass] = []
    mtp = 0
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                where = f"{path.name}, line {number}"
                record = _record(line, where)
                if rank is None:
                    rank = record["rank"]
                elif record["rank"] != rank:
                    raise EngineFormatError(
                        f"{where}: rank {record['rank']} in a trace of rank {rank} (files are named "
                        "router_trace_rank{r}.jsonl by the rank that wrote them)"
                    )
                if record["block"] == "mtp":
                    mtp += 1
                    continue
                call = _call(record, number, where, layout)
                current = passes[-1] if passes else None
                if current is None or current.step != record["step"] or record["layer"] in current.calls:
                    index = current.index + 1 if current is not None and current.step == record["step"] else 0
                    current = _Pass(path, rank, record["step"], index)
                    passes.append(current)
                current.calls[record["layer"]] = call
    except UnicodeDecodeError as exc:
        raise EngineFormatError(f"{path}: not a JSON Lines router trace ({exc.reason})") from exc
    if rank is None:
        raise EngineFormatError(f"{path}: no router call in the file")
    if mtp:
        notes.append(
            f"{path.name}: {mtp} router calls of multi-token-prediction heads (block mtp) skipped: they are "
            "not layers of the decoder"
        )
    return rank, passes


_FIELDS = {"step": int, "stage": str, "block": str, "layer": int, "rank": int, "num_tokens": int, "topk": int}


def _record(line: str, where: str) -> dict:
    record = _fast_record(line)
    if record is None:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EngineFormatError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise EngineFormatError(f"{where}: a JSON {type(record).__name__}, expected a router trace record")
    for name, kind in _FIELDS.items():
        value = record.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise EngineFormatError(
                f"{where}: `{name}` is {value!r}, expected {kind.__name__} (router_trace.py)"
            )
    if record["stage"] != "pre_dispatch":
        raise EngineFormatError(f"{where}: stage {record['stage']!r}; Megatron writes pre_dispatch records")
    if record["block"] not in ("decoder", "mtp"):
        raise EngineFormatError(f"{where}: block {record['block']!r}, expected decoder or mtp")
    return record


_IDS_KEY = '"top_indices": '
_NO_BRACKETS = str.maketrans("[]", "  ")


def _fast_record(line: str) -> dict | None:
    """The record with `top_indices` already an array [num_tokens, topk], parsed by numpy from the text:
    Megatron's lines end with it (json.dumps of the record, the key added at flush), and json's lists of
    Python ints cost ~2× more. None for a line in any other shape: the caller parses it with json."""
    key = line.rfind(_IDS_KEY)
    end = line.rstrip().rfind("}")
    head = line[:key].rstrip()
    if key < 0 or end < key or not head.endswith(","):
        return None
    try:
        record = json.loads(head[:-1] + "}")
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or "top_indices" in record:
        return None
    n, k = record.get("num_tokens"), record.get("topk")
    if not (type(n) is int and type(k) is int and n >= 0 and k > 0):
        return None
    ids = _int_rows(line[key + len(_IDS_KEY) : end].strip(), n, k)
    if ids is None:
        return None
    record["top_indices"] = ids
    return record


def _int_rows(body: str, n: int, k: int) -> np.ndarray | None:
    """[n, k] int64 from the text of a JSON list of n lists of k integers, or None when it is not exactly
    that (every row's own length is checked, not just the total)."""
    if n == 0:
        return np.zeros((0, k), np.int64) if body == "[]" else None
    if not (body.startswith("[[") and body.endswith("]]") and body.isascii()):
        return None
    inner = body[1:-1]
    text = np.frombuffer(inner.encode("ascii"), np.uint8)
    opens, closes = np.flatnonzero(text == ord("[")), np.flatnonzero(text == ord("]"))
    if len(opens) != n or len(closes) != n or (opens >= closes).any() or (closes[:-1] >= opens[1:]).any():
        return None
    commas = np.flatnonzero(text == ord(","))
    if (np.searchsorted(commas, closes) - np.searchsorted(commas, opens) != k - 1).any():
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            values = np.fromstring(inner.translate(_NO_BRACKETS), dtype=np.int64, sep=",")
    except (ValueError, DeprecationWarning):
        return None
    return values.reshape(n, k) if values.size == n * k else None


def _call(record: dict, number: int, where: str, layout: RoutingLayout) -> _Call:
    n, k = record["num_tokens"], record["topk"]
    if k != layout.top_k:
        raise EngineFormatError(
            f"{where}: topk {k}; the model routes each token to {layout.top_k} experts: is --model the model "
            "that produced this trace?"
        )
    rows = record.get("top_indices")
    if isinstance(rows, np.ndarray):  # parsed by _fast_record: [n, k] integers
        return _Call(rows, number, _logit_fields(record))
    try:
        ids = np.asarray(rows) if isinstance(rows, list) and rows else np.zeros((0, k), np.int64)
    except ValueError:  # rows of different lengths
        ids = None
    if ids is None or not isinstance(rows, list) or ids.shape != (n, k) or ids.dtype.kind not in "iu":
        shape = list(ids.shape) if ids is not None else "rows of different lengths"
        raise EngineFormatError(f"{where}: top_indices {shape}, expected [num_tokens {n}, topk {k}] integers")
    return _Call(ids, number, _logit_fields(record))


def _logit_fields(record: dict) -> dict[str, Any] | None:
    if "logit_offset" not in record:
        return None
    return {name: record.get(name) for name in ("logit_offset", "logit_bytes", "logit_shape")}


def _layer_numbering(passes: list[_Pass], layout: RoutingLayout, notes: list[str]) -> dict[int, int]:
    """file layer number -> position among the model's MoE layers, from the numbers the files use."""
    moe = layout.moe_layers
    numbers = set().union(*(p.calls for p in passes))
    candidates = [
        ("", {m: i for i, m in enumerate(moe)}),  # decoder.layers.N: the 0-based block index (PP = 1)
        ("Megatron's 1-based layer_number: layer n is block n − 1", {m + 1: i for i, m in enumerate(moe)}),
        (
            "MoE ordinals (record_indices without layer_ids): layer i is the i-th MoE layer",
            {i: i for i in range(len(moe))},
        ),
    ]
    for note, mapping in candidates:
        if numbers <= set(mapping) and (numbers == set(mapping) or not note):
            if note:
                notes.append(f"layer numbers in the trace are {note}")
            return mapping
    raise EngineFormatError(
        f"megatron-trace: the trace numbers its MoE layers {sorted(numbers)}; the model's are blocks "
        f"{list(moe)} of {layout.num_hidden_layers}: neither as block indices, 1-based layer numbers nor "
        "MoE ordinals do they match (is --model the model that produced the trace? with pipeline parallelism "
        "decoder.layers.N counts within a stage, which the trace does not record)"
    )


def _pass_sequence(
    p: _Pass, blocks: dict[int, int], layout: RoutingLayout, notes: list[str]
) -> RoutedSequence:
    order = sorted(blocks, key=blocks.__getitem__)
    missing = [n for n in order if n not in p.calls]
    if missing:
        raise EngineFormatError(
            f"{p.label}: no router call for layer {missing[0]} (Megatron's hook skips a call whose routing "
            "map does not hold exactly k experts per token, e.g. with dropped tokens)"
        )
    calls = [p.calls[n] for n in order]
    sizes = {len(c.ids) for c in calls}
    if len(sizes) > 1:
        raise EngineFormatError(
            f"{p.label}: layers routed different token counts {sorted(sizes)} in one pass"
        )
    low, high = min(int(c.ids.min(initial=0)) for c in calls), max(int(c.ids.max(initial=0)) for c in calls)
    # int16 halves the pass's memory; ids it cannot hold stay int64 so check_expert_sets names them
    dtype = np.int16 if low >= -(2**15) and high < 2**15 else np.int64
    experts = np.empty((len(calls[0].ids), len(calls), layout.top_k), dtype)  # [N, MoE layers, k]
    for i, call in enumerate(calls):
        experts[:, i] = call.ids
    return RoutedSequence(experts=experts, logits=_pass_logits(p, calls, layout, notes), label=p.label)


def _pass_logits(p: _Pass, calls: list[_Call], layout: RoutingLayout, notes: list[str]) -> np.ndarray | None:
    """[N, MoE layers, E] float32 from the bf16 sidecar, or None when a call of the pass has none."""
    records = [c.logits for c in calls if c.logits is not None]
    if len(records) != len(calls):
        return None
    sidecar = p.path.parent / f"logits_rank{p.rank}.bin"
    if not sidecar.is_file():
        note = f"{p.path.name}: its records point to {sidecar.name}, which is not next to it: logits not read"
        if note not in notes:
            notes.append(note)
        return None
    raw = np.memmap(sidecar, dtype=np.uint16, mode="r") if sidecar.stat().st_size else np.zeros(0, np.uint16)
    size = sidecar.stat().st_size
    n, e = len(calls[0].ids), layout.num_experts
    out = np.empty((n, len(calls), e), np.float32)
    for i, (call, record) in enumerate(zip(calls, records, strict=True)):
        where = f"{p.path.name}, line {call.line}"
        offset, nbytes, shape = (record[k] for k in ("logit_offset", "logit_bytes", "logit_shape"))
        if shape != [n, e]:
            raise EngineFormatError(f"{where}: logit_shape {shape}, expected [num_tokens {n}, experts {e}]")
        if not (isinstance(offset, int) and isinstance(nbytes, int)) or nbytes != n * e * _BF16_BYTES:
            raise EngineFormatError(f"{where}: logit_bytes {nbytes!r} for bf16 logits of shape {shape}")
        if offset < 0 or offset % _BF16_BYTES or offset + nbytes > size:
            raise EngineFormatError(
                f"{where}: logits at bytes {offset}…{offset + nbytes} of {sidecar.name}, which has {size}"
            )
        half = raw[offset // _BF16_BYTES : (offset + nbytes) // _BF16_BYTES]
        # bf16 is the upper half of an fp32: shifting its bits up 16 gives the same number in fp32
        out[:, i] = (half.astype(np.uint32) << 16).view(np.float32).reshape(n, e)
    return out


def _note_multiple_passes(passes: list[_Pass], notes: list[str]) -> None:
    many = sorted({(p.path.name, p.step) for p in passes if p.index})
    if many:
        name, step = many[0]
        notes.append(
            f"{name}, step {step} (and {len(many) - 1} more steps) holds several forward passes of the "
            "routers (micro-batches, or activations recomputed in the backward pass): one sequence each"
        )


def _note_identical_ranks(passes: list[_Pass], sequences: list[RoutedSequence], notes: list[str]) -> None:
    first: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
    same: set[tuple[int, int]] = set()
    for p, seq in zip(passes, sequences, strict=True):
        key = (p.step, p.index)
        if key not in first:
            first[key] = (p.rank, seq.experts)
        elif np.array_equal(first[key][1], seq.experts):
            same.add((first[key][0], p.rank))
    for a, b in sorted(same):
        notes.append(
            f"ranks {a} and {b} routed identically in a step (tensor-parallel replicas of the same tokens?): "
            "both are kept"
        )


# --- the inference server's replay output --------------------------------------------------------------


def _read_replay(files: Sequence[Path], layout: RoutingLayout, token_ids: list[np.ndarray] | None) -> Trace:
    notes: list[str] = []
    sequences: list[RoutedSequence] = []
    for path in files:
        for label, response in read_responses(path, "megatron-replay"):
            sequences.extend(_replay_sequences(response, label, notes))
    if not sequences:
        raise EngineFormatError(
            "megatron-replay: no choice carries moe_topk_indices (was the server run with "
            "--moe-enable-routing-replay?)"
        )
    given = ids_for(token_ids, len(sequences), ", ".join(p.name for p in files))
    for seq, ids in zip(sequences, given, strict=True):
        seq.token_ids = agreed_token_ids(seq.label, seq.token_ids, ids)
    return routed_trace(layout, sequences, source="megatron-replay", notes=notes, ranked=False)


def _replay_sequences(response: dict, label: str, notes: list[str]) -> list[RoutedSequence]:
    choices = response.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise EngineFormatError(f"{label}: not a Megatron-Core server response (no list of `choices`)")
    chat = response.get("object") == "chat.completion"
    out = []
    for index, choice in enumerate(choices):
        where = f"{label}, choice {choice.get('index', index)}"
        value = choice.get("moe_topk_indices")
        if value is None:
            if "routed_experts" in choice:
                raise EngineFormatError(f"{where}: a vLLM response (routed_experts): format vllm-routed")
            notes.append(f"{where} carries no moe_topk_indices: skipped")
            continue
        experts = _replay_ids(value, f"{where}, moe_topk_indices")
        holder = choice.get("message") if chat and isinstance(choice.get("message"), dict) else choice
        prompt_ids = token_list(holder.get("prompt_token_ids"), f"{where}, prompt_token_ids")
        generated = token_list(holder.get("generation_token_ids"), f"{where}, generation_token_ids")
        ids = (
            np.concatenate([prompt_ids, generated])
            if prompt_ids is not None and generated is not None
            else None
        )
        prompt_len = len(prompt_ids) if prompt_ids is not None else None
        if prompt_len is None and (chat or len(choices) == 1):
            usage = (response.get("usage") or {}).get("prompt_tokens")
            prompt_len = usage if isinstance(usage, int) else None
        _check_prompt_rows(choice.get("prompt_moe_topk_indices"), experts, prompt_len, where, notes)
        out.append(RoutedSequence(experts=experts, token_ids=ids, prompt_len=prompt_len, label=where))
    return out


def _replay_ids(value: Any, what: str) -> np.ndarray:
    """[R, L, k] ids: nested lists, or the ["ndarray", {"data", "dtype"}] wrapper that Megatron's request
    serialisation leaves in the response since routing moved to per-block storage (Megatron-LM 64870c14)."""
    if isinstance(value, list) and len(value) == 2 and value[0] == "ndarray" and isinstance(value[1], dict):
        data, dtype = value[1].get("data"), value[1].get("dtype")
        if not isinstance(dtype, str) or not re.fullmatch(r"u?int(8|16|32|64)", dtype):
            raise EngineFormatError(f"{what}: an ndarray of dtype {dtype!r}; routing ids are integers")
        value = data
    ids = nested_ids(value, what)
    if ids is None:
        raise EngineFormatError(f"{what}: empty")
    return ids


def _check_prompt_rows(value: Any, experts: np.ndarray, prompt_len: int | None, where: str, notes: list[str]):
    """prompt_moe_topk_indices repeats the first prompt-length rows of moe_topk_indices: check it does."""
    if value is None:
        return
    if isinstance(value, list) and value and value[0] == "ndarray":
        # routing_indices[:prompt_length] of the serialised wrapper: the wrapper again, not the prompt rows
        note = f"{where}: prompt_moe_topk_indices is the serialised array wrapper (not rows): ignored"
        if note not in notes:
            notes.append(note)
        return
    prompt = nested_ids(value, f"{where}, prompt_moe_topk_indices")
    if prompt is None:
        return
    if (prompt_len is not None and len(prompt) != prompt_len) or not np.array_equal(
        prompt, experts[: len(prompt)]
    ):
        raise EngineFormatError(
            f"{where}: prompt_moe_topk_indices ({len(prompt)} rows) are not the first rows of "
            "moe_topk_indices" + (f" for a prompt of {prompt_len} tokens" if prompt_len is not None else "")
        )
