"""Open an MoE model from a local Hugging Face folder or a bundled sample, offline and safely."""

from __future__ import annotations

import functools
import json
import os
import re
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from moeviz.errors import (
    CorruptTokenizerError,
    CorruptWeightsError,
    InvalidConfigError,
    LoadOptionError,
    ModelNotFoundError,
    ModelSourceError,
    NotAModelFolderError,
    NotMoEModelError,
    UnknownSampleError,
    UnsafeWeightsError,
)
from moeviz.models.config_keys import (
    EXPERT_COUNT_KEYS,
    LAYER_COUNT_KEYS,
    STRICT_TOP_K_KEYS,
    config_int,
    layer_index,
)
from moeviz.models.placement import (
    RUNS_QUANTISED,
    ActivationShape,
    MemoryEstimate,
    check_quantization,
    estimate_memory,
    input_device,
    pick_device,
    placement_summary,
    read_safetensors_header,
    refuse_if_too_large,
    reporting_progress,
    resolve_dtype,
    stored_bytes,
)
from moeviz.models.sites import MoESite, find_moe_sites
from moeviz.resources import bundled_path
from moeviz.settings import current_settings
from moeviz.trace import ModelInfo

SAMPLE_PREFIX = "sample:"
# transformers sets torch's process-wide default dtype while it builds a model and puts it back afterwards:
# two loads at different dtypes on two threads (app sessions) would leave the wrong default behind.
MODEL_BUILD_LOCK = threading.Lock()
DEFAULT_SAMPLE = "sample:mixtral-healthy"  # the app's and the docs' default model
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
)


def sample_models_dir() -> Path:
    """Where bundled sample models live: `MOEVIZ_SAMPLE_MODELS` if set, else the installed (or checkout's)
    sample_models/."""
    return current_settings().sample_models or bundled_path("sample_models")


def list_samples() -> list[str]:
    """Sample model names: folders under sample_models/ with a config.json, and the checkpoints of a
    series one level down (`SERIES/STEP`)."""
    root = sample_models_dir()
    if not root.is_dir():
        return []
    configs = list(root.glob("*/config.json")) + list(root.glob("*/*/config.json"))
    return sorted(path.parent.relative_to(root).as_posix() for path in configs)


