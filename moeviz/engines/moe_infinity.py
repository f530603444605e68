"""MoE-Infinity's expert count matrices (format "moe-infinity"); definitions, traps and sources:
docs/engine-formats.md, "Public traces".

MoE-Infinity (`moe-infinity`): `ExpertTracer` keeps one matrix [num_layers, num_experts] per sequence,
each cell += how many of the sequence's (token, slot) choices went to that expert at that layer, over every
forward of the sequence (prefill and each decode step); its `trace_collection` [capacity, num_layers,
num_experts] is what `np.save` writes and `load_trace` reads back (`np.load(allow_pickle=False)`). The
layer axis counts every hidden layer of a decoder (dense ones stay 0); the values are float (np.zeros /
torch.zeros), whole numbers. Each matrix becomes one step of an `ExpertLoad`; an all-zero one (a collection
slot never filled) is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moeviz.engines.layout import RoutingLayout
from moeviz.engines.responses import npy_file
from moeviz.errors import EngineFormatError, InputError
from moeviz.trace import ExpertLoad


def read(fmt: str, files: Sequence[Path], layout: RoutingLayout, token_ids) -> ExpertLoad:
    """The `moeviz.engines` entry point of format "moe-infinity"."""
    return read_moe_infinity(files, layout, token_ids)


def read_moe_infinity(
    files: Sequence[Path], layout: RoutingLayout, token_ids: list[np.ndarray] | None = None
) -> ExpertLoad:
    """An ExpertLoad with one step per sequence matrix: each file a matrix [L, E] or a saved trace
    collection [S, L, E]; a folder stands for its .npy files."""
    if token_ids is not None:
        raise InputError("MoE-Infinity count matrices hold no tokens: --token-ids / --text do not apply")
    paths: list[Path] = []
    for path in map(Path, files):
        if path.is_dir():
            found = sorted(p for p in path.glob("*.npy") if p.is_file())
            if not found:
                raise InputError(f"{path}: no .npy file in the folder")
            paths += found
        else:
            paths.append(path)
    steps, labels, empty = [], [], 0
    for path in paths:
        array = np.asarray(npy_file(path, kinds="iuf"))
        if array.ndim == 2:
            names = [path.name]
        elif array.ndim == 3:
            names = [f"{path.name}[{i}]" for i in range(len(array))]
        else:
            raise EngineFormatError(
                f"{path}: an array of shape {list(array.shape)}; MoE-Infinity writes [num_layers, "
                "num_experts] per sequence or a trace collection [sequences, num_layers, num_experts]"
            )
        counts = _counts(array, path, layout)  # [n, L_moe, E] int64
        keep = np.any(counts.reshape(len(counts), -1), axis=1)
        empty += int((~keep).sum())
        for index in np.flatnonzero(keep):
            _check_sequence(counts[index], names[index], layout)
        steps.append(counts[keep])
        labels += [n for n, kept in zip(names, keep, strict=True) if kept]
    if not labels:
        raise EngineFormatError(f"{', '.join(map(str, paths))}: every count matrix is all zero (no sequence)")
    notes = [
        "MoE-Infinity expert counts: one step per sequence; a count is how many of the sequence's (token, "
        "slot) choices went to the expert, summed over its prefill and decode steps"
    ]
    if empty:
        notes.append(f"{empty} all-zero matrices dropped (trace-collection slots never filled)")
    return ExpertLoad(
        model=layout.model_info(notes),
        counts=np.concatenate(steps),
        layers=list(layout.moe_layers),
        top_k=layout.top_k,
        source="moe-infinity",
        steps=labels,
    )


def _counts(array: np.ndarray, path: Path, layout: RoutingLayout) -> np.ndarray:
    """[n, L, E] → [n, L_moe, E] int64 counts: the dtype, values, layer axis and expert axis checked."""
    kind = array.dtype.kind
    if kind not in "iuf":
        raise EngineFormatError(
            f"{path}: dtype {array.dtype}; MoE-Infinity's counts are numbers (float from np.zeros / "
            "torch.zeros, or integers)"
        )
    matrices = array if array.ndim == 3 else array[None]
    n, layers, experts = matrices.shape
    if experts != layout.num_experts:
        raise EngineFormatError(
            f"{path}: {experts} experts on the last axis, the model has {layout.num_experts} routed experts: "
            "is --model the model that produced this file?"
        )
    if kind == "f":
        finite = np.isfinite(matrices)
        if not finite.all():
            raise EngineFormatError(
                f"{path}, {_cell(np.argwhere(~finite)[0], array.ndim)}: not a finite count"
            )
        fractional = matrices != np.floor(matrices)
        if fractional.any():
            where = np.argwhere(fractional)[0]
            raise EngineFormatError(
                f"{path}, {_cell(where, array.ndim)}: {float(matrices[tuple(where)])} is not a whole count "
                "(MoE-Infinity adds whole tokens)"
            )
    negative = matrices < 0
    if negative.any():
        where = np.argwhere(negative)[0]
        raise EngineFormatError(
            f"{path}, {_cell(where, array.ndim)}: negative count {matrices[tuple(where)]}"
        )
    if layers == layout.num_hidden_layers:
        moe = list(layout.moe_layers)
        dense = [i for i in range(layers) if i not in layout.moe_layers]
        routed = np.flatnonzero(matrices[:, dense].reshape(n, -1).any(axis=1)) if dense else np.zeros(0, int)
        if len(routed):
            row = matrices[routed[0], dense]
            layer = dense[int(np.flatnonzero(row.any(axis=1))[0])]
            raise EngineFormatError(
                f"{path}: layer {layer} is dense in the model, but the file counts tokens there: is --model "
                "the model that produced this file?"
            )
    elif layers == len(layout.moe_layers):
        moe = list(range(layers))
    else:
        raise EngineFormatError(
            f"{path}: {layers} layers on the layer axis; the model has {layout.num_hidden_layers} hidden "
            f"layers, {len(layout.moe_layers)} of them MoE: is --model the model that produced this file?"
        )
    return matrices[:, moe].astype(np.int64)


def _cell(where: np.ndarray, ndim: int) -> str:
    names = ("sequence", "layer", "expert")[3 - ndim :]
    return ", ".join(f"{name} {int(i)}" for name, i in zip(names, where[-ndim:], strict=True))


def _check_sequence(counts: np.ndarray, label: str, layout: RoutingLayout) -> None:
    """Counts [L_moe, E] of one sequence that a router can produce: every MoE layer routes the same T tokens
    to k distinct experts each, so every layer counts k·T slots and no expert more than T."""
    k, layers = layout.top_k, layout.moe_layers
    totals = counts.sum(axis=1)
    if (totals != totals[0]).any():
        i = int(np.flatnonzero(totals != totals[0])[0])
        raise EngineFormatError(
            f"{label}: layer {layers[i]} counts {int(totals[i])} slots, layer {layers[0]} "
            f"{int(totals[0])}; every token passes every MoE layer, so these cannot be one sequence's counts"
        )
    if totals[0] % k:
        raise EngineFormatError(
            f"{label}: {int(totals[0])} slots per layer is not a multiple of k = {k} (each token takes k "
            "slots): is --model the model that produced this file?"
        )
    tokens = int(totals[0]) // k
    over = np.argwhere(counts > tokens)
    if over.size:
        i, expert = (int(v) for v in over[0])
        raise EngineFormatError(
            f"{label}: expert {expert} of layer {layers[i]} counts {int(counts[i, expert])} of {tokens} "
            "tokens; a token picks an expert at most once"
        )
