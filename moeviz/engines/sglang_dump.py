"""SGLang's expert-distribution recorder dumps (format "sglang-dump"), read exactly as SGLang writes them
(docs/engine-formats.md, "SGLang"; its `return_routed_experts` responses: `sglang_routed`):

- the expert-distribution recorder's `torch.save` dicts (read with `weights_only=True` only),
  its mode told by the dict's keys:
  - `stat` / `stat_approx`: `logical_count` [buffer_steps, num_hidden_layers, E], a ring buffer whose
    unfilled rows are all zero → an `ExpertLoad` of the real steps;
  - `per_pass`: one file per rank, `records` of `global_physical_count` [num_hidden_layers, P] per forward
    pass + `last_physical_to_logical_map` [num_hidden_layers, P] → counts per pass summed over ranks and
    folded to logical experts (an `ExpertLoad`);
  - `per_token`: one file per rank, `records` of `topk_ids_of_layer` [num_hidden_layers, T, 8] physical ids
    padded with -1, with the pass's `input_ids`, `positions`, `extend_seq_lens`, `forward_mode` → physical
    ids mapped to logical, sequences rebuilt from positions (the recorder keeps no request ids) → a Trace.

Sources (repo:path@commit): sgl-project/sglang python/sglang/srt/eplb/expert_distribution.py@dd780ab9,
eplb/eplb_simulator/reader.py@5d2c83e6, eplb/expert_location.py@6270b014, layers/moe/topk.py@000328a8,
state_capturer/base.py@0564b521, state_capturer/routed_experts_wire.py@a6463a10,
managers/scheduler_components/batch_result_processor.py@003ddbce, managers/tokenizer_manager.py@001067ff,
entrypoints/openai/protocol.py@004c82e0, model_executor/forward_batch_info.py@003bbaf9.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moeviz.engines.checks import first_repeated_row
from moeviz.engines.layout import RoutingLayout
from moeviz.engines.routed import RoutedSequence, routed_trace
from moeviz.engines.tokens import agreed_token_ids, ids_for
from moeviz.errors import EngineFormatError, InputError
from moeviz.trace import UNKNOWN_TOKEN, ExpertLoad, Trace

# ForwardBatch.forward_mode.value (forward_batch_info.py: ForwardMode, an IntEnum of auto() values)
EXTEND, DECODE, MIXED, IDLE = 1, 2, 3, 4
_MODE_NAMES = {EXTEND: "EXTEND", DECODE: "DECODE", MIXED: "MIXED", IDLE: "IDLE"}

_LAST_MAP_CAVEAT = (
    'SGLang keeps only the map in force when it dumped ("it may change during recording"); had EPLB '
    "rebalanced while recording, earlier passes would be mapped with the wrong map, and the file cannot tell"
)


def read(fmt: str, files: Sequence[Path], layout: RoutingLayout, token_ids) -> Trace | ExpertLoad:
    """Read SGLang recorder dumps (format "sglang-dump") for the model `layout`."""
    return read_dump(files, layout, token_ids)


# ----------------------------------------------------------------------------------------- sglang-dump


def read_dump(
    files: Sequence[Path], layout: RoutingLayout, token_ids: list[np.ndarray] | None = None
) -> Trace | ExpertLoad:
    """The expert-distribution recorder's dumps: `stat` files → ExpertLoad, the rank files of one `per_pass`
    recording → ExpertLoad, those of one `per_token` recording → Trace."""
    dumps = [(Path(f), _load_dump(Path(f))) for f in files]
    modes = [(path, _dump_mode(path, data)) for path, data in dumps]
    first_path, mode = modes[0]
    for path, other in modes[1:]:
        if other != mode:
            raise EngineFormatError(
                f"{first_path.name} is a {mode} dump and {path.name} a {other} dump: give the files of "
                "one recording (one mode) together"
            )
    if mode == "per_token":
        return _per_token(dumps, layout, token_ids)
    if token_ids is not None:
        raise InputError(
            f"{first_path.name} is a {mode} dump: expert counts without tokens, so token ids or texts do "
            "not apply to it"
        )
    if mode == "stat":
        return _stat(dumps, layout)
    return _per_pass(dumps, layout)


def _load_dump(path: Path) -> dict:
    import torch

    try:
        # weights_only: a dump is tensors, lists, dicts and numbers; nothing in it is ever unpickled
        data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises several types: not a zip, unpickling refused, truncated, …
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EngineFormatError(
            f"{path}: not a torch.save dict of tensors as SGLang's expert-distribution recorder writes "
            f"(read with weights_only=True): {line}"
        ) from exc
    if not isinstance(data, dict):
        raise EngineFormatError(
            f"{path}: holds a {type(data).__name__}; SGLang's recorder saves a dict (stat: logical_count; "
            "per_pass/per_token: records + last_physical_to_logical_map)"
        )
    return data


def _dump_mode(path: Path, data: dict) -> str:
    """The dump's mode: "stat" (stat and stat_approx write the same dict), "per_pass" or "per_token"."""
    if "logical_count" in data:
        return "stat"
    if "records" not in data:
        raise EngineFormatError(
            f"{path}: keys {sorted(map(str, data))}; an SGLang expert-distribution dump has logical_count "
            "(stat, stat_approx) or records (per_pass, per_token)"
        )
    records = data["records"]
    if not isinstance(records, list) or not records:
        raise EngineFormatError(
            f"{path}: no records (the recorder was dumped before it recorded a forward pass)"
        )
    if data.get("last_physical_to_logical_map") is None:
        raise EngineFormatError(
            f"{path}: records of physical expert ids but no last_physical_to_logical_map; without it "
            "physical ids cannot be read as experts"
        )
    kinds = set()
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise EngineFormatError(f"{path}: record {i} is a {type(record).__name__}, not a dict")
        if "topk_ids_of_layer" in record:
            kinds.add("per_token")
        elif "global_physical_count" in record:
            kinds.add("per_pass")
        else:
            raise EngineFormatError(
                f"{path}: record {i} has keys {sorted(map(str, record))}: neither topk_ids_of_layer "
                "(per_token) nor global_physical_count (per_pass)"
            )
    if len(kinds) > 1:
        raise EngineFormatError(f"{path}: records of both per_pass and per_token recordings")
    return kinds.pop()


