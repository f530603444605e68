"""JSON output: the one sanitiser every JSON moeviz writes goes through (reports, what-ifs, the Lab's record).

JSON has no NaN or infinity, and numpy scalars and arrays are not JSON types: `jsonable` turns NaN and ±inf
into null, numpy values into Python ones and tuples into lists, recursively; `dumps` writes strict JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any


def jsonable(value: Any) -> Any:
    """`value` with every NaN / ±inf → None, numpy scalar → Python scalar, array or tuple → list (nested
    dicts and lists included)."""
    if isinstance(value, dict):
        return {key: jsonable(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy arrays and scalars
        return jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps(value: Any, indent: int | None = 1) -> str:
    """Strict JSON of `jsonable(value)` (no NaN or Infinity tokens)."""
    return json.dumps(jsonable(value), indent=indent, allow_nan=False)
