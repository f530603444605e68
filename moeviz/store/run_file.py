"""A run's `run.json`: what was traced (model source, corpus, chunking, the MoE layers), written with its own
SHA-256 and validated before a store query, a what-if or the app trusts a number in it.

The `sha256` key holds the hex SHA-256 of the file's other keys as canonical JSON (sorted keys, no
indentation), so one flipped digit (`num_experts` 8 → 9) is refused instead of reported as a ninth dead
expert. Runs written before the hash was recorded have none and are read unverified (as their parts are).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from moeviz.errors import RunFileError
from moeviz.scoring import SCORE_FUNCTIONS

MAX_RUN_FILE_BYTES = 64 << 20  # a run.json lists a few facts per MoE layer: kilobytes, not megabytes
MAX_EXPERTS = 1 << 16
# key -> (accepted types, smallest value for integers); None among the types: the key may be null
RUN_KEYS: dict[str, tuple[tuple[type | None, ...], int]] = {
    "source": ((str,), 0),
    "model_type": ((str,), 0),
    "corpus": ((str, None), 0),
    "corpus_id": ((str,), 0),
    "chunk_tokens": ((int, None), 1),
    "batch_size": ((int,), 0),
    "max_batches": ((int, None), 1),
    "confidence": ((bool,), 0),
    "checkpoint_index": ((int,), 0),
    "total_batches": ((int, None), 0),
}
OPTIONAL_KEYS = {"layers", "sha256", "adapter"}
LAYER_KEYS = {"layer", "site", "num_experts", "k", "score_fn", "bias"}


def _canonical(config: dict[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in config.items() if k != "sha256"}, sort_keys=True).encode()


def run_hash(config: dict[str, Any]) -> str:
    """The hex SHA-256 a run.json records of its other keys."""
    return hashlib.sha256(_canonical(config)).hexdigest()


def run_file_bytes(config: dict[str, Any]) -> bytes:
    """The bytes of a run.json for `config`, its `sha256` key (re)computed."""
    return json.dumps({**config, "sha256": run_hash(config)}, indent=1, sort_keys=True).encode()


def read_run_file(path: Path) -> dict[str, Any]:
    """The config a run.json records, its hash verified (when it has one) and its schema checked; RunFileError
    naming the file and what is wrong otherwise."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise RunFileError(f"{path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):  # a FIFO would block a reader forever, a symlink leave the store
        raise RunFileError(f"{path}: not a regular file")
    if info.st_size > MAX_RUN_FILE_BYTES:
        raise RunFileError(f"{path}: {info.st_size} bytes, more than a run.json holds ({MAX_RUN_FILE_BYTES})")
    try:
        config = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise RunFileError(f"{path} is not valid JSON ({type(exc).__name__}: {exc})"[:300]) from None
    if not isinstance(config, dict):
        raise RunFileError(f"{path}: a JSON {type(config).__name__}, not an object")
    recorded = config.get("sha256")
    if recorded is not None and recorded != run_hash(config):
        raise RunFileError(f"{path}: its content does not match its sha256 (the file was changed or damaged)")
    check_run_config(path, config)
    return config


def _fail(path: Path, where: str, what: str) -> None:
    raise RunFileError(f"{path}: {where}: {what}")


def _check_value(path: Path, where: str, value: Any, kinds: tuple[type | None, ...], low: int) -> None:
    if value is None:
        if None not in kinds:
            _fail(path, where, "must not be null")
        return
    if isinstance(value, bool) and bool not in kinds:
        _fail(path, where, f"expected {' or '.join(k.__name__ for k in kinds if k)}, got {value!r}")
    if not any(k is not None and isinstance(value, k) for k in kinds):
        _fail(path, where, f"expected {' or '.join(k.__name__ for k in kinds if k)}, got {value!r:.40}")
    if isinstance(value, int) and not isinstance(value, bool) and value < low:
        _fail(path, where, f"{value} is below {low}")


def check_run_config(path: Path, config: dict[str, Any]) -> None:
    """Every key known and of its type; each recorded layer complete and consistent (k ≤ experts, a bias of
    one number per expert)."""
    unknown = sorted(set(config) - set(RUN_KEYS) - OPTIONAL_KEYS)
    if unknown:
        _fail(path, "keys", f"unknown {unknown}")
    missing = sorted(set(RUN_KEYS) - set(config))
    if missing:
        _fail(path, "keys", f"missing {missing}")
    for key, (kinds, low) in RUN_KEYS.items():
        _check_value(path, key, config[key], kinds, low)
    layers = config.get("layers")
    if layers is None:
        return
    if not isinstance(layers, list):
        _fail(path, "layers", f"expected a list, got {type(layers).__name__}")
    for index, layer in enumerate(layers):
        where = f"layers[{index}]"
        if not isinstance(layer, dict) or set(layer) != LAYER_KEYS:
            got = sorted(layer) if isinstance(layer, dict) else type(layer).__name__
            _fail(path, where, f"expected the keys {sorted(LAYER_KEYS)}, got {got}")
        _check_value(path, f"{where}.layer", layer["layer"], (int,), 0)
        _check_value(path, f"{where}.site", layer["site"], (str,), 0)
        _check_value(path, f"{where}.num_experts", layer["num_experts"], (int,), 1)
        _check_value(path, f"{where}.k", layer["k"], (int,), 1)
        experts = layer["num_experts"]
        if experts > MAX_EXPERTS or layer["k"] > experts:
            _fail(
                path, where, f"k = {layer['k']} of {experts} experts is not a router (at most {MAX_EXPERTS})"
            )
        if layer["score_fn"] not in SCORE_FUNCTIONS:
            _fail(
                path, f"{where}.score_fn", f"{layer['score_fn']!r:.40} is not one of {list(SCORE_FUNCTIONS)}"
            )
        bias = layer["bias"]
        if bias is not None and not (
            isinstance(bias, list)
            and len(bias) == experts
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bias)
        ):
            _fail(path, f"{where}.bias", f"expected null or {experts} numbers")