def _array(value: Any, where: str, what: str, ndim: int | None = None) -> np.ndarray:
    """An integer array from a tensor or a list in a dump (int64; an empty list is an empty int array)."""
    import torch

    if isinstance(value, torch.Tensor):
        arr = value.numpy()
    elif isinstance(value, (list, tuple)):
        try:
            arr = np.asarray(value)
        except ValueError as exc:
            raise EngineFormatError(f"{where}: {what} is a ragged list ({exc})") from exc
        if arr.size == 0:
            arr = arr.astype(np.int64)
    else:
        raise EngineFormatError(f"{where}: {what} is a {type(value).__name__}, not a tensor or a list")
    if arr.dtype.kind not in "iu":
        raise EngineFormatError(f"{where}: {what} holds {arr.dtype} values, not integers")
    if ndim is not None and arr.ndim != ndim:
        raise EngineFormatError(f"{where}: {what} has shape {list(arr.shape)}, expected {ndim} dimensions")
    return arr


def _int(value: Any, where: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise EngineFormatError(f"{where}: {what} is {value!r}, not an integer")
    return int(value)


def _check_hidden_layers(where: str, size: int, layout: RoutingLayout, what: str) -> None:
    # ExpertLocationMetadata.num_layers = the model's num_hidden_layers (get_model_config_for_expert_location)
    if size != layout.num_hidden_layers:
        raise EngineFormatError(
            f"{where}: {what} has {size} layers; SGLang's recorder writes every hidden layer and the model "
            f"has {layout.num_hidden_layers}: is --model the model that produced this dump?"
        )


def _check_dense_counts(where: str, counts: np.ndarray, layout: RoutingLayout, steps: list[str]) -> None:
    """counts [S, L_hidden, E]: a dense layer has no router, so SGLang never counts a token there."""
    for layer in layout.dense_layers:
        hit = np.flatnonzero(counts[:, layer].reshape(len(counts), -1).any(axis=1))
        if len(hit):
            raise EngineFormatError(
                f"{where}: layer {layer} is dense in the model, but {steps[hit[0]]} counts "
                f"{int(counts[hit[0], layer].sum())} routed slots there: is --model the model that "
                "produced this dump?"
            )


def _stat(dumps: list[tuple[Path, dict]], layout: RoutingLayout) -> ExpertLoad:
    e, moe = layout.num_experts, list(layout.moe_layers)
    parts: list = []
    steps: list = []
    notes: list = []
    for path, data in dumps:
        counts = _array(data["logical_count"], str(path), "logical_count", ndim=3)
        s, n_layers, n_experts = counts.shape
        _check_hidden_layers(str(path), n_layers, layout, "logical_count")
        if n_experts != e:
            raise EngineFormatError(
                f"{path}: logical_count counts {n_experts} logical experts, the model has {e}: is --model "
                "the model that produced this dump?"
            )
        if s and counts.min() < 0:
            raise EngineFormatError(f"{path}: logical_count holds negative counts ({int(counts.min())})")
        prefix = f"{path.name} " if len(dumps) > 1 else ""
        labels = [f"{prefix}row {i}" for i in range(s)]
        _check_dense_counts(str(path), counts, layout, labels)
        # the buffer is a ring (_CircularBuffer) zeroed at start: rows never written are all zero
        real = np.any(counts.reshape(s, -1), axis=1)
        if not real.any():
            raise EngineFormatError(
                f"{path}: all {s} rows of logical_count are zero: the recorder counted nothing (dumped "
                "before a forward pass, or never started)"
            )
        kept = counts[real][:, moe].astype(np.int64)
        parts.append(kept)
        steps.extend(label for label, keep in zip(labels, real, strict=True) if keep)
        notes.append(_ring_note(path, real))
        totals = kept.sum(axis=2)
        uneven = int((totals != totals[:, :1]).any(axis=1).sum())
        if uneven:
            notes.append(
                f"{path.name}: in {uneven} of {len(kept)} steps the MoE layers counted different totals "
                "(every layer routes the same tokens, k slots each: stat_approx counts DeepEP dispatches, "
                "which SGLang calls approximate)"
            )
        rate = data.get("average_utilization_rate_over_window")
        if isinstance(rate, (int, float)) and not isinstance(rate, bool):
            notes.append(f"{path.name}: SGLang's average utilization rate over its window: {float(rate):.3f}")
    notes.append(
        "stat dump: logical counts summed over ranks by SGLang (all_reduce); where every rank routed the "
        "same tokens (tensor parallel without DP attention) each token is counted once per rank"
    )
    return ExpertLoad(
        model=layout.model_info(notes),
        counts=np.concatenate(parts),
        layers=moe,
        top_k=layout.top_k,
        source="sglang-dump",
        steps=steps,
    )


def _ring_note(path: Path, real: np.ndarray) -> str:
    s, n = len(real), int(real.sum())
    if n == s:
        return (
            f"{path.name}: all {s} ring-buffer rows hold counts: if the recording ran longer than the buffer "
            "it wrapped, and rows are then in ring order, not time order (SGLang saves no write position)"
        )
    inner = int((~real[: int(np.flatnonzero(real)[-1]) + 1]).sum())
    return (
        f"{path.name}: {n} of {s} ring-buffer rows hold counts; the {s - n} all-zero rows were dropped "
        "(slots never written"
        + (f"; {inner} of them lie between written rows: passes that routed no token" if inner else "")
        + ")"
    )


def _map(path: Path, data: dict, layout: RoutingLayout) -> np.ndarray:
    """last_physical_to_logical_map [num_hidden_layers, P] (int64), checked against the model."""
    mapping = _array(data["last_physical_to_logical_map"], str(path), "last_physical_to_logical_map", ndim=2)
    _check_hidden_layers(str(path), mapping.shape[0], layout, "last_physical_to_logical_map")
    e = layout.num_experts
    if mapping.shape[1] < e:
        raise EngineFormatError(
            f"{path}: last_physical_to_logical_map has {mapping.shape[1]} physical slots for {e} experts; "
            "SGLang places every logical expert at least once (P = E + redundant experts)"
        )
    if mapping.size and (mapping.min() < 0 or mapping.max() >= e):
        layer, slot = np.argwhere((mapping < 0) | (mapping >= e))[0]
        raise EngineFormatError(
            f"{path}: last_physical_to_logical_map sends physical slot {slot} of layer {layer} to expert "
            f"{int(mapping[layer, slot])}, outside [0, {e}): is --model the model that produced this dump?"
        )
    return mapping.astype(np.int64)


def _one_map(dumps: list[tuple[Path, dict]], layout: RoutingLayout) -> np.ndarray:
    first_path, first = dumps[0][0], _map(dumps[0][0], dumps[0][1], layout)
    for path, data in dumps[1:]:
        other = _map(path, data, layout)
        if other.shape != first.shape:
            raise EngineFormatError(
                f"{first_path.name} and {path.name}: physical-to-logical maps of shapes "
                f"{list(first.shape)} and {list(other.shape)}: not one recording"
            )
        if not np.array_equal(other, first):
            layer, slot = np.argwhere(other != first)[0]
            raise EngineFormatError(
                f"{first_path.name} and {path.name}: their last_physical_to_logical_map disagree (layer "
                f"{layer}, slot {slot}: expert {int(first[layer, slot])} vs {int(other[layer, slot])}): "
                "not one recording, or ranks dumped at different times"
            )
    return first


def _map_note(mapping: np.ndarray, e: int) -> str:
    p = mapping.shape[1]
    return (
        f"physical expert slots mapped to logical experts through last_physical_to_logical_map ({p} slots "
        f"for {e} experts, {p - e} redundant): {_LAST_MAP_CAVEAT}"
    )


def _pass_key(path: Path, i: int, record: dict) -> tuple[int, int]:
    where = f"{path}: record {i}"
    fpid = _int(record.get("forward_pass_id"), where, "forward_pass_id")
    return fpid, _int(record.get("rank"), where, "rank")


def _per_pass(dumps: list[tuple[Path, dict]], layout: RoutingLayout) -> ExpertLoad:
    mapping = _one_map(dumps, layout)
    n_layers, p = mapping.shape
    by_pass: dict[int, dict[int, np.ndarray]] = {}
    for path, data in dumps:
        for i, record in enumerate(data["records"]):
            fpid, rank = _pass_key(path, i, record)
            where = f"{path}: record {i}"
            counts = _array(record["global_physical_count"], where, "global_physical_count", ndim=2)
            if counts.shape != (n_layers, p):
                raise EngineFormatError(
                    f"{path}: record {i} (pass {fpid}, rank {rank}): global_physical_count "
                    f"{list(counts.shape)}, the map is {[n_layers, p]}"
                )
            if counts.size and counts.min() < 0:
                raise EngineFormatError(f"{path}: record {i}: negative counts in global_physical_count")
            ranks = by_pass.setdefault(fpid, {})
            if rank in ranks:  # SGLang's reader asserts the same
                raise EngineFormatError(
                    f"{path}: pass {fpid} of rank {rank} appears twice (the same rank file given twice?)"
                )
            ranks[rank] = counts.astype(np.int64)
    ids = sorted(by_pass)
    all_ranks = sorted({r for ranks in by_pass.values() for r in ranks})
    physical = np.stack([sum(by_pass[f].values()) for f in ids])  # [S, L, P], ranks summed
    e = layout.num_experts
    logical = np.zeros((len(ids), n_layers * e), np.int64)
    columns = (np.arange(n_layers)[:, None] * e + mapping).reshape(-1)
    # numpy's stub types `indices` as integers only; ufunc.at takes any index tuple, as `a[...]` does
    np.add.at(logical, (slice(None), columns), physical.reshape(len(ids), -1))  # type: ignore[arg-type]
    logical = logical.reshape(len(ids), n_layers, e)
    labels = [f"pass {f}" for f in ids]
    _check_dense_counts(str(dumps[0][0]), logical, layout, labels)
    notes = [
        f"{len(ids)} forward passes from {len(dumps)} file(s), ranks {all_ranks}: each pass's physical "
        "counts summed over ranks, as SGLang's eplb_simulator reader does",
        _map_note(mapping, e),
    ]
    missing = sum(1 for f in ids if len(by_pass[f]) != len(all_ranks))
    if missing:
        notes.append(f"{missing} of {len(ids)} passes lack some rank's record")
    if len(all_ranks) > 1 and all(
        len(by_pass[f]) == len(all_ranks)
        and all(np.array_equal(c, by_pass[f][all_ranks[0]]) for c in by_pass[f].values())
        for f in ids
    ):
        notes.append(
            "every rank recorded the same counts in every pass: tensor-parallel replicas of the same "
            "tokens, so each token is counted once per rank"
        )
    return ExpertLoad(
        model=layout.model_info(notes),
        counts=logical[:, list(layout.moe_layers)],
        layers=list(layout.moe_layers),
        top_k=layout.top_k,
        source="sglang-dump",
        steps=labels,
    )


# ------------------------------------------------------------------------------------ per_token dumps


@dataclass
class _Pass:
    """One per_token record, decoded: logical ids [T, L, k] and the tokens' segments."""

    fpid: int
    rank: int
    mode: int
    input_ids: np.ndarray  # [T]
    logical: np.ndarray  # [T, L_hidden, k], -1 where nothing routed
    segments: list[tuple[int, int, int]]  # (first token, token count, first position), in batch order
    split_by_position: bool = False  # an extend pass without extend_seq_lens: requests told by positions


@dataclass
class _Chain:
    """Tokens of one sequence on one rank, joined pass after pass by position."""

    rank: int
    start: int
    next_pos: int
    order: tuple[int, int]  # (pass index, segment) of its last extension
    pieces: list[tuple[int, int, int]] = field(default_factory=list)  # (pass index, first token, count)
    prompt_len: int | None = None  # first position a DECODE pass fed (a generated token)


def _per_token(
    dumps: list[tuple[Path, dict]], layout: RoutingLayout, token_ids: list[np.ndarray] | None
) -> Trace:
    mapping = _one_map(dumps, layout)
    passes: dict[int, list[_Pass]] = {}
    seen: dict[tuple[int, int], Path] = {}
    for path, data in dumps:
        for i, record in enumerate(data["records"]):
            decoded = _decode_pass(path, i, record, mapping, layout)
            key = (decoded.fpid, decoded.rank)
            if key in seen:
                raise EngineFormatError(
                    f"{path}: pass {decoded.fpid} of rank {decoded.rank} appears twice (also in "
                    f"{seen[key].name}): the same rank file given twice?"
                )
            seen[key] = path
            passes.setdefault(decoded.rank, []).append(decoded)
    chains, stats = [], {"ties": 0, "late": 0}
    for rank in sorted(passes):
        rank_passes = sorted(passes[rank], key=lambda p: p.fpid)
        passes[rank] = rank_passes
        chains.extend(_link(rank_passes, stats))
    files = {rank: path.name for (_, rank), path in seen.items()}
    sequences, dropped = _sequences(chains, passes, files, token_ids)
    n_passes = len({p.fpid for rank_passes in passes.values() for p in rank_passes})
    notes = [
        f"{n_passes} forward passes from ranks {sorted(passes)} ({len(dumps)} file(s)); {len(sequences)} "
        "sequences rebuilt from positions and extend_seq_lens: the recorder keeps no request ids",
        _map_note(mapping, layout.num_experts),
        "tokens fed by DECODE passes are marked generated; MIXED passes (chunked prefill with running "
        "decodes) cannot tell a decode from a one-token chunk, so theirs count as prompt",
    ]
    split = sum(p.split_by_position for rank_passes in passes.values() for p in rank_passes)
    if split:
        notes.append(
            f"{split} extend passes carry no extend_seq_lens (SGLang's gpu-only batches): their requests "
            "were told apart where positions stop counting up by one, so a request whose first position "
            "continues the previous request's last is read as part of it"
        )
    if dropped:
        notes.append(
            f"{dropped} sequences recorded identically by several ranks (tensor-parallel replicas) kept once"
        )
    if stats["ties"]:
        notes.append(
            f"{stats['ties']} continuations had several sequences ending at that position; each was joined "
            "to the one seen in the latest pass, first in batch order (a running request is in every decode "
            "pass of its rank, and SGLang keeps its running batch in order as finished requests leave): "
            "wrong only where two requests of one length ran in the same passes and the first finished, or "
            "where a retraction reordered the batch"
        )
    if stats["late"]:
        notes.append(
            f"{stats['late']} sequences start after position 0 (prefix-cache hits, or requests already "
            "running when recording started): their earlier tokens have no routing and no token id"
        )
    return routed_trace(layout, sequences, source="sglang-dump", notes=notes, ranked=False)


def _decode_pass(path: Path, i: int, record: dict, mapping: np.ndarray, layout: RoutingLayout) -> _Pass:
    fpid, rank = _pass_key(path, i, record)
    where = f"{path}: pass {fpid} (rank {rank})"
    mode = _int(record.get("forward_mode"), where, "forward_mode")
    input_ids = _array(record.get("input_ids"), where, "input_ids", ndim=1).astype(np.int64)
    positions = _array(record.get("positions"), where, "positions", ndim=1).astype(np.int64)
    topk = _array(record["topk_ids_of_layer"], where, "topk_ids_of_layer", ndim=3)
    t = len(input_ids)
    if len(positions) != t or topk.shape[1] != t:
        raise EngineFormatError(
            f"{where}: {t} input_ids, {len(positions)} positions and {topk.shape[1]} tokens in "
            "topk_ids_of_layer: SGLang records one of each per token of the pass"
        )
    _check_hidden_layers(where, topk.shape[0], layout, "topk_ids_of_layer")
    lens = record.get("extend_seq_lens")
    split = mode in (EXTEND, MIXED) and lens is None
    segments = _segments(where, mode, lens, positions)
    logical = _logical(where, topk, mapping, layout, positions)
    return _Pass(fpid, rank, mode, input_ids, logical, segments, split)


def _segments(where: str, mode: int, lens: Any, positions: np.ndarray) -> list[tuple[int, int, int]]:
    """(first token, count, first position) of each request's tokens in the pass, in batch order."""
    t = len(positions)
    if mode == IDLE:
        if t:
            raise EngineFormatError(f"{where}: an IDLE pass with {t} tokens")
        return []
    if t == 0:
        return []
    if mode == DECODE:
        # one token per running request; extend_seq_lens_cpu is None in a decode batch
        if lens is not None and any(int(n) != 1 for n in lens):
            raise EngineFormatError(f"{where}: a DECODE pass with extend_seq_lens {list(lens)[:8]}")
        sizes = np.ones(t, np.int64)
    elif mode in (EXTEND, MIXED):
        if lens is None:
            # ForwardBatch leaves extend_seq_lens_cpu unset on its gpu-only extend path: a request's
            # tokens are then told apart only where positions stop counting up by one
            breaks = np.flatnonzero(np.diff(positions) != 1) + 1
            sizes = np.diff(np.concatenate([[0], breaks, [t]])).astype(np.int64)
        else:
            sizes = _array(lens, where, "extend_seq_lens", ndim=1).astype(np.int64)
        if (sizes.size and sizes.min() < 1) or int(sizes.sum()) != t:
            raise EngineFormatError(
                f"{where}: extend_seq_lens sum to {int(sizes.sum())} for {t} tokens (each request extends "
                "by at least one token)"
            )
    else:
        raise EngineFormatError(
            f"{where}: forward_mode {mode}; moeviz reads EXTEND (1), DECODE (2), MIXED (3) and IDLE (4) "
            "passes: other modes (speculative decoding's verify and draft passes) hold tokens that may be "
            "rejected"
        )
    firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    starts = positions[firsts] if t else firsts
    expected = np.repeat(starts - firsts, sizes) + np.arange(t)
    if not np.array_equal(positions, expected):
        bad = int(np.flatnonzero(positions != expected)[0])
        raise EngineFormatError(
            f"{where}: token {bad} is at position {int(positions[bad])}, expected {int(expected[bad])}: a "
            "request's tokens in a pass are consecutive positions"
        )
    return list(zip(firsts.tolist(), sizes.tolist(), starts.tolist(), strict=True))


def _logical(
    where: str, topk: np.ndarray, mapping: np.ndarray, layout: RoutingLayout, positions: np.ndarray
) -> np.ndarray:
    """topk [L, T, W] physical ids padded with -1 → [T, L, k] logical ids (-1 kept)."""
    k, width = layout.top_k, topk.shape[2]
    if width < k:
        raise EngineFormatError(
            f"{where}: topk_ids_of_layer keeps {width} experts per token, the model routes to {k}"
        )
    if width > k and (topk[:, :, k:] != -1).any():
        layer, token, _ = np.argwhere(topk[:, :, k:] != -1)[0]
        raise EngineFormatError(
            f"{where}: layer {layer}, token {token} holds ids past its {k} experts "
            f"({_ids(topk[layer, token])}); the recorder pads unused columns with -1 (fused shared experts "
            "fill one more, and SGLang notes its per_token data is wrong with them)"
        )
    ids = topk[:, :, :k].astype(np.int64)
    p = mapping.shape[1]
    if ids.size and (ids.min() < -1 or ids.max() >= p):
        layer, token, _ = np.argwhere((ids < -1) | (ids >= p))[0]
        raise EngineFormatError(
            f"{where}: layer {layer}, token {token} (position {int(positions[token])}) holds physical ids "
            f"{_ids(ids[layer, token])} outside [0, {p}) (the map's physical slots; -1 is padding)"
        )
    rows = np.arange(ids.shape[0])[:, None, None]
    logical = np.where(ids >= 0, mapping[rows, np.maximum(ids, 0)], -1)
    for layer in layout.moe_layers:
        routed = (ids[layer] >= 0).all(axis=1)
        mapped = logical[layer][routed]
        row = first_repeated_row(mapped) if len(mapped) else None
        if row is None:
            continue
        token = int(np.flatnonzero(routed)[row])
        phys = ids[layer, token]
        if len(np.unique(phys)) == k:
            raise EngineFormatError(
                f"{where}: layer {layer}, position {int(positions[token])}: distinct physical ids "
                f"{_ids(phys)} map to experts {_ids(logical[layer, token])} through "
                "last_physical_to_logical_map, one of them twice: the map changed during recording (EPLB "
                "rebalancing) and the file keeps only the last one, so these passes cannot be mapped"
            )
        raise EngineFormatError(
            f"{where}: layer {layer}, position {int(positions[token])}: physical ids {_ids(phys)} repeat an "
            f"expert; a router sends each token to {k} different experts"
        )
    return np.ascontiguousarray(logical.transpose(1, 0, 2), dtype=np.int32)


def _ids(row: np.ndarray) -> str:
    return "[" + ", ".join(str(int(v)) for v in row) + "]"


def _link(rank_passes: list[_Pass], stats: dict[str, int]) -> list[_Chain]:
    """Join one rank's passes into sequences: a request's tokens at position p continue the sequence whose
    last routed position was p − 1 (prefill chunks and decode steps alike); position 0 starts a new one."""
    chains: list[_Chain] = []
    open_at: dict[int, list[_Chain]] = {}  # next position -> chains waiting for it
    for index, step in enumerate(rank_passes):
        for segment, (first, count, pos) in enumerate(step.segments):
            waiting = open_at.get(pos, []) if pos > 0 else []
            candidates = [c for c in waiting if c.order[0] != index]  # a request appears once per pass
            if candidates:
                if len(candidates) > 1:
                    stats["ties"] += 1
                # a running request is in every decode pass of its rank: the most recently seen sequence
                # is the one still running; among those, SGLang's running batch keeps its order
                chain = min(candidates, key=lambda c: (-c.order[0], c.order[1]))
                waiting.remove(chain)
            else:
                chain = _Chain(rank=step.rank, start=pos, next_pos=pos, order=(index, segment))
                chains.append(chain)
                stats["late"] += pos > 0
            if step.mode == DECODE and chain.prompt_len is None:
                chain.prompt_len = pos
            chain.pieces.append((index, first, count))
            chain.next_pos = pos + count
            chain.order = (index, segment)
            open_at.setdefault(chain.next_pos, []).append(chain)
    return chains


def _sequences(
    chains: list[_Chain],
    passes: dict[int, list[_Pass]],
    files: dict[int, str],
    token_ids: list[np.ndarray] | None,
) -> tuple[list[RoutedSequence], int]:
    """RoutedSequences of the chains, replicas of one sequence on several ranks kept once."""
    built: dict[tuple, tuple[int, np.ndarray]] = {}
    kept: list[tuple[_Chain, np.ndarray, np.ndarray]] = []
    dropped = 0
    for chain in chains:
        steps = passes[chain.rank]
        ids = np.concatenate([steps[i].input_ids[a : a + n] for i, a, n in chain.pieces])
        rows = np.concatenate([steps[i].logical[a : a + n] for i, a, n in chain.pieces])
        key = (tuple(steps[i].fpid for i, _, _ in chain.pieces), chain.start, ids.tobytes())
        if key in built:
            rank, other = built[key]
            if not np.array_equal(rows, other):
                raise EngineFormatError(
                    f"{files[rank]} and {files[chain.rank]}: ranks {rank} and {chain.rank} ran the same "
                    f"tokens (passes from {key[0][0]}, positions {chain.start}–"
                    f"{chain.start + len(ids) - 1}) but recorded different experts"
                )
            dropped += 1
            continue
        built[key] = (chain.rank, rows)
        kept.append((chain, ids, rows))
    given = ids_for(token_ids, len(kept), f"the {len(kept)} sequences rebuilt from the dump")
    sequences = []
    for index, ((chain, ids, rows), user) in enumerate(zip(kept, given, strict=True)):
        first = passes[chain.rank][chain.pieces[0][0]].fpid
        label = f"{files[chain.rank]}, rank {chain.rank}, sequence {index} (from pass {first})"
        known = np.concatenate([np.full(chain.start, UNKNOWN_TOKEN, np.int64), ids])
        sequences.append(
            RoutedSequence(
                experts=rows,
                token_ids=agreed_token_ids(label, known, user),
                start=chain.start,
                prompt_len=chain.prompt_len,
                label=label,
            )
        )
    return sequences, dropped
