"""FLAME-MoE's public routing traces (format "flame"); definitions, traps and sources:
docs/engine-formats.md, "Public traces".

The dataset (CMU-FLAME/FLAME-MoE-Traces): `samples/NNN.parquet` (`token_id`, one row per
token) and `actives/iter_NNNN/layer_NN.parquet` (`indices` and `scores`: each token's top-k expert ids and
router softmax probabilities, sorted by score), row i of every file the same token. `layer_NN` is
Megatron's 1-based `layer_number` (hidden layer NN − 1; the first layer of every FLAME-MoE model is dense).
The files name neither sequences nor iterations beyond the folder, so:
- one sequence per samples file, in file order (the dataset marks no sequence boundaries);
- one iteration per import: give `…/actives/iter_N` (or its layer files), or a model folder holding one
  iteration (`flame_files(…, iteration=N)` picks one of several);
- a subset of the MoE layers may be given: the trace then holds those layers only (a note says so).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeviz.engines.checks import check_expert_sets
from moeviz.engines.layout import RoutingLayout
from moeviz.engines.routed import RoutedSequence, routed_trace
from moeviz.errors import EngineFormatError, InputError
from moeviz.trace import Trace

FLAME_LAYER = re.compile(r"^layer_(\d+)\.parquet$")
FLAME_ITERATION = re.compile(r"^iter_(\d+)$")


def read(fmt: str, files: Sequence[Path], layout: RoutingLayout, token_ids) -> Trace:
    """The `moeviz.engines` entry point of format "flame"."""
    return read_flame(flame_files(files), layout, token_ids)


@dataclass(frozen=True)
class FlameFiles:
    """One iteration's files: `layers` Megatron layer number (1-based) → actives file; `samples` in order."""

    layers: dict[int, Path]
    samples: list[Path]
    iteration: int | None


def flame_files(paths: Sequence[Path], iteration: int | None = None) -> FlameFiles:
    """The files of one FLAME-MoE import from what the user gave: `layer_NN.parquet` files, samples files,
    an `iter_N` folder (its samples are found at `../../samples`), a model folder (`samples/`, `actives/`),
    or a dataset root holding one model folder. `iteration` picks one `iter_N` of a model folder that holds
    several; without it such a folder is refused with the iterations it holds."""
    found: list[tuple[int, Path]] = []
    samples: list[Path] = []
    iterations: set[int] = set()
    for path in map(Path, paths):
        for file in _flame_expand(path, iteration):
            match = FLAME_LAYER.match(file.name)
            if match is None:
                samples.append(file)
                continue
            folder = FLAME_ITERATION.match(file.parent.name)
            if folder is not None:
                iterations.add(int(folder.group(1)))
            found.append((int(match.group(1)), file))
    if len(iterations) > 1:
        listed = ", ".join(f"iter_{i}" for i in sorted(iterations))
        raise InputError(
            f"FLAME layer files of several iterations ({listed}): import one iteration at a time"
        )
    layers: dict[int, Path] = {}
    for number, file in found:
        if number in layers and layers[number].resolve() != file.resolve():
            raise InputError(f"two files for FLAME layer {number}: {layers[number]} and {file}")
        layers[number] = file
    unique = list(dict.fromkeys(p.resolve() for p in samples))
    if not layers:
        raise InputError("FLAME: no actives file (actives/iter_N/layer_NN.parquet) among the files given")
    return FlameFiles(
        dict(sorted(layers.items())),
        sorted(unique, key=_sample_order),
        next(iter(iterations)) if iterations else None,
    )


def _sample_order(path: Path) -> tuple[int, str]:
    """samples/NNN.parquet in numeric order (names without a number after those with one)."""
    return (int(path.stem), path.name) if path.stem.isdigit() else (1 << 62, path.name)


def _parquet_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.parquet") if p.is_file())


