"""The refusals before any weight is read: the folder's files, its config, and its weight files (safetensors
headers, shard indexes, pickles) against each other. Each raises a specific `moeviz.errors` type with a
one-line message."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import torch

from moeviz.errors import (
    CorruptWeightsError,
    InvalidConfigError,
    ModelSourceError,
    NotAModelFolderError,
    UnsafeWeightsError,
)
from moeviz.models.config_check import check_config_fields, read_config_json, transformers_config_error
from moeviz.models.config_keys import EXPERT_COUNT_KEYS, LAYER_COUNT_KEYS, STRICT_TOP_K_KEYS, layer_index
from moeviz.models.safetensors_headers import read_safetensors_header

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# Files a load may open (config, tokenizer, weights, shard indexes): each must be a regular file.
_OPENED_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".tiktoken", ".jinja", *_PICKLE_SUFFIXES)


def exception_line(exc: BaseException) -> str:
    """An exception's message as one short line (messages of transformers and tokenizers span lines)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "…"


def check_regular_files(folder: Path) -> None:
    """Refuse a folder whose config, tokenizer or weight files are not regular files (a FIFO blocks the first
    open forever, a device never ends): checked with stat, which opens nothing."""
    for entry in os.scandir(folder):
        if not entry.name.endswith(_OPENED_SUFFIXES):
            continue
        try:
            mode = os.stat(entry.path).st_mode  # follows links
        except OSError:
            continue  # a dangling link: reported as missing where it matters
        if not stat.S_ISREG(mode):
            raise NotAModelFolderError(
                f"{entry.name} in {folder} is not a regular file (a FIFO, device or folder): not read"
            )


def read_config(folder: Path, trust_remote_code: bool):
    """The folder's config as transformers reads it, refused (with the reason) when config.json is not a JSON
    object, transformers cannot build it, or it declares sizes no model can have."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    raw = read_config_json(folder)
    check_config_fields(folder, raw)  # before transformers: its strict validation raises, not refuses
    try:
        config = AutoConfig.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (StrictDataclassError, RecursionError) as exc:
        raise transformers_config_error(folder, exc) from exc
    except ValueError as exc:
        builtin = None if trust_remote_code else _builtin_config_for(folder, raw)
        if builtin is None:
            hint = (
                ""
                if trust_remote_code
                else " If the folder ships its own modelling code, pass trust_remote_code."
            )
            raise ModelSourceError(
                f"transformers cannot build the model in {folder}: {exception_line(exc)}.{hint}"
            ) from exc
        config = builtin
    except (TypeError, KeyError, IndexError, AttributeError, OSError) as exc:
        raise NotAModelFolderError(f"{folder}/config.json is unusable: {exception_line(exc)}") from exc
    _check_config(folder, config)
    return config


def _builtin_config_for(folder: Path, raw: dict):
    """A config whose model_type transformers does not know but whose architecture it has built in (Kimi K2
    ships `model_type: kimi_k2` with remote code for what is `DeepseekV3ForCausalLM`): read it with the
    built-in config class instead of running the folder's code."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for architecture in raw.get("architectures") or []:
        candidates = [t for t, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if name == architecture]
        # Several model types may reuse one class (e.g. sarvam_mla): prefer the one it is named after.
        stem = architecture.split("For")[0].lower()
        candidates.sort(key=lambda t: t.replace("_", "").replace("-", "") != stem)
        model_type = candidates[0] if candidates else None
        if model_type is not None and model_type in CONFIG_MAPPING:
            config_class = CONFIG_MAPPING[model_type]
            fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
            check_config_fields(folder, {**fields, "model_type": model_type})  # by the class it is read into
            try:
                return config_class.from_dict(fields)
            except (StrictDataclassError, RecursionError) as exc:
                raise transformers_config_error(folder, exc) from exc
    return None


