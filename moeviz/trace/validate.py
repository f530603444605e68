"""Validation of moeviz's Parquet files (traces and load tables) before anything in them is trusted.

A file is read in this order, each step refusing with one `TraceFormatError` line that names the file:
1. the footer only: the `moeviz` metadata parsed as JSON into a dict (no recursion blow-up, no non-JSON), and
   its integrity hash (`moeviz.sha256`, the SHA-256 of the metadata bytes) checked where the format has one;
2. the metadata's schema: every key known, every value of its type and in its range (`model_info`,
   `token_table`, `layer_facts`);
3. the footer's row count and columns against what the metadata describes, and the memory the read needs
   against a budget (`check_footer`) — before a single data page is read, so a small file that claims
   10^9 rows allocates nothing;
4. the data pages, read with their CRC checksums verified (written since trace format 5 / load format 2).
The reader then checks what only the data can show: no nulls, expert ids in −1 … E−1, ranks and layers
where the metadata puts them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moeviz.errors import TraceFormatError
from moeviz.scoring import SCORE_FUNCTIONS
from moeviz.trace.records import TOKEN_COLUMNS, ModelInfo

META_KEY = b"moeviz"
HASH_KEY = b"moeviz.sha256"
MAX_EXPERTS = 1 << 16  # router outputs of one layer; the largest released models have a few hundred
MAX_TOP_K = 1 << 10
MEMORY_SHARE = 0.5  # of the machine's memory one file may ask for


def metadata_hash(raw: bytes) -> bytes:
    """The integrity hash stored beside the metadata: hex SHA-256 of its bytes."""
    return hashlib.sha256(raw).hexdigest().encode()


def open_footer(path: Path):
    """The file's Parquet footer (a `pyarrow.parquet.ParquetFile`); TraceFormatError for a path that is not
    a regular file or not Parquet."""
    import pyarrow.parquet as pq

    if not path.is_file():  # a FIFO or a device would block or stream forever
        raise TraceFormatError(f"{path}: not a regular file")
    try:
        return pq.ParquetFile(path, page_checksum_verification=True)
    except Exception as exc:  # pyarrow raises several types for non-Parquet input
        raise TraceFormatError(f"{path}: not a readable Parquet file ({exc})") from exc


def read_metadata(path: Path, footer, *, hashed: Callable[[str], bool]) -> dict[str, Any]:
    """The `moeviz` metadata of a footer as a dict, its hash verified when present or when `hashed(format)`
    says the format requires one."""
    stored = footer.schema_arrow.metadata or {}
    raw = stored.get(META_KEY)
    if raw is None:
        raise TraceFormatError(f"{path}: a Parquet file, but not written by moeviz (no 'moeviz' metadata)")
    digest = stored.get(HASH_KEY)
    if digest is not None and digest != metadata_hash(raw):
        raise TraceFormatError(
            f"{path}: the moeviz metadata does not match its SHA-256 (the file is damaged)"
        )
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested thousands deep
        raise TraceFormatError(
            f"{path}: the moeviz metadata is not valid JSON ({type(exc).__name__})"
        ) from None
    if not isinstance(meta, dict):
        raise TraceFormatError(f"{path}: the moeviz metadata is a JSON {type(meta).__name__}, not an object")
    if digest is None and hashed(str(meta.get("format"))):
        raise TraceFormatError(
            f"{path}: format {meta.get('format')} carries a SHA-256 of its metadata; it is missing"
        )
    return meta


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require(path: Path, where: str, ok: bool, what: str) -> None:
    if not ok:
        raise TraceFormatError(f"{path}: {where}: {what}")


def checked_int(path: Path, where: str, value: Any, low: int = 0, high: int | None = None) -> int:
    """`value` if it is an integer in low … high (a JSON bool or float is not)."""
    require(path, where, _is_int(value), f"expected an integer, got {value!r:.40}")
    require(
        path, where, value >= low and (high is None or value <= high), f"{value} is outside {low} … {high}"
    )
    return value


def _check_keys(path: Path, where: str, mapping: Any, known: set[str], required: set[str]) -> None:
    require(path, where, isinstance(mapping, dict), f"expected an object, got {type(mapping).__name__}")
    unknown = sorted(set(mapping) - known)
    require(path, where, not unknown, f"unknown key(s) {unknown}")
    missing = sorted(required - set(mapping))
    require(path, where, not missing, f"missing key(s) {missing}")


def model_info(path: Path, raw: Any) -> ModelInfo:
    """The `model` object as a ModelInfo: known keys only, each of its field's type."""
    spec = {f.name: f for f in fields(ModelInfo)}
    required = {n for n, f in spec.items() if f.default is MISSING and f.default_factory is MISSING}
    _check_keys(path, "model", raw, set(spec), required)
    for name, value in raw.items():
        where = f"model.{name}"
        if name == "notes":
            require(
                path,
                where,
                isinstance(value, list) and all(isinstance(v, str) for v in value),
                "expected strings",
            )
        elif spec[name].type in ("int", int):
            checked_int(path, where, value)
        else:
            require(path, where, isinstance(value, str), f"expected a string, got {value!r:.40}")
    return ModelInfo(**raw)