def _flame_expand(path: Path, iteration: int | None) -> list[Path]:
    """The Parquet files a path stands for."""
    if path.is_file():
        if path.suffix != ".parquet":
            raise InputError(f"{path}: FLAME-MoE traces are .parquet files")
        return [path]
    if not path.is_dir():
        raise InputError(f"{path} does not exist")
    if FLAME_ITERATION.match(path.name):
        samples = path.parent.parent / "samples"
        layers = [p for p in _parquet_files(path) if FLAME_LAYER.match(p.name)]
        return layers + (_parquet_files(samples) if samples.is_dir() else [])
    if path.name == "samples":
        return _parquet_files(path)
    if (path / "actives").is_dir() or (path / "samples").is_dir():
        actives = path / "actives"
        found = sorted(
            (int(m.group(1)), d)
            for d in (actives.iterdir() if actives.is_dir() else [])
            if d.is_dir() and (m := FLAME_ITERATION.match(d.name))
        )
        if iteration is not None:
            found = [(i, d) for i, d in found if i == iteration]
            if not found:
                raise InputError(f"{path}: no actives/iter_{iteration} folder")
        if len(found) > 1:
            listed = ", ".join(d.name for _, d in found)
            raise InputError(f"{path} holds several iterations ({listed}): give one, e.g. {found[-1][1]}")
        chosen = [p for p in _parquet_files(found[0][1]) if FLAME_LAYER.match(p.name)] if found else []
        return chosen + (_parquet_files(path / "samples") if (path / "samples").is_dir() else [])
    models = sorted(d for d in path.iterdir() if d.is_dir() and (d / "actives").is_dir())
    if len(models) == 1:
        return _flame_expand(models[0], iteration)
    if models:
        listed = ", ".join(d.name for d in models)
        raise InputError(f"{path} holds several FLAME-MoE models ({listed}): give one model's folder")
    raise InputError(
        f"{path} is not a FLAME-MoE trace folder (no samples/ or actives/iter_N/ inside, no layer_NN.parquet)"
    )


def read_flame(files: FlameFiles, layout: RoutingLayout, token_ids: list[np.ndarray] | None = None) -> Trace:
    """A Trace of one FLAME-MoE iteration: experts and weights (the scores) per layer file, logits absent,
    token ids from the samples files (checked against `token_ids` when both are given)."""
    k = layout.top_k
    hidden = {number: number - 1 for number in files.layers}  # Megatron's layer_number counts from 1
    for number, path in files.layers.items():
        if hidden[number] not in layout.moe_layers:
            kind = "dense" if 0 <= hidden[number] < layout.num_hidden_layers else "not a layer"
            expected = ", ".join(f"layer_{m + 1:02d}" for m in layout.moe_layers)
            raise EngineFormatError(
                f"{path}: Megatron layer {number} is hidden layer {hidden[number]}, {kind} in --model "
                f"(its MoE layers are files {expected}): is --model the model that produced these files?"
            )
    # One [R, L, k] array each for ids and weights, filled layer by layer: no per-layer lists stacked later.
    experts: np.ndarray | None = None
    weights: np.ndarray | None = None
    first = next(iter(files.layers.values()))
    unsorted = 0
    for index, path in enumerate(files.layers.values()):
        table = _read_parquet(path, ("indices", "scores"))
        layer_ids = _list_column(table, "indices", path, k, integer=True)
        # fp32 before any check: numpy computes on fp16 in software, ~5× slower
        layer_scores = _list_column(table, "scores", path, k, integer=False).astype(np.float32)
        del table
        if experts is None or weights is None:  # the first file: both allocated together
            id_type = np.int16 if layout.num_experts < 2**15 else np.int32
            experts = np.empty((len(layer_ids), len(files.layers), k), dtype=id_type)
            weights = np.empty((len(layer_ids), len(files.layers), k), dtype=np.float32)
        elif len(layer_ids) != len(experts):
            raise EngineFormatError(
                f"{path}: {len(layer_ids)} rows, {first.name} has {len(experts)}: row i of every actives "
                "file is the same token, so the files are not of one capture"
            )
        _check_flame_ids(layer_ids, layout.num_experts, path)
        _check_scores(layer_scores, path)
        layer_ids, layer_scores, count = _ranked_by_score(layer_ids, layer_scores)
        unsorted += count
        experts[:, index] = layer_ids
        weights[:, index] = layer_scores
    if experts is None or weights is None or not len(experts):
        raise EngineFormatError(f"{first}: no rows")
    rows = len(experts)
    notes: list[str] = []
    if unsorted:
        notes.append(
            f"{unsorted:,} (token, layer) rows were not sorted by score; moeviz ordered their slots by "
            "descending score"
        )
    lengths, samples = _flame_tokens(files.samples, rows, layout, token_ids)
    moe = tuple(sorted(hidden.values()))
    if moe != layout.moe_layers:
        missing = [f"layer_{m + 1:02d}" for m in layout.moe_layers if m not in moe]
        notes.append(f"only hidden layers {list(moe)} imported: no file for {', '.join(missing)}")
        layout = dataclasses.replace(layout, moe_layers=moe)
    iteration = f"iter_{files.iteration}" if files.iteration is not None else "an unnamed iteration"
    names = [p.name for p in files.samples] or [f"sequence {i}" for i in range(len(lengths))]
    sequences, start = [], 0
    for index, length in enumerate(lengths):
        stop = start + length
        sequences.append(
            RoutedSequence(
                experts=experts[start:stop],
                token_ids=samples[index] if samples is not None else None,
                weights=weights[start:stop],
                label=f"FLAME {iteration}, {names[index]}",
            )
        )
        start = stop
    shared = f"; its {layout.shared_experts} shared experts are not logged" if layout.shared_experts else ""
    notes.append(
        f"FLAME-MoE {iteration}: {rows:,} tokens in {len(lengths)} sequence(s), one per samples file (the "
        "dataset marks no sequence boundaries); weights are the router's softmax probabilities of the "
        f"{k} chosen experts as the dataset stores them (fp16); router logits are not recorded{shared}"
    )
    return routed_trace(layout, sequences, source="flame", notes=notes, ranked=True)