def check_weight_files(folder: Path) -> tuple[bool, dict[str, dict[str, Any]]]:
    """Validate weight files before transformers reads them. Returns (safetensors?, {tensor: header entry}
    over every safetensors file; empty for pickles)."""
    safetensors = sorted(folder.glob("*.safetensors"))
    if safetensors:
        entries: dict[str, dict[str, Any]] = {}
        for path in safetensors:
            entries.update(read_safetensors_header(path))
        for index in sorted(folder.glob("*.safetensors.index.json")):
            _check_index(index)
        return True, entries
    pickled = sorted(p for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if not pickled:
        raise CorruptWeightsError(f"{folder} has no weights (expected model.safetensors)")
    for path in pickled:
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # unpickling errors come in many types
            raise UnsafeWeightsError(
                f"{path.name} is a pickle that does not load with weights_only=True; refusing to unpickle it "
                f"(convert it to safetensors): {exception_line(exc)}"
            ) from exc
    return False, {}


def _check_index(index: Path) -> None:
    """A shard index may name only regular files of its own folder (no `../`, no absolute paths)."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise CorruptWeightsError(f"{index.name} is not a valid shard index (a JSON object)") from exc
    if not isinstance(weight_map, dict):
        raise CorruptWeightsError(f"{index.name} is not a valid shard index: it has no weight_map")
    for shard in set(weight_map.values()):
        plain = isinstance(shard, str) and shard not in ("", ".", "..") and Path(shard).name == shard
        if not plain or "\\" in shard or not (index.parent / shard).is_file():
            shown = repr(shard)[:80]
            raise CorruptWeightsError(
                f"{index.name} names shard {shown}, which is not a file of the model folder"
            )


# Sizes every model needs positive (where the config has them as integers); `head_dim` may be 0 (GLM-5-next's
# NoPE attention), never negative.
_NON_NEGATIVE_SIZES = ("head_dim",)
_POSITIVE_SIZES = (
    "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "d_model", "d_ff", "n_layers", "n_heads", "num_layers",
    "num_heads", "encoder_layers", "decoder_layers", "encoder_ffn_dim", "decoder_ffn_dim",
    "encoder_attention_heads", "decoder_attention_heads", "ffn_hidden_size",
)  # fmt: skip
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")
_FUSED_EXPERTS = re.compile(r"\.experts\.[A-Za-z_]+$")


def _config_fields(config) -> list[tuple[str, Any]]:
    """(name, value) of the config's fields and its sub-configs' (DBRX keeps experts in ffn_config)."""
    fields = list(vars(config).items())
    for _, value in list(fields):
        if hasattr(value, "to_dict") and not isinstance(value, type):
            fields += list(vars(value).items())
        elif isinstance(value, dict):
            fields += list(value.items())
    return fields


def _ints(value: Any) -> list[int]:
    """An int field, or a per-layer list of them; [] for anything else (None, floats, strings)."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _check_config(folder: Path, config) -> None:
    """Sizes a model cannot have are refused right after the config is read: non-positive sizes, no experts,
    top-k outside 1 … E."""
    fields = _config_fields(config)
    for name, value in fields:
        if name in _POSITIVE_SIZES + EXPERT_COUNT_KEYS and any(v <= 0 for v in _ints(value)):
            raise InvalidConfigError(f"{folder}/config.json: {name} must be a positive integer, got {value}")
        if name in _NON_NEGATIVE_SIZES and any(v < 0 for v in _ints(value)):
            raise InvalidConfigError(f"{folder}/config.json: {name} must be >= 0, got {value}")
    experts = [(n, v) for n, value in fields if n in EXPERT_COUNT_KEYS for v in _ints(value)]
    if not experts:
        return
    n_experts = max(v for _, v in experts)
    for name, value in fields:
        for k in _ints(value) if name in STRICT_TOP_K_KEYS else []:
            if not 1 <= k <= n_experts:
                raise InvalidConfigError(
                    f"{folder}/config.json: top-k ({name}) must be 1 … {n_experts} (the number of experts), "
                    f"got {k}"
                )


def check_config_against_weights(folder: Path, config, entries: dict[str, dict[str, Any]]) -> None:
    """A config may not declare more layers or experts than the weights hold (a config of 100,000 layers
    would otherwise build a skeleton for minutes before the weights are found not to match)."""
    if not entries:
        return
    layers = {index for name in entries if (index := layer_index(name)) is not None}
    declared = max(
        (v for n, value in _config_fields(config) if n in LAYER_COUNT_KEYS for v in _ints(value)), default=0
    )
    if layers and declared > max(layers) + 1:
        raise InvalidConfigError(
            f"{folder}/config.json declares {declared} layers but the weights hold {max(layers) + 1}"
        )
    held = [int(m.group(1)) + 1 for name in entries if (m := _EXPERT_INDEX.search(name))]
    held += [
        entry["shape"][0]
        for name, entry in entries.items()
        if _FUSED_EXPERTS.search(name) and len(entry["shape"]) >= 3
    ]
    experts = max(
        (v for n, value in _config_fields(config) if n in EXPERT_COUNT_KEYS for v in _ints(value)), default=0
    )
    if held and experts > max(held):
        raise InvalidConfigError(
            f"{folder}/config.json declares {experts} experts per layer but the weights hold {max(held)}"
        )
