"""Capture the routing a model actually used: run one forward or a `generate()` call with the hooks installed,
then decode what they saw into a Trace (and, with `attention=True`, its `AttentionCapture`)."""

from __future__ import annotations

import functools
import inspect
import itertools
import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from moeviz.capture.attention import recording_attention
from moeviz.capture.attention_build import build_attention
from moeviz.capture.hooks import Recorder, recording
from moeviz.errors import CaptureError, InputError, PromptTooLongError
from moeviz.models.decoding import (
    DECODERS,
    NEEDS_TOP_K,
    expert_args_look_like_decision,
    from_expert_args,
    from_router_tuple,
    recompute_softmax_topk,
)
from moeviz.models.loading import LoadedModel
from moeviz.models.memory import refuse_if_input_too_large
from moeviz.models.sites import MoESite
from moeviz.scoring import ScoreFn, scores_from_logits
from moeviz.trace import TOKEN_COLUMNS, LayerRouting, LazyTokens, ModelInfo, Trace
from moeviz.trace.finite import (  # noqa: F401  (re-exported: capture's warning, by its old home)
    non_finite_layers,
    non_finite_warning,
    routing_warning,
)

# A generous upper bound on the mean characters per token, to refuse a text too long for the context by
# its size alone, before tokenising it. Tokenizers average ~3–5 characters per token on prose and code;
# only a text made almost entirely of a vocabulary's longest tokens (runs of spaces or punctuation, a few
# dozen characters) comes near 64, so a text that fits the context is not refused by this bound.
MAX_CHARS_PER_TOKEN = 64


class RoutingWarning(UserWarning):
    """The captured routing is implausible: router logits (and so scores) that are not finite (NaN or
    infinite, e.g. from a NaN router weight), so the experts chosen mean nothing."""


@dataclass
class _Stream:
    """One token stream of a batch: ids [B, L], which cells are real tokens, and how router calls map to it.

    `calls` lists, per router call in order, the columns of `ids` that call saw (flattened row-major, as
    the model flattens [B, S, H] to [B·S, H]).
    """

    name: str
    ids: np.ndarray  # [B, L]
    valid: np.ndarray  # [B, L] bool
    positions: np.ndarray  # [B, L] position within the sequence, padding excluded
    generated: np.ndarray  # [B, L] bool: phase "generated" (else "prompt")
    step: np.ndarray  # [B, L] generation step whose forward routed the token
    calls: list[slice]
    predicted: np.ndarray  # [B, L] the model's argmax next token at this position; -1 = not computed


