"""Files written exactly as SGLang writes them, built from SGLang's own definitions (no SGLang code: it does
not install here), for the tests of `moeviz.engines.sglang_dump` and `sglang_routed`. Sources, in
sgl-project/sglang:

- expert-distribution dumps (`eplb/expert_distribution.py@dd780ab9`): `torch.save` of
  `{"rank", "logical_count", "average_utilization_rate_over_window"}` (stat: a ring buffer `_CircularBuffer`
  zeroed at start, physical counts folded to logical by `scatter_add_` over the physical-to-logical map) or
  `{"records": [...], "last_physical_to_logical_map"}` (per_pass records carry `global_physical_count`
  [L, P]; per_token records the pass's `input_ids`, `positions`, `extend_seq_lens` (None in a decode pass),
  `forward_mode` and `topk_ids_of_layer` [L, T, 8] of physical ids, reset to -1 before every pass);
- the trivial placement `arange(P).repeat(L, 1) % E` (`eplb/expert_location.py@6270b014`);
- `return_routed_experts` (`state_capturer/base.py`, `routed_experts_wire.py`, `tokenizer_manager.py`):
  rows `[start, seq_len − 1)` of a host buffer zeroed at start (dense layers are never written: 0), sent as
  base64 of the flat array in int32, or uint16/uint8 when every id fits (else int32), named by
  `meta_info["routed_experts_dtype"]`; OpenAI responses carry it as `sglext.routed_experts`.

Routing itself is random (k distinct logical experts per token and MoE layer): the tests compare what the
importer reads with these arrays, never with the importer's own output.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EXTEND, DECODE, MIXED, IDLE = 1, 2, 3, 4  # ForwardMode values
TOPK_COLUMNS = 8  # _DetailSinglePassGatherer._TOP_K_NUM


def random_routing(rng: np.random.Generator, rows: int, layers: int, k: int, e: int) -> np.ndarray:
    """[rows, layers, k] int32: k distinct experts of e per (row, layer), in random order."""
    return np.argsort(rng.random((rows, layers, e)), axis=2)[:, :, :k].astype(np.int32)


# ------------------------------------------------------------------------------ placement and counting


def trivial_map(num_layers: int, num_physical: int, num_logical: int) -> torch.Tensor:
    """ExpertLocationMetadata.init_trivial: physical slot p holds logical expert p % E in every layer."""
    return torch.arange(0, num_physical).repeat(num_layers, 1) % num_logical


def shuffled_map(num_layers: int, num_physical: int, num_logical: int, seed: int) -> torch.Tensor:
    """An EPLB-style placement: every logical expert on at least one slot, the rest replicas, shuffled."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_layers):
        extra = torch.randint(0, num_logical, (num_physical - num_logical,), generator=g)
        row = torch.cat([torch.arange(num_logical), extra])
        rows.append(row[torch.randperm(num_physical, generator=g)])
    return torch.stack(rows)


def to_physical(
    logical: np.ndarray, mapping: torch.Tensor, layer: int, rng: np.random.Generator
) -> np.ndarray:
    """Dispatch logical ids [T, k] of one layer to physical slots: a random replica of each expert."""
    row = mapping[layer].numpy()
    out = np.empty_like(logical)
    for index, expert in np.ndenumerate(logical):
        out[index] = rng.choice(np.flatnonzero(row == expert))
    return out


def count_physical(
    physical_of_layer: dict[int, np.ndarray], num_layers: int, num_physical: int
) -> torch.Tensor:
    """_SelectExpertsSinglePassGatherer: scatter_add of every non -1 id, per layer: int32 [L, P]."""
    data = torch.zeros((num_layers, num_physical), dtype=torch.int)
    for layer, ids in physical_of_layer.items():
        flat = torch.as_tensor(ids).flatten().long()
        mask = flat != -1
        data[layer].scatter_add_(0, flat.masked_fill(~mask, 0), mask.int())
    return data


def fold_to_logical(
    global_physical_count: torch.Tensor, mapping: torch.Tensor, num_logical: int
) -> torch.Tensor:
    """_convert_global_physical_count_to_logical_count: [S, L, P] → [S, L, E] by scatter_add_ over the map."""
    s, num_layers, _ = global_physical_count.shape
    logical = torch.zeros((s, num_layers, num_logical), dtype=global_physical_count.dtype)
    index = mapping.unsqueeze(0).expand(s, -1, -1).to(torch.int64)
    logical.scatter_add_(dim=2, index=index, src=global_physical_count)
    return logical


class CircularBuffer:
    """_CircularBuffer: a zeroed [size, *item] buffer written at a wrapping index; get_all is the buffer."""

    def __init__(self, item_shape: tuple[int, ...], size: int):
        self.buffer = torch.zeros((size, *item_shape), dtype=torch.int32)
        self.index = 0

    def append(self, value: torch.Tensor) -> None:
        self.buffer[self.index] = value
        self.index = (self.index + 1) % len(self.buffer)


# ----------------------------------------------------------------------------------- the dumps


def save_stat_dump(path: Path, logical_count: torch.Tensor, rate: float | None = None) -> Path:
    """_StatAccumulator.dump (rank 0, output_mode "file")."""
    torch.save(
        dict(rank=0, logical_count=logical_count, average_utilization_rate_over_window=rate), str(path)
    )
    return path


def save_detail_dump(path: Path, records: list[dict], mapping: torch.Tensor | None) -> Path:
    """_DetailAccumulator.dump: one file per rank."""
    torch.save(dict(records=records, last_physical_to_logical_map=mapping), str(path))
    return path


