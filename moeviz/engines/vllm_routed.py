"""vLLM's returned routed experts (format "vllm-routed"), in each of the three forms vLLM has written them
(docs/engine-formats.md, "vLLM"; saved responses are read by `moeviz.engines.responses`):

- a `.npy` file of `CompletionOutput.routed_experts` saved with `np.save` — vLLM ≤ 0.20: int32
  [num_tokens − 1, num_hidden_layers, k], dense layers 0 (later releases' arrays load the same way);
- vLLM 0.21 responses: nested int16 lists, `prompt_routed_experts` [prompt_len, num_moe_layers, k] on the
  response (the first prompt's, shared by its choices) and `choices[i].routed_experts` [gen_len, …, k];
- vLLM ≥ 0.22 responses: `choices[i].routed_experts` = base64 of `.npy` bytes of the whole sequence,
  uint8 / uint16 / int32 [num_tokens − 1 − routed_experts_prompt_start, num_hidden_layers, k].

Each choice (or file) becomes one `RoutedSequence`; `moeviz.engines.routed.routed_trace` places the layer
axis, sets aside all −1 rows (prefix-cache hits), checks every (token, layer) and aligns the token ids.
The ids are logical (vLLM captures them before its EPLB remap) and slot 0 is the router's top choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeviz.engines.layout import RoutingLayout
from moeviz.engines.responses import (
    decode_base64,
    nested_ids,
    npy_bytes,
    npy_file,
    read_responses,
    token_list,
)
from moeviz.engines.routed import RoutedSequence, routed_trace
from moeviz.engines.tokens import agreed_token_ids, ids_for
from moeviz.errors import EngineFormatError
from moeviz.trace import Trace

SOURCE = "vllm-routed"


def read(fmt: str, files: Sequence[Path], layout: RoutingLayout, token_ids: list[np.ndarray] | None) -> Trace:
    """A Trace of the vLLM routing in `files` (.npy arrays, or saved JSON/JSONL responses)."""
    notes: list[str] = []
    found: list[_Found] = []
    for path in files:
        if path.suffix == ".npz":
            raise EngineFormatError(
                f"{path}: an .npz archive; vLLM users save CompletionOutput.routed_experts with np.save "
                "(one .npy per sequence), which is what this importer reads"
            )
        if path.suffix == ".npy":
            experts = npy_file(path)
            found.append(_Found(experts, None, None, path.name, form="npy"))
        else:
            for label, response in read_responses(path, SOURCE):
                found.extend(_response_sequences(response, label, notes))
    if not found:
        raise EngineFormatError(
            f"{SOURCE}: no choice in {', '.join(p.name for p in files)} carries routed experts (was the "
            "server started with --enable-return-routed-experts?)"
        )
    given = ids_for(token_ids, len(found), ", ".join(p.name for p in files))
    sequences = [_sequence(f, ids, layout, notes) for f, ids in zip(found, given, strict=True)]
    found.clear()  # routed_trace releases each sequence's ids once copied: no second reference here
    return routed_trace(layout, sequences, source=SOURCE, notes=notes)


@dataclass
class _Found:
    """One sequence as decoded from its file, before the token ids and the model settle where it starts."""

    experts: np.ndarray  # [R, L, k]
    token_ids: np.ndarray | None
    prompt_len: int | None
    label: str
    form: str  # "npy" | "v0.21" | "base64"
    start: int = 0
    prompt_rows: int = 0  # rows of this sequence that came from prompt_routed_experts
    usage_tokens: int | None = None  # the sequence's length by the response's usage (one choice only)


def _sequence(
    found: _Found, given: np.ndarray | None, layout: RoutingLayout, notes: list[str]
) -> RoutedSequence:
    ids = agreed_token_ids(found.label, found.token_ids, given)
    start = found.start
    length = len(ids) if ids is not None else found.usage_tokens
    if found.form == "base64" and length is not None:
        # The response does not repeat the request's routed_experts_prompt_start, but vLLM returns the rows
        # of positions start … num_tokens − 2, so the sequence's length gives it back.
        skipped = length - 1 - len(found.experts)
        if 0 < skipped <= (found.prompt_len if found.prompt_len is not None else -1):
            start = skipped
            notes.append(
                f"{found.label}: routing starts at position {start} (the request's "
                "routed_experts_prompt_start); earlier positions are in the token table without routing"
            )
    if found.form == "v0.21":
        _refuse_zero_prefix(found)
    experts = _packed_moe_axis(found.experts, layout, found.label, notes)
    return RoutedSequence(
        experts=experts, token_ids=ids, start=start, prompt_len=found.prompt_len, label=found.label
    )


def _refuse_zero_prefix(found: _Found) -> None:
    """vLLM 0.21.0 keeps each request's routing in a host buffer that starts as `np.zeros` and writes only the
    positions it computes, so prompt positions served from its prefix cache come back as 0 in every slot
    (its docs describe a -1 sentinel that this release does not write). All-zero rows inside the prompt with
    routed rows after them are that, not the all-zero capture of issue #54730: refuse with its cause."""
    ids = found.experts
    zero = ~ids.reshape(len(ids), -1).any(axis=1)
    if not zero.any() or zero.all():
        return  # none, or every row: left to check_expert_sets (issue #54730)
    rows = np.flatnonzero(zero)
    if rows[-1] < found.prompt_rows:
        raise EngineFormatError(
            f"{found.label}: prompt positions {int(rows[0])}–{int(rows[-1])} hold all-zero routing while "
            "later positions are routed: vLLM 0.21.0 returns 0 for prompt tokens served from its prefix "
            "cache (the routing of those tokens was never computed for this request); serve with "
            "--no-enable-prefix-caching to capture them"
        )


