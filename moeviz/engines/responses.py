"""What the importers of saved engine responses share: reading a file of API responses (one JSON object, a
JSON list, or JSON Lines), token-id lists, nested id lists, base64 and `.npy` bytes (never unpickled, the
header's shape checked against the bytes before anything is allocated). Used by `vllm_routed`, `megatron` and
`sglang_routed`.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal, TextIO

import numpy as np

from moeviz.errors import EngineFormatError, InputError

INTEGER_KINDS = "iu"


def read_responses(path: Path, fmt: str) -> Iterator[tuple[str, dict]]:
    """(label, response) of each saved API response in `path`: one JSON object, a JSON list of them, or
    JSON Lines (one object a line), yielded one at a time. JSON Lines are streamed (a rollout file of a
    million tokens is never all in memory as text); anything else is read as one JSON document."""
    with _text(path) as lines:
        first = _first_line(lines)
        try:
            head = json.loads(first)
            whole = None
        except json.JSONDecodeError:  # a document over several lines: read it whole
            head, whole = None, first + lines.read()
        second = None if whole is not None else _first_line(lines)
    if whole is None and second == "":  # one line: a document like any other
        whole = first
    if whole is not None:
        try:
            value = json.loads(whole)
        except json.JSONDecodeError as exc:
            raise EngineFormatError(f"{path}: not JSON or JSON Lines ({exc.msg})") from exc
        values = value if isinstance(value, list) else [value]
        if not values:
            raise EngineFormatError(f"{path}: no response in the file")
        for number, item in enumerate(values, start=1):
            label = path.name if not isinstance(value, list) else f"{path.name}, response {number}"
            yield _checked(label, item, fmt)
        return
    yield _checked(f"{path.name}, line 1", head, fmt)
    with _text(path) as lines:
        for number, line in enumerate(lines, start=1):
            if number == 1 or not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EngineFormatError(f"{path}, line {number}: not JSON ({exc.msg})") from exc
            yield _checked(f"{path.name}, line {number}", item, fmt)


@contextlib.contextmanager
def _text(path: Path) -> Iterator[TextIO]:
    try:
        with path.open(encoding="utf-8") as handle:
            yield handle
    except UnicodeDecodeError as exc:
        raise EngineFormatError(f"{path}: not a text file of JSON responses ({exc})") from exc


def _first_line(lines: TextIO) -> str:
    """The next line that is not blank ("" at the end of the file)."""
    for line in lines:
        if line.strip():
            return line
    return ""


def _checked(label: str, item: Any, fmt: str) -> tuple[str, dict]:
    if not isinstance(item, dict):
        raise EngineFormatError(f"{label}: a JSON {type(item).__name__}, expected a response object ({fmt})")
    return label, item


def token_list(value: Any, what: str) -> np.ndarray | None:
    """[T] int64 token ids from a JSON list of integers; None for null. Checked by the dtype numpy infers
    (a float, a string or a nested list makes it not an integer array): no Python loop over the ids."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise EngineFormatError(f"{what}: expected a list of token ids")
    if not value:
        return np.zeros(0, np.int64)
    try:
        ids = np.asarray(value)
    except (ValueError, OverflowError):  # ragged nesting, or an integer beyond int64
        ids = np.asarray([None])
    if ids.ndim != 1 or ids.dtype.kind not in INTEGER_KINDS:
        raise EngineFormatError(f"{what}: expected a list of token ids")
    return ids.astype(np.int64, copy=False)


def nested_ids(value: Any, what: str) -> np.ndarray | None:
    """[R, L, k] int64 from nested JSON lists (vLLM 0.21); None for null or an empty list."""
    if value is None or (isinstance(value, list) and not value):
        return None
    if not isinstance(value, list):
        raise EngineFormatError(
            f"{what}: a {type(value).__name__}, expected nested lists [tokens][layers][k]"
        )
    try:
        ids = np.asarray(value)
    except ValueError as exc:  # ragged lists
        raise EngineFormatError(f"{what}: rows of different lengths ({exc})") from exc
    if ids.ndim != 3 or ids.dtype.kind not in INTEGER_KINDS:
        raise EngineFormatError(
            f"{what}: expected integers [tokens][layers][k], got {ids.ndim} levels of {ids.dtype.name}"
        )
    return ids


def decode_base64(value: str, what: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EngineFormatError(f"{what}: not base64 ({exc})") from exc


def npy_file(path: Path, kinds: str = INTEGER_KINDS) -> np.ndarray:
    """The array of a `.npy` file, memory-mapped (never unpickled, nothing read into memory); its dtype must
    be of `kinds` (numpy kind letters: integers by default; "iuf" for counts written as floats)."""
    if not path.is_file():
        raise InputError(f"{path} is not a file")
    with path.open("rb") as fp:
        shape, order, dtype, offset = _npy_header(fp, path.stat().st_size, str(path), kinds)
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order=order)


def npy_bytes(data: bytes, what: str) -> np.ndarray:
    """The integer array of `.npy` bytes in memory, as a read-only view of them (no copy, never unpickled)."""
    shape, order, dtype, offset = _npy_header(io.BytesIO(data), len(data), what, INTEGER_KINDS)
    flat = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=offset)
    return flat.reshape(shape, order=order)


def _npy_header(
    fp: BinaryIO, size: int, what: str, kinds: str
) -> tuple[tuple[int, ...], Literal["C", "F"], np.dtype, int]:
    """(shape, order, dtype, offset of the data) of `.npy` bytes (`size` of them), checked against `size`
    before anything is allocated from the header's shape. An object array (which would need unpickling) or a
    dtype not of `kinds` is refused."""
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        elif version in ((2, 0), (3, 0)):  # 3.0 differs from 2.0 only in the header's text encoding
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
        else:
            raise ValueError(f"format version {version[0]}.{version[1]} (np.save writes 1.0 to 3.0)")
    except (ValueError, EOFError, SyntaxError) as exc:
        raise EngineFormatError(f"{what}: not a .npy file as np.save writes it ({exc})") from exc
    if dtype.hasobject:
        raise EngineFormatError(f"{what}: a .npy of Python objects (pickled): never unpickled")
    if dtype.kind not in kinds:
        expected = "integers" if kinds == INTEGER_KINDS else "numbers"
        raise EngineFormatError(f"{what}: an array of dtype {dtype}; expected {expected}")
    offset = fp.tell()
    nbytes = math.prod(shape) * dtype.itemsize
    if offset + nbytes != size:
        raise EngineFormatError(
            f"{what}: the .npy header says {list(shape)} {dtype} ({nbytes:,} bytes) but {size - offset:,} "
            "bytes follow it"
        )
    return tuple(shape), ("F" if fortran else "C"), dtype, offset