@dataclass
class LoadedModel:
    """A model ready for capture: the module, its tokenizer (if it ships one) and its MoE layers."""

    model: nn.Module
    tokenizer: Any | None
    sites: list[MoESite]
    info: ModelInfo
    folder: Path
    max_length: int | None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where inputs go
    memory: MemoryEstimate | None = None  # what the load-time memory check worked out

    _token_text_cache: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def is_encoder_decoder(self) -> bool:
        return bool(getattr(self.model.config, "is_encoder_decoder", False))

    # read from the config once: a transformers config attribute costs ~5 µs, a fixed cost per capture
    @functools.cached_property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)

    @functools.cached_property
    def activation_shape(self) -> ActivationShape:
        """The sizes the activation memory of a forward depends on (`placement.ActivationShape`)."""
        return ActivationShape.of(self.model.config)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id decoded on its own (what a token strip shows); cached, as captures repeat tokens."""
        return decode_each(self.tokenizer, self._token_text_cache, ids)

    def token_decoder(self) -> Callable[[list[int]], list[str]]:
        """`token_texts` holding only the tokenizer and the cache, not the model (for lazy token tables)."""
        return functools.partial(decode_each, self.tokenizer, self._token_text_cache)


def decode_each(tokenizer, cache: dict[int, str], ids: list[int]) -> list[str]:
    """Each id decoded on its own through `cache` ("⟨id⟩" without a tokenizer)."""
    missing = [i for i in ids if i not in cache]
    if missing:
        if tokenizer is None:
            texts = [f"⟨{i}⟩" for i in missing]
        else:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            singles = [[i] for i in missing]
            texts = (
                backend.decode_batch(singles, skip_special_tokens=False)
                if backend is not None
                else tokenizer.batch_decode(singles, clean_up_tokenization_spaces=False)
            )
        cache.update(zip(missing, texts, strict=True))  # dict updates are atomic under the GIL
    return [cache[i] for i in ids]


def resolve_source(source: str | Path) -> Path:
    """Map `sample:NAME` or a path to a model folder, with a specific error for each way it can fail."""
    text = str(source)
    if text.startswith(SAMPLE_PREFIX):
        name = text[len(SAMPLE_PREFIX) :]
        available = list_samples()
        if name not in available:
            listing = ", ".join(available) or "none are installed"
            raise UnknownSampleError(f"unknown sample model {name!r}; available samples: {listing}")
        return sample_models_dir() / name
    folder = Path(text).expanduser()
    if not folder.exists():
        raise ModelNotFoundError(
            f"model folder {folder} does not exist (models load from local folders only)"
        )
    if not folder.is_dir():
        raise NotAModelFolderError(
            f"{folder} is a file; give the folder that holds config.json and the weights"
        )
    if not (folder / "config.json").is_file():
        raise NotAModelFolderError(f"{folder} is not a Hugging Face model folder: it has no config.json")
    return folder


@dataclass
class SourceInfo:
    """What a model source declares, read as `load_model` reads it but without loading any weights."""

    folder: Path
    tokenizer: Any | None
    model_type: str
    max_length: int | None


def read_source(source: str | Path, *, trust_remote_code: bool = False) -> SourceInfo:
    """Folder, tokenizer, model type and context length of `source` (no weights: cheap checks before a run
    that loads the model elsewhere, e.g. on workers)."""
    folder = resolve_source(source)
    _check_regular_files(folder)
    tokenizer = _load_tokenizer(folder, trust_remote_code)
    config = _load_config(folder, trust_remote_code)
    return SourceInfo(folder, tokenizer, str(config.model_type), _max_length(config))


def load_model(
    source: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    device_map: str | int | dict[str, Any] | None = None,
    offload_folder: str | Path | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    trust_remote_code: bool = False,
    check_memory: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> LoadedModel:
    """Load an MoE model for capture.

    `source` is a local Hugging Face folder (config.json + safetensors, tokenizer optional) or
    `sample:NAME` for a folder under `sample_models/`. Nothing is downloaded. Pickled weights are refused
    unless they load with `torch.load(weights_only=True)`. Remote code runs only with `trust_remote_code`.

    `dtype`: `"auto"` keeps the checkpoint's own dtype (bf16 stays bf16; fp16 loads as fp32 on a CPU, which
    only emulates fp16), or `"float32"`, `"bfloat16"`, `"float16"` or a torch dtype. Router scores are always
    computed in fp32 from the logits the model produced. `device`: `"auto"` picks CUDA, then MPS, then CPU;
    or `"cpu"`, `"cuda"`, `"cuda:N"`, `"mps"`.

    `device_map` (needs `accelerate`) places the model across devices as `from_pretrained` does instead of
    `device`: `"auto"` splits a model too large for one GPU over the GPUs, then CPU RAM, then disk
    (`offload_folder`), under `max_memory` ({0: "20GiB", "cpu": "8GiB"}) if given, or a dict {module name:
    device | "cpu" | "disk"}. Inputs go to the embedding's device; accelerate streams offloaded weights in.

    Before any weight is read, the memory the model needs (parameters at `dtype` from a meta-device skeleton,
    plus activations for a 2,048-token input) is compared with what `device` has free; a model that does not
    fit is refused with `InsufficientMemoryError` (not with `device_map`; `check_memory=False` skips it).
    Quantised checkpoints load where transformers can run or dequantise them (FP8 and MXFP4 are dequantised
    on a CPU), else `UnsupportedQuantizationError`. `progress(bytes_read, total_bytes)` is called as the
    weights are read.
    """
    if device_map is None and (offload_folder is not None or max_memory is not None):
        raise LoadOptionError("offload_folder and max_memory need a device_map (e.g. device_map='auto')")
    folder = resolve_source(source)
    _check_regular_files(folder)  # before anything is opened: a FIFO would block the open forever
    config = _load_config(folder, trust_remote_code)
    use_safetensors, headers = _check_weight_files(folder)  # headers only: cheap, and bounds the config
    _check_config_against_weights(folder, config, headers)
    auto_class = _auto_class(config)
    target = pick_device(device)  # with a device_map, only the dtype rule and messages use it
    load_dtype = resolve_dtype(dtype, config, folder, target)
    try:
        with (
            MODEL_BUILD_LOCK,
            torch.device("meta"),
        ):  # find the MoE layers and size the model, no weights allocated
            skeleton = auto_class.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError) as exc:
        raise NotAModelFolderError(
            f"transformers cannot build a model from {folder}/config.json: {_one_line(exc)}"
        ) from exc
    if not find_moe_sites(skeleton):
        raise NotMoEModelError(
            f"{folder} holds a dense model ({type(skeleton).__name__}, model_type {config.model_type!r}): "
            "no MoE layer (router + experts) was found"
        )
    quantization_note = check_quantization(config, folder, target, device_map, load_dtype)
    quantised = quantization_note is not None and quantization_note.startswith(RUNS_QUANTISED)
    stored = stored_bytes(folder) if quantised else None
    estimate = estimate_memory(skeleton, config, load_dtype, target, stored_bytes=stored)
    del skeleton
    if check_memory and device_map is None:
        refuse_if_too_large(estimate, str(source))
    if device_map is not None:
        placement = _placement(device_map, offload_folder, max_memory)
    elif target.type != "cpu":
        placement = {"device_map": {"": str(target)}}
    else:
        placement = {}
    try:
        with MODEL_BUILD_LOCK, reporting_progress(progress, folder):
            model, loading_info = auto_class.from_pretrained(
                folder,
                config=config,
                dtype=load_dtype,
                local_files_only=True,
                trust_remote_code=trust_remote_code,
                use_safetensors=use_safetensors,
                output_loading_info=True,
                **placement,
            )
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, struct.error, SafetensorError) as exc:
        if device_map is not None:  # the weights were checked above: more likely the map does not fit
            raise ModelSourceError(
                f"could not load {folder} with device_map={device_map!r}: {_one_line(exc)}"
            ) from exc
        raise CorruptWeightsError(f"could not read the weights in {folder}: {_one_line(exc)}") from exc
    missing = [k for k in loading_info.get("missing_keys", []) if k]
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise CorruptWeightsError(
            f"weights in {folder} are incomplete: {len(missing)} tensors missing ({shown}…)"
        )
    model.eval()
    if placement:
        _align_inputs(model)
    sites = find_moe_sites(model)
    notes = [quantization_note] if quantization_note else []
    declared = json.loads((folder / "config.json").read_text()).get("model_type")
    if declared != config.model_type:
        notes.append(
            f"config declares model_type {declared!r}; read as the built-in {config.model_type!r} "
            "(the folder's own code was not run)"
        )
    return LoadedModel(
        model=model,
        tokenizer=_load_tokenizer(folder, trust_remote_code),
        sites=sites,
        info=ModelInfo(
            source=str(source),
            model_type=str(config.model_type),
            architecture=type(model).__name__,
            num_layers=_num_layers(config),
            num_parameters=sum(p.numel() for p in model.parameters()),
            dtype=str(load_dtype).removeprefix("torch."),
            device=placement_summary(model),
            parameter_bytes=estimate.parameter_bytes,
            notes=notes,
        ),
        folder=folder,
        max_length=_max_length(config),
        device=input_device(model),
        memory=estimate,
    )


def _placement(
    device_map: str | int | dict[str, Any],
    offload_folder: str | Path | None,
    max_memory: dict[int | str, int | str] | None = None,
) -> dict[str, Any]:
    """`from_pretrained` keywords for a device map; a clear error when accelerate is missing."""
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise ModelSourceError(
            "device_map needs the accelerate package: pip install accelerate (or moeviz[ray])"
        )
    placement: dict[str, Any] = {"device_map": device_map}
    if offload_folder is not None:
        placement["offload_folder"] = str(offload_folder)
    if max_memory is not None:
        placement["max_memory"] = dict(max_memory)
    return placement


def _align_inputs(model: nn.Module) -> None:
    """Capture feeds CPU tensors. Accelerate moves them (and the outputs back) only when it split the model
    over devices; a model placed whole on one accelerator gets the same top-level hook here."""
    if getattr(model, "_hf_hook", None) is not None:
        return
    devices = {p.device for p in model.parameters()} - {torch.device("meta")}
    if len(devices) != 1 or next(iter(devices)).type == "cpu":
        return
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    add_hook_to_module(model, AlignDevicesHook(execution_device=devices.pop(), io_same_device=True))


def _load_config(folder: Path, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        raw = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise NotAModelFolderError(f"{folder}/config.json is not valid JSON ({reason})") from exc
    if not isinstance(raw, dict):
        raise NotAModelFolderError(f"{folder}/config.json is not a JSON object")
    try:
        config = AutoConfig.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except ValueError as exc:
        builtin = None if trust_remote_code else _builtin_config_for(raw)
        if builtin is None:
            hint = (
                ""
                if trust_remote_code
                else " If the folder ships its own modelling code, pass trust_remote_code."
            )
            raise ModelSourceError(
                f"transformers cannot build the model in {folder}: {_one_line(exc)}.{hint}"
            ) from exc
        config = builtin
    except (TypeError, KeyError, IndexError, AttributeError, OSError) as exc:
        raise NotAModelFolderError(f"{folder}/config.json is unusable: {_one_line(exc)}") from exc
    _check_config(folder, config)
    return config


def _builtin_config_for(raw: dict):
    """A config whose model_type transformers does not know but whose architecture it has built in (Kimi K2
    ships `model_type: kimi_k2` with remote code for what is `DeepseekV3ForCausalLM`): read it with the
    built-in config class instead of running the folder's code."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for architecture in raw.get("architectures") or []:
        candidates = [t for t, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if name == architecture]
        # Several model types may reuse one class (e.g. sarvam_mla): prefer the one it is named after.
        stem = architecture.split("For")[0].lower()
        candidates.sort(key=lambda t: t.replace("_", "").replace("-", "") != stem)
        model_type = candidates[0] if candidates else None
        if model_type in CONFIG_MAPPING:
            fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
            return CONFIG_MAPPING[model_type].from_dict(fields)
    return None