def _packed_moe_axis(ids: np.ndarray, layout: RoutingLayout, label: str, notes: list[str]) -> np.ndarray:
    """vLLM 0.21 sizes its layer axis by counting MoE layers from `mlp_only_layers` / `decoder_sparse_step`,
    which DeepSeek-style configs (`first_k_dense_replace`) lack, so the axis gets num_hidden_layers entries
    while each MoE layer writes at its MoE ordinal: the MoE layers packed first, the last entries left 0.
    Read as such an axis only when it is not a hidden-layer axis with dense sentinels (the ≥ 0.22 layout)."""
    h, moe = layout.num_hidden_layers, len(layout.moe_layers)
    if ids.ndim != 3 or ids.shape[1] != h or moe == h or not len(ids):
        return ids
    routed = ~(ids < 0).reshape(len(ids), -1).all(axis=1)
    dense = ids[routed][:, list(layout.dense_layers)]
    if dense.size == 0 or (dense.min() == dense.max() and int(dense.flat[0]) in (0, -1)):
        return ids  # a hidden-layer axis: routed_trace places it
    tail = ids[routed][:, moe:]
    if tail.size and not tail.any():
        notes.append(
            f"{label}: the layer axis has {h} entries with the {moe} MoE layers first and the last "
            f"{h - moe} all 0 (vLLM 0.21 on a config without mlp_only_layers): read as the MoE layers"
        )
        return ids[:, :moe]
    return ids


def _response_sequences(response: dict, label: str, notes: list[str]) -> list[_Found]:
    choices = _choices(response, label)
    chat = response.get("object") == "chat.completion"
    nested = "prompt_routed_experts" in response or any(
        isinstance(c.get("routed_experts"), list) for c in choices
    )
    prompt_rows = nested_ids(response.get("prompt_routed_experts"), f"{label}, prompt_routed_experts")
    owners = _prompt_owners(response, choices, chat, prompt_rows, label) if nested else []
    found = []
    for index, choice in enumerate(choices):
        where = f"{label}, choice {choice.get('index', index)}"
        prompt_ids = token_list(choice.get("prompt_token_ids"), f"{where}, prompt_token_ids")
        if prompt_ids is None:
            prompt_ids = token_list(response.get("prompt_token_ids"), f"{label}, prompt_token_ids")
        output_ids = token_list(choice.get("token_ids"), f"{where}, token_ids")
        token_ids = (
            np.concatenate([prompt_ids, output_ids])
            if prompt_ids is not None and output_ids is not None
            else None
        )
        prompt_len = len(prompt_ids) if prompt_ids is not None else _usage_prompt_len(response, choices, chat)
        value = choice.get("routed_experts")
        if nested:
            own_rows = prompt_rows if owners[index] else None  # the response's prompt routing, if this one's
            gen = nested_ids(value, f"{where}, routed_experts")
            parts = [p for p in (own_rows, gen) if p is not None]
            if not parts:
                notes.append(f"{where} carries no routed experts (an aborted or preempted request?): skipped")
                continue
            if own_rows is not None and prompt_len is None:
                prompt_len = len(own_rows)
            start = 0
            if own_rows is None:
                if prompt_len is None:
                    raise EngineFormatError(
                        f"{where}: its generated tokens' routing cannot be placed: the response gives "
                        "neither its prompt's routing nor its prompt_token_ids (request return_token_ids)"
                    )
                start = prompt_len
            experts = _concat(parts, where)
            found.append(
                _Found(
                    experts,
                    token_ids,
                    prompt_len,
                    where,
                    form="v0.21",
                    start=start,
                    prompt_rows=len(own_rows) if own_rows is not None else 0,
                )
            )
        elif value is None:
            notes.append(f"{where} carries no routed experts (an aborted request?): skipped")
        elif isinstance(value, str):
            data = decode_base64(value, f"{where}, routed_experts")
            experts = npy_bytes(data, f"{where}, routed_experts")
            found.append(
                _Found(
                    experts, token_ids, prompt_len, where, form="base64", usage_tokens=_usage_total(response)
                )
            )
        else:
            raise EngineFormatError(
                f"{where}: routed_experts is a {type(value).__name__}; vLLM writes nested lists (0.21) or a "
                "base64 string of .npy bytes (≥ 0.22)"
            )
    return found


