"""config.json read and checked before transformers sees it: a regular file of bounded size and nesting that
parses as a JSON object, whose size fields (layers, widths, heads, vocabulary, context, experts, top-k) are
positive integers, whose `rope_parameters` is an object and whose `model_type` and `architectures` are
names; and transformers' own refusals of a config put into one line naming the field. Each refusal is a
`ModelSourceError` (`InvalidConfigError` for a config that is JSON but not a model's)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import stat
import types
import typing
from pathlib import Path
from typing import Any

from moeviz.errors import InvalidConfigError, NotAModelFolderError
from moeviz.models.config_keys import EXPERT_COUNT_KEYS, LAYER_COUNT_KEYS, STRICT_TOP_K_KEYS

CONFIG_MAX_BYTES = 16 * 2**20  # real configs are kilobytes; the largest (module lists) well under 1 MiB
# Real configs nest at most 6 levels (every config class transformers ships); deeper JSON is refused before
# transformers recurses over it (copy.deepcopy and to_dict recurse once per level).
CONFIG_MAX_DEPTH = 32
# Sizes every model has, never null (unless its config class says so): refused when missing a value.
CORE_SIZES = (
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "max_position_embeddings",
)
# Sizes that, where a config has them, are positive integers (a per-layer list of them where the config class
# takes a list); null only where the config class allows it. Top-k (STRICT_TOP_K_KEYS) is checked for its type
# only here: its range, 1 … E, once the config says E (`checks.read_config`).
POSITIVE_SIZES = (
    *CORE_SIZES, *LAYER_COUNT_KEYS, *EXPERT_COUNT_KEYS, "num_key_value_heads",
    "intermediate_size", "moe_intermediate_size", "d_model", "d_ff", "n_heads", "num_heads",
    "encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim",
    "ffn_hidden_size", "max_seq_len", "n_positions",
)  # fmt: skip
NON_NEGATIVE_SIZES = ("head_dim",)  # 0 in GLM-5-next's NoPE attention
OBJECT_FIELDS = ("rope_parameters", "rope_scaling")  # an object (or null)
ROPE_NUMBERS = (
    "rope_theta", "factor", "partial_rotary_factor", "original_max_position_embeddings", "attention_factor",
    "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor", "mscale", "mscale_all_dim",
)  # fmt: skip
_NOT_A_SUB_CONFIG = ("quantization_config",)  # its keys are the quantiser's, not the model's
_FIELD_ERROR = re.compile(r"Validation error for field '(?P<field>[^']*)':\s*(?P<cause>.*)", re.DOTALL)


def read_config_json(folder: Path) -> dict[str, Any]:
    """The folder's config.json as a dict, refused with one line when it is not a regular file, is larger
    than CONFIG_MAX_BYTES, is not UTF-8 JSON, nests deeper than CONFIG_MAX_DEPTH, or is not an object."""
    path = folder / "config.json"
    try:
        info = path.stat()  # follows links; opens nothing (a FIFO would block the open)
    except OSError as exc:
        raise NotAModelFolderError(f"{folder}/config.json cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise NotAModelFolderError(
            f"{folder}/config.json is not a regular file (a FIFO, device or folder): not read"
        )
    if info.st_size > CONFIG_MAX_BYTES:
        raise InvalidConfigError(
            f"{folder}/config.json is {info.st_size / 2**20:,.1f} MiB; a model config is under "
            f"{CONFIG_MAX_BYTES // 2**20} MiB"
        )
    with path.open("rb") as handle:
        data = handle.read(CONFIG_MAX_BYTES + 1)
    if len(data) > CONFIG_MAX_BYTES:  # grew since the stat
        raise InvalidConfigError(f"{folder}/config.json is over {CONFIG_MAX_BYTES // 2**20} MiB")
    too_deep = InvalidConfigError(
        f"{folder}/config.json nests deeper than {CONFIG_MAX_DEPTH} levels: not a model config"
    )
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise NotAModelFolderError(f"{folder}/config.json is not valid JSON ({reason})") from exc
    except RecursionError:  # the parser recurses once per level: ~1,000 levels exhaust the stack
        raise too_deep from None
    if _nesting(raw) > CONFIG_MAX_DEPTH:
        raise too_deep
    if not isinstance(raw, dict):
        raise NotAModelFolderError(f"{folder}/config.json is not a JSON object")
    return raw


def _nesting(value: Any) -> int:
    """How deeply `value` (parsed JSON) nests objects and lists, counted without recursing."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth + 1)
            if deepest > CONFIG_MAX_DEPTH:
                break
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_config_fields(folder: Path, raw: dict[str, Any]) -> None:
    """Refuse (one line naming the field, dotted for a sub-config: `text_config.hidden_size`) a config whose
    size fields are not positive integers (strings, floats, booleans; null where its config class does not
    allow it), whose `rope_parameters` is not an object, whose `model_type` is not a string or whose
    `architectures` is not a list of strings. Sub-configs
    (`text_config`, `ffn_config`, ...) are checked by the same rules."""
    _check_level(folder, raw, "", _config_class(raw, None, ""))


