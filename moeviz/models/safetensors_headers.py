"""Safetensors headers, read and checked without loading a tensor: the tensors a checkpoint holds and their
bytes (what the load-time checks, the dtype choice, the memory estimate and the load progress all read)."""

from __future__ import annotations

import functools
import itertools
import json
import math
import stat
import struct
from pathlib import Path
from typing import Any

from moeviz.errors import CorruptWeightsError

_SAFETENSORS_ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1, "F4": 0.5, "C64": 8,
    "F6_E2M3": 0.75, "F6_E3M2": 0.75,
}  # fmt: skip
_MAX_HEADER_BYTES = 100_000_000  # what the safetensors library itself accepts


def stored_bytes(folder: Path) -> int:
    """Bytes of tensor data in the folder's safetensors files (what `progress` counts)."""
    return sum(_entry_bytes(entry) for entry in safetensors_entries(folder).values())


def tensor_bytes(folder: Path) -> dict[str, int]:
    """{tensor name: bytes of its data} over every safetensors file in `folder` (as `safetensors_entries`)."""
    return {name: _entry_bytes(entry) for name, entry in safetensors_entries(folder).items()}


def stored_bytes_by_dtype(folder: Path) -> dict[str, int]:
    """{safetensors dtype name ("BF16", "F32", ...): bytes of tensor data stored in it} over the folder's
    safetensors files, in the order the dtypes first appear."""
    by_dtype: dict[str, int] = {}
    for entry in safetensors_entries(folder).values():
        by_dtype[entry["dtype"]] = by_dtype.get(entry["dtype"], 0) + _entry_bytes(entry)
    return by_dtype


def safetensors_entries(folder: Path) -> dict[str, dict[str, Any]]:
    """{tensor name: header entry (dtype, shape, data_offsets)} over every safetensors file in `folder`
    (files whose header does not check out are skipped: `read_safetensors_header` says why)."""
    entries: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            entries.update(read_safetensors_header(path))
        except (OSError, CorruptWeightsError):
            continue
    return entries


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """{tensor name: entry} of one safetensors file, after checking the whole header (CorruptWeightsError,
    one line, never echoing the file's bytes): a regular file; a header length that fits the file; a JSON
    object of {dtype, shape, data_offsets} entries with a known dtype; each tensor's bytes (shape × dtype)
    equal to its offsets' span, inside the file; no two tensors sharing bytes."""
    info = path.stat()  # follows links; never opens (a FIFO would block the open)
    if not stat.S_ISREG(info.st_mode):
        raise CorruptWeightsError(
            f"{path.name} is not a regular file (a FIFO, device or folder): refusing to read it"
        )
    name, size = path.name, info.st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CorruptWeightsError(f"{name} is truncated ({size} bytes): not a safetensors file")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise CorruptWeightsError(f"{name} is not a safetensors file: header length invalid")
        raw = handle.read(header_len)
    return dict(_parse_header(name, raw, size - 8 - header_len))


# One load reads each header several times (validation, memory estimate, progress): the bytes are read
# every time (cheap, and a rewritten file is never missed), the JSON parsed and checked once.
@functools.lru_cache(maxsize=16)
def _parse_header(name: str, raw: bytes, data_size: int) -> dict[str, dict[str, Any]]:
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise CorruptWeightsError(f"{name} has a corrupt header (not JSON: {reason})") from exc
    except RecursionError:  # the parser recurses once per level: ~1,000 nested arrays exhaust the stack
        raise CorruptWeightsError(f"{name} has a corrupt header (JSON nested too deeply)") from None
    if not isinstance(header, dict):
        raise CorruptWeightsError(f"{name} has a corrupt header: the header is not a JSON object")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    spans = []
    for key, entry in entries.items():
        _check_entry(name, key, entry, data_size)
        if entry["data_offsets"][1] > entry["data_offsets"][0]:  # empty tensors hold no bytes
            spans.append((*entry["data_offsets"], key))
    spans.sort()
    for (_, end, before), (start, _, after) in itertools.pairwise(spans):
        if start < end:
            raise CorruptWeightsError(
                f"{name} is corrupt: the data of tensors {before!r} and {after!r} overlap"
            )
    return entries


def _check_entry(name: str, key: str, entry: Any, data_size: int) -> None:
    """One header entry: known dtype, shape of non-negative ints, offsets inside the data, span = bytes."""

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CorruptWeightsError(f"{name} has a malformed header entry for {key!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _SAFETENSORS_ITEMSIZE:
        shown = dtype if isinstance(dtype, str) and len(dtype) <= 16 else "?"
        raise CorruptWeightsError(f"{name}: tensor {key!r} has an unknown dtype {shown!r}")
    if not isinstance(shape, list) or not all(map(is_int, shape)):
        raise CorruptWeightsError(f"{name} has a malformed header entry for {key!r} (shape)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_int, offsets)):
        raise CorruptWeightsError(f"{name} has a malformed header entry for {key!r} (data_offsets)")
    start, end = offsets
    if start > end:
        raise CorruptWeightsError(
            f"{name} is corrupt: tensor {key!r} has data_offsets that end before they start"
        )
    if end > data_size:
        raise CorruptWeightsError(
            f"{name} is truncated or corrupt: tensor {key!r} ends at data byte {end}, past the end of the "
            f"file ({data_size} bytes of data)"
        )
    bits = math.prod(shape) * int(_SAFETENSORS_ITEMSIZE[dtype] * 8)
    if bits != (end - start) * 8:
        raise CorruptWeightsError(
            f"{name} is corrupt: tensor {key!r} of shape {shape} ({dtype}) needs {bits // 8} bytes, its "
            f"data_offsets span {end - start}"
        )


def _entry_bytes(entry: dict[str, Any]) -> int:
    start, end = entry.get("data_offsets", (0, 0))
    if end > start:
        return int(end - start)
    itemsize = _SAFETENSORS_ITEMSIZE.get(entry.get("dtype", ""), 4)
    return int(math.prod(entry.get("shape", [])) * itemsize)