def per_pass_record(forward_pass_id: int, rank: int, global_physical_count: torch.Tensor) -> dict:
    return dict(
        forward_pass_id=forward_pass_id,
        rank=rank,
        gatherer_key="primary",
        global_physical_count=global_physical_count.clone(),
    )


@dataclass
class Request:
    """One request's tokens and the logical routing SGLang computed for them.

    token_ids [T]: prompt + generated (the last one sampled, never run); experts [T − 1, L_hidden, k]
    logical ids of the positions that ran (dense layers ignored)."""

    token_ids: np.ndarray
    prompt_len: int
    experts: np.ndarray


def make_request(
    rng: np.random.Generator, prompt_len: int, generated: int, layers: int, k: int, e: int
) -> Request:
    total = prompt_len + generated
    ids = rng.integers(3, 2000, size=total)
    return Request(ids.astype(np.int64), prompt_len, random_routing(rng, total - 1, layers, k, e))


def per_token_record(
    forward_pass_id: int,
    rank: int,
    forward_mode: int,
    segments: list[tuple[Request, int, int]],
    mapping: torch.Tensor,
    moe_layers: list[int],
    rng: np.random.Generator,
) -> dict:
    """_DetailSinglePassGatherer over one pass: segments (request, first position, count) in batch order.

    on_forward_pass_start stores the batch's input_ids/positions/extend_seq_lens/forward_mode; reset() set
    the [L, T, 8] buffer to -1 and on_select_experts writes [:T, :k] of each MoE layer with physical ids
    (topk_ids after the logical-to-physical dispatch)."""
    ids = [int(r.token_ids[p]) for r, first, n in segments for p in range(first, first + n)]
    positions = [p for _, first, n in segments for p in range(first, first + n)]
    num_layers = mapping.shape[0]
    topk = torch.full((num_layers, len(ids), TOPK_COLUMNS), -1, dtype=torch.int32)
    for layer in moe_layers:
        logical = (
            np.concatenate([r.experts[first : first + n, layer] for r, first, n in segments])
            if segments
            else np.zeros((0, 1), np.int32)
        )
        if len(logical):
            physical = to_physical(logical, mapping, layer, rng)
            topk[layer, :, : physical.shape[1]] = torch.as_tensor(physical)
    return dict(
        forward_pass_id=forward_pass_id,
        rank=rank,
        gatherer_key="primary",
        input_ids=ids,
        positions=positions,
        extend_seq_lens=None if forward_mode == DECODE else [n for _, _, n in segments],
        forward_mode=forward_mode,
        topk_ids_of_layer=topk,
        misc_objects=[],
    )


# ---------------------------------------------------------------------------------- routed experts


def wire_encode(rows: np.ndarray, dtype: str = "int32") -> tuple[str, str]:
    """encode_routed_experts_for_wire: the flat row-major array in `dtype`, int32 when an id does not fit."""
    target = np.dtype(dtype)
    array = rows.astype(np.int32)
    if target.kind == "u" and array.size:
        bounds = np.iinfo(target)
        if array.min() < bounds.min or array.max() > bounds.max:
            target = np.dtype("int32")
    return base64.b64encode(array.astype(target).tobytes()).decode("utf-8"), target.name


def returned_rows(
    request: Request, num_hidden_layers: int, dense_layers: list[int], start: int = 0
) -> np.ndarray:
    """get_topk: host-buffer rows [start, seq_len − 1) of every hidden layer; dense layers stay 0."""
    rows = request.experts[:, :num_hidden_layers].copy()
    rows[:, dense_layers] = 0
    seqlen = len(request.token_ids)
    start = min(start, seqlen - 1)
    return rows[start : seqlen - 1]


def generate_response(
    request: Request,
    rows: np.ndarray,
    dtype: str | None = None,
    with_prompt_ids: bool = False,
    rid: str = "5f1c",
) -> dict:
    """A /generate response (tokenizer_manager out_dict) with meta_info["routed_experts"]."""
    prompt, output = request.token_ids[: request.prompt_len], request.token_ids[request.prompt_len :]
    payload, sent = wire_encode(rows, dtype or "int32")
    meta = {
        "id": rid,
        "finish_reason": {"type": "length", "length": len(output)},
        "prompt_tokens": len(prompt),
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": len(output),
        "cached_tokens": 0,
        "routed_experts": payload,
        "e2e_latency": 0.25,
    }
    if dtype is not None:
        meta["routed_experts_dtype"] = sent
    out = {"text": " generated", "output_ids": [int(t) for t in output], "meta_info": meta}
    if with_prompt_ids:
        out["prompt_token_ids"] = [int(t) for t in prompt]
    return out


def completion_response(request: Request, rows: np.ndarray) -> dict:
    """An OpenAI /v1/completions response (return_routed_experts, return_token_ids): response-level sglext."""
    prompt, output = request.token_ids[: request.prompt_len], request.token_ids[request.prompt_len :]
    payload, _ = wire_encode(rows)
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "default",
        "choices": [
            {
                "index": 0,
                "text": " generated",
                "logprobs": None,
                "finish_reason": "length",
                "matched_stop": None,
                "token_ids": [int(t) for t in output],
                "prompt_token_ids": [int(t) for t in prompt],
            }
        ],
        "usage": {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + len(output),
            "completion_tokens": len(output),
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
        },
        "metadata": {"weight_version": "default"},
        "sglext": {"routed_experts": payload},
    }


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value))
    return path


def write_jsonl(path: Path, values: list) -> Path:
    path.write_text("".join(json.dumps(v) + "\n" for v in values))
    return path