def capture(
    loaded: LoadedModel,
    texts: str | Sequence[str] | None = None,
    *,
    token_ids: Sequence[Sequence[int]] | Sequence[int] | None = None,
    generate: int = 0,
    attention: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Trace:
    """Run the model once on a batch (or `generate` new tokens) and return the routing it used.

    Give `texts` (needs a tokenizer) or `token_ids` (one list per sequence). Padding is masked out. With
    `generate > 0`, greedy decoding runs for up to that many tokens; the prompt's routing comes from the
    prefill forward (step 0), each generated token's from the step that fed it back.

    With `attention=True` (one forward, decoder-only models), the post-RoPE queries and keys each attention
    function received are kept too, and `trace.attention` computes exact maps and per-head summaries from
    them on demand (see `moeviz.attention`). The model keeps its own (sdpa) attention path.

    `progress(done, total)` is called as each MoE layer's router runs: total = MoE layers × forwards (one,
    or `generate`: the last new token is never fed back; a run that stops at end-of-sequence ends early).
    """
    batch = token_batch(loaded, texts, token_ids)
    _check_lengths(loaded, batch, generate)
    if generate < 0:
        raise InputError(f"generate must be >= 0, got {generate}")
    what = f"capturing {loaded.info.source}" + (f" with generate={generate}" if generate > 0 else "")
    width = max(len(seq) for seq in batch) + generate
    dtype = getattr(loaded.model, "dtype", torch.float32)
    refuse_if_input_too_large(loaded.activation_shape, dtype, loaded.device, len(batch), width, what)
    model = loaded.model
    if generate:
        loaded.refuse_token_classifier("generate")
    if attention and (generate or loaded.is_encoder_decoder or loaded.is_token_classifier):
        raise InputError("attention capture covers one forward of a decoder-only model: use generate=0")
    with ExitStack() as stack:
        recorder = stack.enter_context(recording(model, loaded.sites))
        if progress is not None:
            passes = sum(site.passes for site in loaded.sites)
            total, done = passes * max(1, generate), itertools.count(1)
            recorder.on_router = lambda _site: progress(next(done), total)
        attn_recorder = stack.enter_context(recording_attention(model)) if attention else None
        stack.enter_context(torch.inference_mode())
        streams = _run(loaded, batch, generate)
    tokens, row_grids = _token_table(loaded, streams)
    calls: dict[str, list[tuple[np.ndarray, np.ndarray | None]]] = {}  # per stream: rows, keep of each call
    decided = _decisions_across_layers(loaded.sites, recorder)
    layers = [
        routing
        for i, site in enumerate(loaded.sites)
        for routing in _decode_passes(site, i, recorder, streams, row_grids, calls, decided.get(i))
    ]
    if any(site.passes > 1 for site in loaded.sites):  # looped blocks: occurrences in execution order
        layers.sort(key=lambda routing: routing.layer)
    message = routing_warning(layers)
    if message is not None:
        warnings.warn(message, RoutingWarning, stacklevel=2)
    info = ModelInfo(**{**loaded.info.__dict__, "notes": list(loaded.info.notes)})
    for layer in layers:
        if layer.decision_source == "recomputed":
            info.notes.append(
                f"layer {layer.layer} ({layer.site}): routing recomputed as softmax top-{layer.k} from the "
                "router logits; the model's own dispatch could not be observed"
            )
    attention_capture = None
    if attn_recorder is not None:
        stream = streams["input"]
        offsets = stream.valid.argmax(axis=1)  # right padding: 0; column of each sequence's position 0
        attention_capture = build_attention(
            model, attn_recorder, info.num_layers, offsets, stream.valid.sum(axis=1)
        )
    return Trace(model=info, tokens=tokens, layers=layers, attention=attention_capture)


# ---- input ----------------------------------------------------------------------------------------------
def token_batch(loaded: LoadedModel, texts, token_ids) -> list[list[int]]:
    """Validated token ids, one list per sequence, from texts (tokenized) or token ids."""
    if (texts is None) == (token_ids is None):
        raise InputError("give exactly one of texts or token_ids")
    if texts is not None:
        if loaded.tokenizer is None:
            raise InputError(f"{loaded.info.source} ships no tokenizer: pass token_ids instead of text")
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts or any(not t for t in texts):
            raise InputError("empty text: give at least one non-empty text")
        _refuse_by_size(loaded, texts)
        batch = [list(loaded.tokenizer(t)["input_ids"]) for t in texts]
    else:
        batch = [list(token_ids)] if token_ids and isinstance(token_ids[0], (int, np.integer)) else token_ids
        batch = [_int_list(seq) for seq in batch]
    if not batch or any(len(seq) == 0 for seq in batch):
        raise InputError("empty input: every sequence needs at least one token")
    vocab = loaded.vocab_size
    if not all(_in_range(seq, vocab) for seq in batch):
        bad = sorted({i for seq in batch for i in seq if not 0 <= i < vocab})
        raise InputError(f"token ids out of range [0, {vocab}): {bad[:10]}")
    return batch


def _in_range(seq: list[int], vocab: int) -> bool:
    """Every id in [0, vocab), checked in numpy (a C loop); False for an id beyond int64 too."""
    try:
        array = np.fromiter(seq, dtype=np.int64, count=len(seq))
    except OverflowError:
        return False
    return bool(array.min() >= 0 and array.max() < vocab)


def _int_list(seq) -> list[int]:
    """A sequence of ids as Python ints: through numpy for integer input (a C loop), else one by one."""
    array = np.asarray(seq)
    if array.ndim == 1 and array.dtype.kind in "iu":
        return array.tolist()
    return [int(i) for i in seq]


def _refuse_by_size(loaded: LoadedModel, texts: list[str]) -> None:
    """PromptTooLongError for a text with more characters than the model's context can hold at
    MAX_CHARS_PER_TOKEN, before it is tokenised: tokenising 50 MB of text takes ~45 s and ~8 GB only to
    find it too long."""
    limit = loaded.max_length
    if limit is None:
        return
    longest = max(len(t) for t in texts)
    if longest > limit * MAX_CHARS_PER_TOKEN:
        at_least = -(-longest // MAX_CHARS_PER_TOKEN)
        raise PromptTooLongError(
            f"prompt (at least {at_least:,} tokens: {longest:,} characters, at most {MAX_CHARS_PER_TOKEN} "
            f"per token) exceeds the model's context length of {limit} tokens"
        )


def _check_lengths(loaded: LoadedModel, batch: list[list[int]], generate: int) -> None:
    limit = loaded.max_length
    longest = max(len(seq) for seq in batch) + max(generate, 0)
    if limit is not None and longest > limit:
        what = f"prompt of {longest - generate} tokens + {generate} to generate" if generate > 0 else "prompt"
        raise PromptTooLongError(
            f"{what} ({longest} tokens) exceeds the model's context length of {limit} tokens"
        )


def _pad(batch: list[list[int]], pad_id: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(seq) for seq in batch)
    ids = np.full((len(batch), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), width), dtype=bool)
    for b, seq in enumerate(batch):
        cols = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[b, cols] = seq
        mask[b, cols] = True
    return ids, mask


def _pad_id(config) -> int:
    for value in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return 0


def _eos_ids(config) -> set[int]:
    value = getattr(config, "eos_token_id", None)
    if isinstance(value, int):
        return {value}
    return set(value or [])


# ---- running the model ----------------------------------------------------------------------------------
def _run(loaded: LoadedModel, batch: list[list[int]], generate: int) -> dict[str, _Stream]:
    config = loaded.model.config.get_text_config() if not loaded.is_encoder_decoder else loaded.model.config
    pad_id = _pad_id(config)
    left = generate > 0 and not loaded.is_encoder_decoder  # decoder-only generation needs left padding
    ids, mask = _pad(batch, pad_id, left)
    device = loaded.device  # the embedding's device (accelerate brings offloaded weights to it)
    input_ids = torch.from_numpy(ids).to(device)
    attention = torch.from_numpy(mask.astype(np.int64)).to(device)
    width = ids.shape[1]
    if generate == 0:
        model_class: type = type(loaded.model)
        if loaded.is_encoder_decoder:
            dec_ids, dec_mask = _shift_right(ids, mask, _decoder_start(loaded.model.config), pad_id)
            out = loaded.model(
                input_ids=input_ids,
                attention_mask=attention,
                decoder_input_ids=torch.from_numpy(dec_ids).to(device),
                decoder_attention_mask=torch.from_numpy(dec_mask.astype(np.int64)).to(device),
                **_without_cache(model_class),
            )
            decoder = _stream("decoder", dec_ids, dec_mask, [slice(0, dec_ids.shape[1])])
            decoder.predicted[:] = _argmax(out.logits)
            return {"input": _stream("input", ids, mask, [slice(0, width)]), "decoder": decoder}
        out = loaded.model(input_ids=input_ids, attention_mask=attention, **_without_cache(model_class))
        stream = _stream("input", ids, mask, [slice(0, width)])
        if not loaded.is_token_classifier:  # a token classifier's logits are labels, not next tokens
            stream.predicted[:] = _argmax(out.logits)
        return {"input": stream}
    out = loaded.model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        max_new_tokens=generate,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad_id,
    )
    sequences = out.cpu().numpy()
    eos = _eos_ids(config)
    if loaded.is_encoder_decoder:
        n_new = sequences.shape[1] - 1
        gen_valid = _alive(sequences[:, 1:], eos)
        dec_valid = np.concatenate([np.ones((len(batch), 1), bool), gen_valid], axis=1)
        decoder = _stream("decoder", sequences, dec_valid, [slice(s, s + 1) for s in range(n_new)])
        decoder.generated[:, 1:] = True
        decoder.step[:] = np.arange(sequences.shape[1])[None, :]
        decoder.predicted[:, :-1] = sequences[:, 1:]  # greedy: the next token is the model's argmax
        return {"input": _stream("input", ids, mask, [slice(0, width)]), "decoder": decoder}
    n_new = sequences.shape[1] - width
    full_valid = np.concatenate([mask, _alive(sequences[:, width:], eos)], axis=1)
    calls = [slice(0, width)] + [slice(width + s - 1, width + s) for s in range(1, n_new)]
    stream = _stream("input", sequences, full_valid, calls)
    stream.generated[:, width:] = True
    stream.step[:, width:] = np.arange(1, n_new + 1)[None, :]
    # Greedy decoding: from the last prompt position on, the next token is the model's argmax.
    stream.predicted[:, width - 1 : -1] = sequences[:, width:]
    return {"input": stream}