def _check_level(folder: Path, raw: dict[str, Any], prefix: str, config_class: type | None) -> None:
    model_type = raw.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise InvalidConfigError(
            f"{folder}/config.json: {prefix}model_type must be a string, got {_shown(model_type)}"
        )
    architectures = raw.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
    ):
        raise InvalidConfigError(
            f"{folder}/config.json: {prefix}architectures must be a list of class names, got "
            f"{_shown(architectures)}"
        )
    for name, value in raw.items():
        where = f"{folder}/config.json: {prefix}{name}"
        if name in POSITIVE_SIZES or name in NON_NEGATIVE_SIZES or name in STRICT_TOP_K_KEYS:
            least = 1 if name in POSITIVE_SIZES else 0 if name in NON_NEGATIVE_SIZES else None
            _check_size(where, value, least, name in CORE_SIZES, _annotation(config_class, name))
        elif name in OBJECT_FIELDS:
            _check_rope(where, value)
        elif isinstance(value, dict) and name.endswith("config") and name not in _NOT_A_SUB_CONFIG:
            _check_level(folder, value, f"{prefix}{name}.", _config_class(value, config_class, name))


def _check_rope(where: str, value: Any) -> None:
    """`rope_parameters` (or the older `rope_scaling`): an object (or null) whose numbers are numbers; an
    object per attention type (Gemma's full / sliding) is checked the same way."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise InvalidConfigError(f"{where} must be an object (or null), got {_shown(value)}")
    for key, item in value.items():
        if isinstance(item, dict):
            _check_rope(f"{where}.{key}", item)
        elif key in ROPE_NUMBERS and item is not None and not _is_finite_number(item):
            raise InvalidConfigError(f"{where}.{key} must be a finite number, got {_shown(item)}")


def _check_size(where: str, value: Any, least: int | None, core: bool, annotation: Any) -> None:
    """One size field: an integer >= `least` (any integer for None); null or a list of them only where
    `annotation` (its config class's type, None when unknown) allows, or, unknown, for a field that is not
    one of CORE_SIZES."""
    kind = "an integer" if least is None else "a positive integer" if least == 1 else f"an integer >= {least}"
    lowest = -math.inf if least is None else least
    if value is None:
        allowed = _admits(annotation, type(None))
        if allowed is False or (allowed is None and core):
            raise InvalidConfigError(f"{where} must be {kind}, got null")
        return
    if isinstance(value, list) and _admits(annotation, list) is not False and not core:
        for item in value:
            if not _is_int(item) or item < lowest:
                raise InvalidConfigError(f"{where} must be a list of {kind}s, got an item {_shown(item)}")
        return
    if not _is_int(value) or value < lowest:
        raise InvalidConfigError(f"{where} must be {kind}, got {_shown(value)}")


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A JSON value as the file spells it, short, with what it is when that is not a number."""
    text = json.dumps(value)
    text = text if len(text) <= 40 else text[:37] + "…"
    kinds = {
        bool: "a boolean",
        str: "a string",
        float: "a number with a fraction",
        list: "a list",
        dict: "an object",
    }
    kind = kinds.get(type(value))
    if isinstance(value, float) and value.is_integer():
        kind = "a float"
    return f"{text} ({kind})" if kind else text


def _config_class(raw: dict[str, Any], parent: type | None, name: str) -> type | None:
    """The transformers config class a (sub-)config dict is read into, when it is known: by its model_type,
    else the one its parent class declares for `name` (`sub_configs`); None otherwise (remote code)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    declared = (getattr(parent, "sub_configs", None) or {}).get(name) if parent is not None else None
    return declared if isinstance(declared, type) and dataclasses.is_dataclass(declared) else None


def _annotation(config_class: type | None, name: str) -> Any:
    """The type `config_class` declares for field `name`; None when the class or the field is unknown."""
    if config_class is None or not dataclasses.is_dataclass(config_class):
        return None
    for field in dataclasses.fields(config_class):
        if field.name == name:
            return field.type
    return None


def _admits(annotation: Any, kind: type) -> bool | None:
    """Whether a field declared `annotation` takes values of `kind` (NoneType or list); None when unknown."""
    if annotation is None:
        return None
    if isinstance(annotation, str):  # a postponed annotation, unevaluated
        return ("None" if kind is type(None) else kind.__name__) in annotation
    members = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    return any(member is kind or typing.get_origin(member) is kind for member in members)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def transformers_config_error(folder: Path, exc: BaseException) -> InvalidConfigError:
    """transformers' (huggingface_hub's strict dataclass) refusal of a config as one line naming the field:
    `…/config.json: field 'hidden_size' is refused by transformers: TypeError: Field 'hidden_size' expected
    int, got str (value: '64')`."""
    text = " ".join(str(exc).split())
    match = _FIELD_ERROR.match(text)
    if match:
        message = f"field {match['field']!r} is refused by transformers: {match['cause']}"
    else:
        message = f"transformers refuses it: {text or type(exc).__name__}"
    message = message if len(message) <= 300 else message[:297] + "…"
    return InvalidConfigError(f"{folder}/config.json: {message}")
