"""Token ids for engine routing whose file does not carry them (`moeviz import --token-ids F | --text T`).

- a JSON file: one sequence `[id, …]`, or several `[[id, …], …]`;
- a Parquet file: a list column `token_ids` (one row per sequence), or a flat `token_id` column with an
  optional `seq` column (rows in order within each sequence);
- texts, tokenised with the model's own tokenizer (special tokens as the tokenizer adds them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moeviz.engines.layout import RoutingLayout
from moeviz.errors import InputError


def read_token_ids(path: str | Path, vocab_size: int | None = None) -> list[np.ndarray]:
    """Per-sequence token ids [T_i] (int64) from a JSON or Parquet file; ids outside the vocabulary (when
    `vocab_size` is given) are refused."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--token-ids {path} is not a file")
    if path.suffix == ".parquet":
        sequences = _parquet_ids(path)
    else:
        try:
            value = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"--token-ids {path}: not a JSON file ({exc})") from exc
        sequences = _json_ids(path, value)
    for i, ids in enumerate(sequences):
        if len(ids) and (ids.min() < 0 or (vocab_size and ids.max() >= vocab_size)):
            bad = ids[(ids < 0) | (ids >= (vocab_size or np.iinfo(np.int64).max))][0]
            raise InputError(f"--token-ids {path}: sequence {i} holds id {bad}, outside [0, {vocab_size})")
    return sequences


def _json_ids(path: Path, value) -> list[np.ndarray]:
    if isinstance(value, list) and all(_is_int(v) for v in value):
        value = [value]
    if not (isinstance(value, list) and value and all(isinstance(s, list) for s in value)):
        raise InputError(f"--token-ids {path}: expected a list of ids or a list of such lists")
    for i, seq in enumerate(value):
        if not all(_is_int(v) for v in seq):
            raise InputError(f"--token-ids {path}: sequence {i} holds something other than integers")
    return [np.asarray(seq, dtype=np.int64) for seq in value]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parquet_ids(path: Path) -> list[np.ndarray]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for non-Parquet input
        raise InputError(f"--token-ids {path}: not a readable Parquet file ({exc})") from exc
    names = table.column_names
    if "token_ids" in names:
        return [np.asarray(row, dtype=np.int64) for row in table.column("token_ids").to_pylist()]
    if "token_id" not in names:
        raise InputError(f"--token-ids {path}: no `token_ids` (list) or `token_id` column; has {names}")
    ids = table.column("token_id").to_numpy().astype(np.int64)
    if "seq" not in names:
        return [ids]
    seq = table.column("seq").to_numpy()
    cuts = np.flatnonzero(np.diff(seq)) + 1
    if np.any(np.diff(seq) < 0):
        raise InputError(f"--token-ids {path}: the `seq` column is not in ascending order")
    return list(np.split(ids, cuts))


def text_token_ids(layout: RoutingLayout, texts: Sequence[str]) -> list[np.ndarray]:
    """Each text tokenised by the model's tokenizer."""
    tokenizer = layout.tokenizer()
    if tokenizer is None:
        raise InputError(f"{layout.source} ships no tokenizer: give --token-ids instead of --text")
    return [np.asarray(tokenizer(text)["input_ids"], dtype=np.int64) for text in texts]


def ids_for(given: list[np.ndarray] | None, count: int, what: str) -> list[np.ndarray | None]:
    """The given token ids, one list per sequence of the file (`count` of them), or Nones."""
    if given is None:
        return [None] * count
    if len(given) != count:
        raise InputError(f"{len(given)} token-id sequences given for the {count} sequences of {what}")
    return list(given)


def agreed_token_ids(label: str, own: np.ndarray | None, given: np.ndarray | None) -> np.ndarray | None:
    """The token ids of a sequence whose file carries ids (`own`; -1 where it does not know one) and the user
    gave some too (`given`): the given ids, once every id the file knows agrees with them over their common
    length (InputError naming the first differing position); whichever exists when only one does. Whether
    the count fits the routing rows is `routed_trace`'s check."""
    if given is None or own is None:
        return given if own is None else own
    given = np.asarray(given, dtype=np.int64)
    n = min(len(own), len(given))
    differ = np.flatnonzero((own[:n] >= 0) & (own[:n] != given[:n]))
    if len(differ):
        pos = int(differ[0])
        raise InputError(
            f"{label}: the token ids given differ from the file's at position {pos} (given "
            f"{int(given[pos])}, the file {int(own[pos])})"
        )
    return given