def _auto_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM


def _check_weight_files(folder: Path) -> tuple[bool, dict[str, dict[str, Any]]]:
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
                f"(convert it to safetensors): {_one_line(exc)}"
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


# Files a load may open (config, tokenizer, weights, shard indexes): each must be a regular file.
_OPENED_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".tiktoken", ".jinja", *_PICKLE_SUFFIXES)


def _check_regular_files(folder: Path) -> None:
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


# Sizes every model needs positive (where the config has them as integers).
_POSITIVE_SIZES = (
    "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "head_dim", "d_model", "d_ff", "n_layers", "n_heads", "num_layers",
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


def _check_config_against_weights(folder: Path, config, entries: dict[str, dict[str, Any]]) -> None:
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


def _one_line(exc: BaseException) -> str:
    """An exception's message as one short line (messages of transformers and tokenizers span lines)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "…"


def _load_tokenizer(folder: Path, trust_remote_code: bool):
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # tokenizers' own errors are a plain Exception; the files are user input
        raise CorruptTokenizerError(
            f"the tokenizer files in {folder} could not be read: {_one_line(exc)}"
        ) from exc


def _num_layers(config) -> int:
    return config_int(config, LAYER_COUNT_KEYS) or 0


def _max_length(config) -> int | None:
    for attr in ("max_position_embeddings", "max_seq_len", "n_positions"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
