"""Megatron-Core routing files written the way Megatron writes them, for the "megatron-trace" and
"megatron-replay" importers' tests.

From NVIDIA/Megatron-LM@d98e8a64:
- `megatron/core/transformer/moe/router_trace.py` (`RouterTracer`): one JSON line per router call, keys in
  the order `_make_index_record` builds them, `top_indices` last (added at flush), written with
  `json.dumps(rec) + "\\n"`; the hook path rebuilds ids from the boolean routing map (`nonzero`: ascending
  expert id), `record_indices` keeps the order it is given; the logits sidecar `logits_rank{r}.bin` is the
  bf16 logits' int16 view `.tobytes()`, appended call after call, each line with `logit_offset`,
  `logit_bytes`, `logit_shape`. (`RouterTracer` itself needs torch and Megatron's module layout; its output
  was compared byte for byte with this writer's, see docs/engine-formats.md.)
- `megatron/core/inference/text_generation_server/dynamic_text_gen_server/endpoints/{completions,
  chat_completions}.py`: per choice `moe_topk_indices` = the request's `routing_indices`
  [prompt + generated − 1, num_moe_layers, k] and `prompt_moe_topk_indices` =
  `routing_indices[:prompt_length]`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch


def bf16_bytes(logits: np.ndarray) -> bytes:
    """Megatron's sidecar bytes of logits [N, E]: bf16, its int16 view, `.tobytes()`."""
    return (
        torch.from_numpy(np.ascontiguousarray(logits, np.float32))
        .to(torch.bfloat16)
        .view(torch.int16)
        .numpy()
        .tobytes()
    )


def bf16_values(logits: np.ndarray) -> np.ndarray:
    """The fp32 values of logits rounded to bf16 (torch's rounding), to compare a decoded sidecar with."""
    return torch.from_numpy(np.ascontiguousarray(logits, np.float32)).to(torch.bfloat16).float().numpy()


class RouterTraceWriter:
    """`router_trace_rank{rank}.jsonl` (+ `logits_rank{rank}.bin`) in `folder`, line by line."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.path = self.folder / f"router_trace_rank{rank}.jsonl"
        self.logits_path = self.folder / f"logits_rank{rank}.bin"
        self.lines: list[str] = []
        self.logits = bytearray()

    def _record(self, ids: np.ndarray, step: int, block: str, mtp_idx: int | None, layer: int) -> dict:
        record = {
            "step": int(step),
            "stage": "pre_dispatch",
            "block": block,
            "layer": int(layer),
            "rank": self.rank,
            "num_tokens": int(ids.shape[0]),
            "topk": int(ids.shape[1]),
        }
        if mtp_idx is not None:
            record["mtp_idx"] = int(mtp_idx)
        return record

    def hook_call(
        self,
        step: int,
        layer: int,
        ids: np.ndarray,
        *,
        logits: np.ndarray | None = None,
        block: str = "decoder",
        mtp_idx: int | None = None,
    ) -> None:
        """One TopKRouter forward seen by the training hook: ids [N, k] (any order; the hook's routing map
        gives them back in ascending expert id), optional raw logits [N, E] to the sidecar."""
        record = self._record(ids, step, block, mtp_idx, layer)
        if logits is not None:
            data = bf16_bytes(logits)
            record["logit_offset"] = len(self.logits)
            record["logit_bytes"] = len(data)
            record["logit_shape"] = list(logits.shape)
            self.logits += data
        record["top_indices"] = np.sort(ids, axis=1).astype(np.int32).tolist()
        self.lines.append(json.dumps(record) + "\n")

    def record_indices(
        self,
        indices: np.ndarray,
        step: int,
        layer_ids: Sequence[int] | None = None,
        block: str = "decoder",
        mtp_idx: int | None = None,
    ) -> None:
        """`RouterTracer.record_indices`: indices [N, layers, k] as recorded, one line per layer."""
        for i in range(indices.shape[1]):
            layer = i if layer_ids is None else layer_ids[i]
            record = self._record(indices[:, i], step, block, mtp_idx, layer)
            record["top_indices"] = indices[:, i].astype(np.int32).tolist()
            self.lines.append(json.dumps(record) + "\n")

    def flush(self) -> Path:
        self.path.write_text("".join(self.lines))
        if self.logits:
            self.logits_path.write_bytes(bytes(self.logits))
        return self.path


def completion_response(
    choices: Sequence[tuple[Sequence[int], Sequence[int], np.ndarray]], *, wrapped: bool = False
) -> dict:
    """The dynamic server's /v1/completions response; choices: (prompt ids, generated ids, routing_indices
    [prompt + generated − 1, num_moe_layers, k]). `wrapped`: routing_indices as the ["ndarray", {data,
    dtype}] pair Megatron's serialisation leaves since 64870c14 (its slice [:prompt_length] is that pair)."""
    out = []
    for index, (prompt, generated, rows) in enumerate(choices):
        rows = rows.astype(np.int16)
        value = ["ndarray", {"data": rows.tolist(), "dtype": "int16"}] if wrapped else rows.tolist()
        choice = {
            "index": index,
            "text": "",
            "logprobs": None,
            "finish_reason": "length",
            "prompt_token_ids": list(prompt),
            "generation_token_ids": list(generated),
            "generation_log_probs": [],
            "moe_topk_indices": value,
        }
        if len(prompt):
            choice["prompt_moe_topk_indices"] = value[: len(prompt)]
        out.append(choice)
    prompt_tokens = max(len(p) for p, _, _ in choices)
    completion_tokens = sum(len(g) for _, g, _ in choices)
    return {
        "id": 0,
        "object": "text_completion",
        "created": 0,
        "model": "EMPTY",
        "choices": out,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def chat_response(
    prompt: Sequence[int], generated: Sequence[int], rows: np.ndarray, *, tokenized: bool
) -> dict:
    """The dynamic server's /v1/chat/completions response with one choice; `tokenized`: the request asked
    for return_tokenized_data (token ids on the message)."""
    rows = rows.astype(np.int16)
    message = {"role": "assistant", "content": ""}
    if tokenized:
        message["prompt_token_ids"] = list(prompt)
        message["generation_token_ids"] = list(generated)
    message["generation_log_probs"] = []
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
    choice["moe_topk_indices"] = rows.tolist()
    choice["prompt_moe_topk_indices"] = rows[: len(prompt)].tolist()
    return {
        "id": 0,
        "object": "chat.completion",
        "created": 0,
        "model": "EMPTY",
        "choices": [choice],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(generated)},
    }