@functools.cache
def _without_cache(model_class: type[Any]) -> dict[str, bool]:
    """`use_cache=False` for a model whose forward names the argument: the KV cache of a single forward is
    never read, and building it costs ~2% of a small model's forward (every layer's keys and values copied
    into it). Empty for a forward without it (remote code), which then runs as it is."""
    parameters = inspect.signature(model_class.forward).parameters
    return {"use_cache": False} if "use_cache" in parameters else {}


def _alive(generated: np.ndarray, eos: set[int]) -> np.ndarray:
    """[B, G] bool: a generated token is real up to and including its sequence's first EOS."""
    is_eos = np.isin(generated, list(eos)) if eos else np.zeros_like(generated, dtype=bool)
    ended_before = np.cumsum(is_eos, axis=1) - is_eos
    return ended_before == 0


def _shift_right(ids: np.ndarray, mask: np.ndarray, start: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced decoder input: the start token followed by the text, one position late, as long as
    the text (right padding, so each sequence keeps its own length)."""
    dec_ids = np.full_like(ids, pad_id)
    dec_ids[:, 0] = start
    dec_ids[:, 1:] = ids[:, :-1]
    dec_mask = mask.copy()
    dec_ids[~dec_mask] = pad_id
    return dec_ids, dec_mask


def _decoder_start(config) -> int:
    value = getattr(config, "decoder_start_token_id", None)
    return int(value) if value is not None else _pad_id(config)


def _stream(name: str, ids: np.ndarray, valid: np.ndarray, calls: list[slice]) -> _Stream:
    positions = np.cumsum(valid, axis=1) - 1
    return _Stream(
        name=name,
        ids=ids,
        valid=valid,
        positions=positions,
        generated=np.zeros(ids.shape, dtype=bool),
        step=np.zeros(ids.shape, dtype=np.int64),
        calls=calls,
        predicted=np.full(ids.shape, -1, dtype=np.int64),
    )


def _argmax(logits: torch.Tensor) -> np.ndarray:
    """[B, S, V] next-token logits → [B, S] argmax ids."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1)  # numpy's argmax is ~40x faster than torch's on CPU
    return logits.argmax(dim=-1).cpu().numpy()


# ---- tokens ---------------------------------------------------------------------------------------------
def _token_table(
    loaded: LoadedModel, streams: dict[str, _Stream]
) -> tuple[LazyTokens, dict[str, np.ndarray]]:
    """Token table (valid cells of every stream), built on first use (`LazyTokens`: the token strings are
    decoded then), and, per stream, a [B, L] grid of table rows (-1 = none), built now."""
    grids, cells, offset = {}, [], 0
    for stream in streams.values():
        if stream.valid.all():  # no padding: the table rows are the cells in row-major order
            b_idx, cols = np.divmod(np.arange(stream.valid.size), stream.valid.shape[1])
            grid = np.arange(offset, offset + stream.valid.size, dtype=np.int64).reshape(stream.valid.shape)
        else:
            b_idx, cols = np.nonzero(stream.valid)
            grid = np.full(stream.ids.shape, -1, dtype=np.int64)
            grid[b_idx, cols] = offset + np.arange(len(b_idx))
        grids[stream.name] = grid
        cells.append((stream, b_idx, cols))
        offset += len(b_idx)
    decode = loaded.token_decoder()  # not `loaded`: an unread token table must not keep the model alive

    def build() -> pd.DataFrame:
        columns: dict[str, list[np.ndarray]] = {c: [] for c in TOKEN_COLUMNS if c != "token"}
        for stream, b_idx, cols in cells:
            columns["seq"].append(b_idx.astype(np.int64))
            columns["pos"].append(stream.positions[b_idx, cols].astype(np.int64))
            columns["stream"].append(np.full(len(b_idx), stream.name, dtype=object))
            columns["token_id"].append(stream.ids[b_idx, cols])
            columns["phase"].append(
                np.where(stream.generated[b_idx, cols], "generated", "prompt").astype(object)
            )
            columns["step"].append(stream.step[b_idx, cols])
            columns["predicted_id"].append(stream.predicted[b_idx, cols])
        table = {name: np.concatenate(parts) for name, parts in columns.items()}
        table["token"] = _token_strings(decode, table["token_id"])
        return pd.DataFrame({name: table[name] for name in TOKEN_COLUMNS})

    return LazyTokens(build), grids


def _token_strings(decode: Callable[[list[int]], list[str]], ids: np.ndarray) -> np.ndarray:
    unique, inverse = np.unique(ids, return_inverse=True)
    return np.asarray(decode(unique.tolist()), dtype=object)[inverse]


# ---- decoding -------------------------------------------------------------------------------------------
def _decode_passes(
    site: MoESite,
    index: int,
    recorder: Recorder,
    streams: dict[str, _Stream],
    row_grids: dict[str, np.ndarray],
    calls: dict[str, list[tuple[np.ndarray, np.ndarray | None]]],
    decided: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[LayerRouting]:
    """The routing of each pass of `site` (one, unless its block is looped: the router then runs
    `site.passes` times per forward, pass after pass, and each pass is its own layer occurrence)."""
    outputs, args = recorder.router_outputs[index], recorder.expert_args[index]
    if site.passes == 1:
        return [_decode_site(site, outputs, args, streams, row_grids, calls, decided)]
    return [
        _decode_site(
            site, outputs[p :: site.passes], args[p :: site.passes], streams, row_grids, calls, None, p
        )
        for p in range(site.passes)
    ]


def _decode_site(
    site: MoESite,
    outputs: list,
    args: list,
    streams: dict[str, _Stream],
    row_grids: dict[str, np.ndarray],
    calls: dict[str, list[tuple[np.ndarray, np.ndarray | None]]],
    decided: tuple[np.ndarray, np.ndarray] | None = None,
    loop_pass: int = 0,
) -> LayerRouting:
    stream = streams[site.stream]
    if not outputs:
        raise CaptureError(
            f"the router hook of layer {site.layer} ({site.name}) did not fire: something replaced the "
            "forward "
            "(e.g. use_kernels=True or a compiled kernel); moeviz cannot see this model's routing"
        )
    if len(outputs) != len(stream.calls):
        raise CaptureError(
            f"layer {site.layer} ({site.name}): router ran {len(outputs) * site.passes} times, expected "
            f"{len(stream.calls) * site.passes}"
        )
    if site.decoder != "auto" and site.needs_expert_args and len(args) != len(outputs):
        raise CaptureError(
            f"layer {site.layer} ({site.name}): the experts hook fired {len(args)} times for {len(outputs)} "
            "router calls; the dispatch could not be observed"
        )
    per_call = calls.get(site.stream)
    if per_call is None:  # the table rows each router call saw, shared by every site of the stream
        grid = row_grids[site.stream]
        per_call = calls[site.stream] = []
        for cols in stream.calls:
            rows = grid[:, cols].reshape(-1)
            valid = rows >= 0
            per_call.append((rows, None if valid.all() else valid))
    logits_parts, expert_parts, weight_parts, row_parts = [], [], [], []
    source = "dispatch" if site.needs_expert_args else "router_output"
    for call, ((rows, keep), output) in enumerate(zip(per_call, outputs, strict=True)):
        logits = _logits(site, output)
        if decided is not None:  # one call, decoded with the other layers (`_decisions_across_layers`)
            (experts, weights), source = decided, "dispatch"
        else:
            call_args = args[call] if call < len(args) else ()
            experts, weights, source = _decision(site, output, call_args, logits)
        if len(rows) != logits.shape[0]:
            raise CaptureError(
                f"layer {site.layer} ({site.name}): router saw {logits.shape[0]} tokens, expected {len(rows)}"
            )
        if keep is not None:
            logits, experts, weights, rows = logits[keep], experts[keep], weights[keep], rows[keep]
        logits_parts.append(logits)
        expert_parts.append(experts)
        weight_parts.append(weights)
        row_parts.append(rows)
    logits = _join(logits_parts)
    bias = None if site.bias is None else site.bias.detach().float().reshape(-1).cpu().numpy()
    score_fn = (
        site.score_fn if site.decoder != "auto" else _infer_score_fn(logits, expert_parts, weight_parts)
    )
    return LayerRouting(
        layer=site.pass_layers[loop_pass],
        site=site.site,
        token_rows=_join(row_parts),
        logits=logits,
        experts=_join(expert_parts),
        weights=_join(weight_parts),
        score_fn=score_fn,
        bias=bias,
        decision_source=source,
        top_k=site.top_k,
        capacity=site.capacity,
        shared_experts=site.shared_experts,
        module=site.name,
        n_group=site.n_group,
        topk_group=site.topk_group,
        group_score=site.group_score,
        zero_experts=site.zero_experts,
        hash_routed=site.hash_routed,
        bias_on=site.bias_on,
        loop_pass=loop_pass,
    )


def _decisions_across_layers(
    sites: list[MoESite], recorder: Recorder
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The dispatch (experts [N, k], weights [N, k]) of every site decoded by `from_expert_args` that ran
    once (one forward), for all such layers at once: their [N, k] index and weight tensors stacked per
    shape into one [L, N, k] array each (one conversion and one order check for all layers; only a layer
    whose slots are not in order is sorted). Sites left out are decoded one by one in `_decode_site`."""
    groups: dict[tuple, list[int]] = {}
    for i, site in enumerate(sites):
        args = recorder.expert_args[i]
        if site.decoder != "expert_args" or len(args) != 1 or len(recorder.router_outputs[i]) != 1:
            continue
        if len(args[0]) < 3 or not (torch.is_tensor(args[0][1]) and torch.is_tensor(args[0][2])):
            continue
        idx, w = args[0][1], args[0][2]
        groups.setdefault((tuple(idx.shape), tuple(w.shape), idx.dtype, w.dtype, idx.device), []).append(i)
    decided = {}
    for members in groups.values():
        k = recorder.expert_args[members[0]][0][1].shape[-1]
        experts = np.stack(
            [_numpy_view(recorder.expert_args[i][0][1]).reshape(-1, k) for i in members]
        )  # [L, N, k]
        experts = experts.astype(np.int64, copy=False)
        weights = np.stack(
            [_numpy_view(recorder.expert_args[i][0][2], float32=True).reshape(-1, k) for i in members]
        )
        if k > 1:
            ordered = (weights[:, :, :-1] > weights[:, :, 1:]).all(axis=(1, 2)) & (experts >= 0).all(
                axis=(1, 2)
            )
        else:
            ordered = np.ones(len(members), dtype=bool)
        unordered = np.flatnonzero(~ordered)
        if len(unordered):  # sorted together: one call for all layers instead of one per layer
            experts[unordered], weights[unordered] = sort_slots_np(experts[unordered], weights[unordered])
        for j, i in enumerate(members):
            decided[i] = (experts[j], weights[j])
    return decided


def _join(parts: list[np.ndarray]) -> np.ndarray:
    """The parts one after the other; a single part as it is (no copy)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _logits(site: MoESite, output) -> np.ndarray:
    """Raw router logits [N, E] as fp32 numpy."""
    tensor = site.router_logits(output)
    if tensor is None:
        raise CaptureError(
            f"layer {site.layer} ({site.name}): no [N, {site.num_experts}] logits in router output"
        )
    return _numpy_view(tensor, float32=True)


def _numpy_view(tensor: torch.Tensor, *, float32: bool = False) -> np.ndarray:
    """A tensor's values as a numpy array that is a view of the tensor where it can be (a CPU tensor, of
    fp32 if asked; else a converted copy), dtype and strides kept: torch's per-op cost dominates on the
    small [N, k] and [N, E] arrays of a capture."""
    if float32 and tensor.dtype != torch.float32:
        tensor = tensor.float()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return (tensor.detach() if tensor.requires_grad else tensor).numpy()


def _decision(site: MoESite, output, args, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
    if site.decoder == "expert_args":  # most families: `from_expert_args`, in numpy (torch's per-op cost
        idx, w = args[1], args[2]  # dominates on [N, k] arrays)
        experts = _numpy_view(idx).reshape(-1, idx.shape[-1]).astype(np.int64, copy=False)
        weights = _numpy_view(w, float32=True).reshape(-1, w.shape[-1])
        return (*sort_slots_np(experts, weights), "dispatch")
    if site.decoder != "auto":
        k = {"k": site.top_k} if site.decoder in NEEDS_TOP_K else {}
        experts, weights = DECODERS[site.decoder](output, args, **k)
        source = "dispatch" if site.needs_expert_args else "router_output"
    elif expert_args_look_like_decision(args):
        (experts, weights), source = from_expert_args(output, args), "dispatch"
    else:
        try:
            (experts, weights), source = from_router_tuple(output, args), "router_output"
        except ValueError:
            if site.bias is not None or site.score_fn != "softmax":
                raise CaptureError(
                    f"layer {site.layer} ({site.name}): the dispatch could not be observed, and this router "
                    f"({site.score_fn}{' with a balancing bias' if site.bias is not None else ''}) does not "
                    "choose by softmax top-k: moeviz does not recompute routing by a rule the model lacks"
                ) from None
            decode = recompute_softmax_topk(site.top_k or 2)
            (experts, weights), source = decode(torch.from_numpy(logits)), "recomputed"
    return experts.cpu().numpy(), weights.detach().float().cpu().numpy(), source


def sort_slots_np(experts: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`moeviz.models.decoding.sort_slots` in numpy, with the same result: the k slots of each row of
    [..., k] by descending weight, dropped slots (-1) last, ties by expert id; arrays already in that order
    are returned as they are."""
    if experts.shape[-1] == 1:
        return experts, weights
    if (weights[..., :-1] > weights[..., 1:]).all() and (experts >= 0).all():
        return experts, weights
    keys = _slot_keys(experts, weights)
    if keys is not None:  # one integer sort; numpy's argsort along short rows is ~5x slower than its sort
        keys.sort(axis=-1)
        fields = keys >> _ID_BITS
        unpacked = (_WEIGHT_TOP - (fields & _WEIGHT_MASK)).astype(np.int32).view(np.float32)
        return ((keys & _ID_MASK) - 1).astype(experts.dtype, copy=False), unpacked
    order = np.lexsort((experts, -weights, experts < 0), axis=-1)  # exact: last key first
    return np.take_along_axis(experts, order, axis=-1), np.take_along_axis(weights, order, axis=-1)


# A slot's sort key packed into an int64, exactly: dropped (1 bit) | 0x7F800000 - the weight's fp32 bit
# pattern (31 bits: for finite weights >= +0 the patterns order as the values do) | expert id + 1 (24 bits).
_ID_BITS = 24
_ID_MASK = (1 << _ID_BITS) - 1
_WEIGHT_TOP = 0x7F800000  # +inf's bit pattern: above every finite weight's
_WEIGHT_MASK = (1 << 31) - 1


def _slot_keys(experts: np.ndarray, weights: np.ndarray) -> np.ndarray | None:
    """[..., k] int64 keys that sort as `sort_slots_np` orders the slots and unpack to the same experts and
    weights; None unless the weights are fp32, finite and >= +0 (no -0.0) and the ids in [-1, 2**24 - 1)."""
    if weights.dtype != np.float32 or experts.dtype.kind != "i" or experts.size == 0:
        return None
    bits = weights.view(np.int32)  # a set sign bit reads negative; NaN and inf read >= _WEIGHT_TOP
    if bits.min() < 0 or bits.max() >= _WEIGHT_TOP or experts.min() < -1 or experts.max() >= _ID_MASK:
        return None
    keys = (_WEIGHT_TOP - bits.astype(np.int64)) << _ID_BITS
    keys |= experts.astype(np.int64, copy=False) + 1
    keys |= (experts < 0).astype(np.int64) << (_ID_BITS + 31)
    return keys


def _infer_score_fn(logits: np.ndarray, experts: list[np.ndarray], weights: list[np.ndarray]) -> ScoreFn:
    """For two kept experts, w_i/w_j = exp(l_i - l_j) under softmax and σ(l_i)/σ(l_j) under sigmoid,
    whatever renormalisation or scaling follows. Pick the rule that explains the observed weights."""
    experts_all, weights_all = np.concatenate(experts), np.concatenate(weights)
    if experts_all.shape[1] < 2:
        return "softmax"
    ok = (experts_all[:, :2] >= 0).all(axis=1) & (weights_all[:, 1] > 0)
    if not ok.any():
        return "softmax"
    rows = np.nonzero(ok)[0]
    l0, l1 = logits[rows, experts_all[rows, 0]], logits[rows, experts_all[rows, 1]]
    observed = np.log(weights_all[rows, 0]) - np.log(weights_all[rows, 1])
    softmax_err = np.abs(observed - (l0 - l1)).mean()
    sigmoid_err = np.abs(
        observed - (np.log(scores_from_logits(l0, "sigmoid")) - np.log(scores_from_logits(l1, "sigmoid")))
    ).mean()
    return "sigmoid" if sigmoid_err < softmax_err else "softmax"