def _read_parquet(path: Path, columns: tuple[str, ...]):
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as exc:  # pyarrow raises several types for non-Parquet input
        raise EngineFormatError(f"{path}: not a readable Parquet file ({exc})") from exc
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise EngineFormatError(
            f"{path}: no `{missing[0]}` column (columns: {', '.join(schema.names)}); a FLAME-MoE "
            + (
                "samples file has `token_id`"
                if "token_id" in columns
                else "layer file has `indices`, `scores`"
            )
        )
    return pq.read_table(path, columns=list(columns))


def _list_column(table, name: str, path: Path, k: int, *, integer: bool) -> np.ndarray:
    """[R, k] values of a list column (list, large_list or fixed_size_list) whose every row holds k."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table.column(name).combine_chunks()
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
        raise EngineFormatError(f"{path}: `{name}` is {kind}, not a list per token")
    if column.null_count:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise EngineFormatError(f"{path}: row {row} has no `{name}` (null)")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    wrong = np.flatnonzero(lengths != k)
    if wrong.size:
        row = int(wrong[0])
        raise EngineFormatError(
            f"{path}: row {row} holds {int(lengths[row])} {name}, the model routes each token to {k} "
            "experts (top-k): is --model the model that produced these files?"
        )
    values = column.flatten()
    value_type = values.type
    expected = pa.types.is_integer(value_type) if integer else pa.types.is_floating(value_type)
    if not expected:
        raise EngineFormatError(
            f"{path}: `{name}` holds {value_type}, expected "
            + ("integer expert ids" if integer else "float scores")
        )
    if values.null_count:
        raise EngineFormatError(f"{path}: `{name}` holds a null value")
    return values.to_numpy(zero_copy_only=False).reshape(-1, k)


def _check_flame_ids(ids: np.ndarray, num_experts: int, path: Path) -> None:
    """FLAME writes every token's k ids in [0, E): no -1 padding, so a negative id is refused here rather
    than read as a row the engine did not run."""
    negative = np.flatnonzero((ids < 0).any(axis=1))
    if negative.size:
        row = int(negative[0])
        raise EngineFormatError(
            f"{path}, row {row}: expert ids {ids[row].tolist()} outside [0, {num_experts}) (FLAME writes no "
            f"padding; the model has {num_experts} routed experts)"
        )
    check_expert_sets(ids, num_experts, lambda row: f"{path}, row {row}")


def _check_scores(scores: np.ndarray, path: Path) -> None:
    """Softmax probabilities: finite and in [0, 1]."""
    bad = ~np.isfinite(scores) | (scores < 0) | (scores > 1)
    if bad.any():
        row = int(np.flatnonzero(bad.any(axis=1))[0])
        raise EngineFormatError(
            f"{path}, row {row}: scores {scores[row].tolist()} are not router probabilities (each in [0, 1])"
        )


def _ranked_by_score(ids: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """ids/scores [R, k] with each row ordered by descending score, as the dataset card says they are
    (stable: ties keep the file's order), and how many rows were not (copies only then: Arrow's arrays
    are read-only views)."""
    unsorted = np.flatnonzero((np.diff(scores, axis=1) > 0).any(axis=1))
    if unsorted.size:
        order = np.argsort(-scores[unsorted], axis=1, kind="stable")
        ids, scores = ids.copy(), scores.copy()
        ids[unsorted] = np.take_along_axis(ids[unsorted], order, axis=1)
        scores[unsorted] = np.take_along_axis(scores[unsorted], order, axis=1)
    return ids, scores, int(unsorted.size)


def _flame_tokens(
    samples: list[Path], rows: int, layout: RoutingLayout, given: list[np.ndarray] | None
) -> tuple[list[int], list[np.ndarray] | None]:
    """(tokens per sequence, token ids per sequence or None): from the samples files (one sequence each),
    checked against `given`; from `given` alone; or one sequence without ids."""
    if not samples:
        if given is None:
            return [rows], None
        total = sum(len(g) for g in given)
        if total != rows:
            raise EngineFormatError(
                f"{total} token ids given for {rows} rows of FLAME routing (one id per row: the actives rows "
                "are every token the model ran)"
            )
        return [len(g) for g in given], [np.asarray(g, dtype=np.int64) for g in given]
    import pyarrow as pa

    ids = []
    for path in samples:
        table = _read_parquet(path, ("token_id",))
        column = table.column("token_id").combine_chunks()
        if not pa.types.is_integer(column.type) or column.null_count:
            raise EngineFormatError(f"{path}: `token_id` must be integers without nulls, is {column.type}")
        values = column.to_numpy(zero_copy_only=False).astype(np.int64)
        vocab = layout.vocab_size
        bad = np.flatnonzero((values < 0) | (values >= vocab)) if vocab else np.flatnonzero(values < 0)
        if bad.size:
            raise EngineFormatError(
                f"{path}, row {int(bad[0])}: token id {int(values[bad[0]])} outside the model's vocabulary "
                f"[0, {vocab}): is --model the model that produced these files?"
            )
        ids.append(values)
    total = sum(len(v) for v in ids)
    if total != rows:
        raise EngineFormatError(
            f"the samples files hold {total:,} tokens, the actives files {rows:,} rows: row i of each is the "
            "same token, so they must be of one capture (give every samples file, in order)"
        )
    if given is not None:
        _check_given(ids, given, samples)
    return [len(v) for v in ids], ids


def _check_given(ids: list[np.ndarray], given: list[np.ndarray], samples: list[Path]) -> None:
    if len(given) != len(ids):
        raise EngineFormatError(
            f"{len(given)} token-id sequences given; the FLAME import has {len(ids)} (one per samples file)"
        )
    for path, have, want in zip(samples, ids, given, strict=True):
        want = np.asarray(want, dtype=np.int64)
        if len(want) != len(have):
            raise EngineFormatError(f"{path}: {len(have)} tokens, the ids given for it {len(want)}")
        differ = np.flatnonzero(have != want)
        if differ.size:
            i = int(differ[0])
            raise EngineFormatError(
                f"{path}, position {i}: token id {int(have[i])} in the file, {int(want[i])} in the ids given"
            )