_INT_TOKEN_COLUMNS = {"seq": 0, "pos": 0, "token_id": -1, "step": 0, "predicted_id": -1}  # -> smallest value


def token_table(path: Path, raw: Any) -> pd.DataFrame:
    """The `tokens` object as the token table (TOKEN_COLUMNS): equal-length columns of their types, each
    (stream, seq, pos) once."""
    _check_keys(path, "tokens", raw, set(TOKEN_COLUMNS), set(TOKEN_COLUMNS))
    lengths = {len(v) if isinstance(v, list) else -1 for v in raw.values()}
    require(path, "tokens", len(lengths) == 1 and -1 not in lengths, "columns are not lists of one length")
    columns = {}
    for name in TOKEN_COLUMNS:
        values = raw[name]
        kind = pd.api.types.infer_dtype(values, skipna=False) if values else "empty"
        if name in _INT_TOKEN_COLUMNS:
            require(
                path, f"tokens.{name}", kind in ("integer", "empty"), f"expected integers, got {kind} values"
            )
            array = np.asarray(values, dtype=np.int64) if values else np.zeros(0, np.int64)
            low = _INT_TOKEN_COLUMNS[name]
            require(path, f"tokens.{name}", not values or array.min() >= low, f"a value below {low}")
            columns[name] = array
        else:
            require(
                path, f"tokens.{name}", kind in ("string", "empty"), f"expected strings, got {kind} values"
            )
            columns[name] = values
    tokens = pd.DataFrame(columns)[TOKEN_COLUMNS]
    require(
        path,
        "tokens",
        not tokens.duplicated(["stream", "seq", "pos"]).any(),
        "a (stream, seq, pos) appears twice",
    )
    return tokens


def _int_or_none(low: int) -> Callable[[Path, str, Any], None]:
    def check(path: Path, where: str, value: Any) -> None:
        if value is not None:
            checked_int(path, where, value, low)

    return check


def _of(*allowed: str | None) -> Callable[[Path, str, Any], None]:
    def check(path: Path, where: str, value: Any) -> None:
        require(path, where, value in allowed, f"{value!r:.40} is not one of {list(allowed)}")

    return check


def _typed(kind: type) -> Callable[[Path, str, Any], None]:
    def check(path: Path, where: str, value: Any) -> None:
        require(path, where, type(value) is kind, f"expected {kind.__name__}, got {value!r:.40}")

    return check


_LAYER_KEYS: dict[str, tuple[Callable[[Path, str, Any], None], bool]] = {  # key -> (check, required)
    "layer": (_int_or_none(0), True),
    "site": (_typed(str), True),
    "num_tokens": (_int_or_none(0), True),
    "k": (_int_or_none(1), True),
    "num_experts": (_int_or_none(1), True),
    "score_fn": (_of(*SCORE_FUNCTIONS), True),
    "bias": (lambda path, where, value: None, True),  # checked against num_experts below
    "decision_source": (_typed(str), True),
    "top_k": (_int_or_none(1), True),
    "capacity": (_int_or_none(0), True),
    "shared_experts": (_int_or_none(0), True),
    "module": (_typed(str), True),
    "n_group": (_int_or_none(1), False),
    "topk_group": (_int_or_none(1), False),
    "group_score": (_of(None, "top2_sum", "max"), False),
    "has_logits": (_typed(bool), False),
    "has_weights": (_typed(bool), False),
    "ranked": (_typed(bool), False),
    "zero_experts": (_int_or_none(0), False),
    "hash_routed": (_typed(bool), False),
    "bias_on": (_of("scores", "logits"), False),
    "loop_pass": (_int_or_none(0), False),
}