def _choices(response: dict, label: str) -> list[dict]:
    if response.get("object") == "chat.completion.chunk":
        raise EngineFormatError(
            f"{label}: a streamed chunk; vLLM returns routed experts only in whole responses"
        )
    choices = response.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        hint = ""
        if "meta_info" in response:
            hint = " (it looks like SGLang's /generate response: format sglang-routed)"
        raise EngineFormatError(f"{label}: not a vLLM OpenAI response (no list of `choices`){hint}")
    if any("moe_topk_indices" in c for c in choices):
        raise EngineFormatError(
            f"{label}: a Megatron-Core response (moe_topk_indices): format megatron-replay"
        )
    return choices


def _prompt_owners(
    response: dict, choices: list[dict], chat: bool, prompt_rows: np.ndarray | None, label: str
) -> list[bool]:
    """Which choices the response-level prompt routing belongs to. vLLM 0.21's completions endpoint returns
    the prompt routing of the first prompt only (`final_res_batch[0]`), however many prompts the request
    had; a chat request has one prompt."""
    if prompt_rows is None:
        return [False] * len(choices)
    if chat or len(choices) == 1:
        return [True] * len(choices)
    prompts = [c.get("prompt_token_ids") for c in choices]
    if all(isinstance(p, list) for p in prompts):
        return [p == prompts[0] for p in prompts]
    usage = response.get("usage") or {}
    if usage.get("prompt_tokens") == len(prompt_rows):  # the prompts' total is the first prompt's: one prompt
        return [True] * len(choices)
    raise EngineFormatError(
        f"{label}: {len(choices)} choices of several prompts and one prompt_routed_experts (vLLM 0.21 "
        "returns the first prompt's): save the response with return_token_ids so its choices can be told "
        "apart"
    )


def _usage_prompt_len(response: dict, choices: list[dict], chat: bool) -> int | None:
    # usage.prompt_tokens sums the prompts of a completions request: one prompt's length only when the
    # request had one prompt, which a chat request always has and a single choice implies.
    value = (response.get("usage") or {}).get("prompt_tokens")
    if isinstance(value, int) and (chat or len(choices) == 1):
        return value
    return None


def _usage_total(response: dict) -> int | None:
    """prompt + completion tokens by usage: the length of the only choice's sequence."""
    usage = response.get("usage") or {}
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if len(response.get("choices") or []) == 1 and isinstance(prompt, int) and isinstance(completion, int):
        return prompt + completion
    return None


def _concat(parts: list[np.ndarray], where: str) -> np.ndarray:
    if len(parts) == 1:
        return parts[0]
    if parts[0].shape[1:] != parts[1].shape[1:]:
        raise EngineFormatError(
            f"{where}: prompt_routed_experts rows {list(parts[0].shape[1:])} and routed_experts rows "
            f"{list(parts[1].shape[1:])} differ in [layers, k]"
        )
    return np.concatenate(parts)