def layer_facts(path: Path, index: int, raw: Any, num_tokens: int) -> dict[str, Any]:
    """One entry of `layers`, checked: known keys (those of format 1 required; later formats added the
    others), each of its type and range, and consistent with the token table and the other facts."""
    where = f"layers[{index}]"
    required = {key for key, (_, needed) in _LAYER_KEYS.items() if needed}
    _check_keys(path, where, raw, set(_LAYER_KEYS), required)
    for key, value in raw.items():
        _LAYER_KEYS[key][0](path, f"{where}.{key}", value)
    for key in ("layer", "num_tokens", "k", "num_experts"):
        require(path, f"{where}.{key}", raw[key] is not None, "expected an integer, got None")
    experts = raw["num_experts"]
    checked_int(path, f"{where}.num_experts", experts, 1, MAX_EXPERTS)
    checked_int(path, f"{where}.k", raw["k"], 1, min(experts, MAX_TOP_K))
    checked_int(path, f"{where}.num_tokens", raw["num_tokens"], 0, num_tokens)
    checked_int(path, f"{where}.zero_experts", raw.get("zero_experts", 0), 0, experts - 1)
    bias = raw["bias"]
    if bias is not None:
        require(
            path,
            f"{where}.bias",
            isinstance(bias, list)
            and len(bias) == experts
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bias),
            f"expected {experts} numbers",
        )
        require(
            path,
            f"{where}.bias",
            bool(np.isfinite(np.asarray(bias, dtype=np.float64)).all()),
            "a value is not finite",
        )
    n_group, topk_group = raw.get("n_group"), raw.get("topk_group")
    if n_group is not None:
        require(
            path,
            f"{where}.n_group",
            experts % n_group == 0,
            f"{n_group} groups do not divide {experts} experts",
        )
        require(
            path,
            f"{where}.topk_group",
            topk_group is None or topk_group <= n_group,
            f"more than {n_group} groups",
        )
    return raw


def memory_budget() -> int:
    """Bytes one file's read may ask for: MEMORY_SHARE of the machine's physical memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return int(total * MEMORY_SHARE)


def arrow_kind(kind) -> str:
    """What an Arrow type is to the readers: "integer", "float", "string", "float list" or its own name."""
    import pyarrow as pa

    if pa.types.is_integer(kind):
        return "integer"
    if pa.types.is_floating(kind):
        return "float"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "string"
    if pa.types.is_list(kind) and pa.types.is_floating(kind.value_type):
        return "float list"
    return str(kind)


def check_footer(path: Path, footer, *, rows: int, columns: Mapping[str, str], needs: int) -> None:
    """The footer agrees with the metadata before any data is read: `rows` rows, each named column present
    and of its kind (`arrow_kind`), and `needs` bytes within the memory budget."""
    have = footer.metadata.num_rows
    require(path, "rows", have == rows, f"the file holds {have} rows, its metadata describes {rows}")
    schema = footer.schema_arrow
    for name, kind in columns.items():
        require(path, "columns", name in schema.names, f"no '{name}' column")
        found = arrow_kind(schema.field(name).type)
        require(path, f"column '{name}'", found == kind, f"expected {kind} values, got {found}")
    budget = memory_budget()
    require(
        path,
        "size",
        needs <= budget,
        f"reading it needs ≈ {needs / 2**30:.1f} GiB, more than the {budget / 2**30:.1f} GiB allowed",
    )


def no_nulls(path: Path, table, names: list[str]) -> None:
    for name in names:
        nulls = table.column(name).null_count
        require(path, f"column '{name}'", nulls == 0, f"{nulls} null value(s)")
