"""Open an MoE model from a local Hugging Face folder or a bundled sample, offline and safely.

`load_model` runs three steps: check (the refusals in `moeviz.models.checks`, before anything is built),
plan (a meta-device skeleton: is it MoE, at which dtype, on which device, quantised or not, does it fit —
`placement`, `quantization`, `memory`) and materialise (`from_pretrained` with the planned placement, its
progress reported by `moeviz.models.progress`).
"""

from __future__ import annotations

import dataclasses
import functools
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
    InputError,
    LoadOptionError,
    ModelSourceError,
    NotAModelFolderError,
    NotMoEModelError,
    UnsupportedModelError,
)
from moeviz.models.adapters import CheckedAdapter, check_adapter, merge_adapter
from moeviz.models.checks import (
    check_config_against_weights,
    check_regular_files,
    check_weight_files,
    exception_line,
    read_config,
)
from moeviz.models.composite import auto_class_for, language_model, runnable_config, text_config
from moeviz.models.config_check import read_config_json
from moeviz.models.config_keys import LAYER_COUNT_KEYS, config_int
from moeviz.models.families import refusal
from moeviz.models.memory import ActivationShape, MemoryEstimate, estimate_memory, refuse_if_too_large
from moeviz.models.placement import (
    align_inputs,
    input_device,
    pick_device,
    placement_keywords,
    placement_summary,
    resolve_dtype,
)
from moeviz.models.progress import reporting_progress
from moeviz.models.quantization import RUNS_QUANTISED, check_quantization
from moeviz.models.safetensors_check import check_stored_dtypes
from moeviz.models.safetensors_headers import stored_bytes
from moeviz.models.sites import MoESite, find_moe_sites, pass_layers
from moeviz.models.sources import (  # noqa: F401  (re-exported: moeviz.models.loading's public names)
    DEFAULT_SAMPLE,
    SAMPLE_PREFIX,
    list_samples,
    resolve_source,
    sample_models_dir,
)
from moeviz.trace import ModelInfo

# transformers sets torch's process-wide default dtype while it builds a model and puts it back afterwards:
# two loads at different dtypes on two threads (app sessions) would leave the wrong default behind.
MODEL_BUILD_LOCK = threading.Lock()
# How a model's fused experts module computes (transformers 5's `experts_implementation`): "auto" leaves the
# choice to transformers (its `grouped_mm` kernel where the family's experts support it, else the per-expert
# loop), "eager" is the per-expert loop, "grouped_mm" / "batched_mm" its grouped and batched kernels.
EXPERTS_IMPLEMENTATIONS = ("auto", "eager", "grouped_mm", "batched_mm")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
)


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

    @property
    def is_token_classifier(self) -> bool:
        """A model that labels each token (OpenAI's privacy filter, a bidirectional encoder) rather than
        predicting the next one: its routing is captured, but nothing that needs next-token predictions
        (generation, counterfactuals, attribution, replay) applies."""
        return type(self.model).__name__.endswith("ForTokenClassification")

    def refuse_token_classifier(self, what: str) -> None:
        """InputError naming `what` when the model is a token classifier (`is_token_classifier`)."""
        if self.is_token_classifier:
            raise InputError(
                f"{what} needs next-token predictions; {self.info.source} is a token classifier "
                f"({type(self.model).__name__}), which labels tokens instead"
            )

    # read from the config once: a transformers config attribute costs ~5 µs, a fixed cost per capture
    @functools.cached_property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)

    @functools.cached_property
    def activation_shape(self) -> ActivationShape:
        """The sizes the activation memory of a forward depends on (`memory.ActivationShape`)."""
        return ActivationShape.of(self.model.config)

    @property
    def experts_implementation(self) -> str:
        """How the MoE layers' experts compute now: "eager" (transformers' per-expert loop, also for experts
        that have no other), "grouped_mm" or "batched_mm"; the names joined by ", " when the layers differ."""
        names = {
            str(site.experts.config._experts_implementation) if switchable_experts(site.experts) else "eager"
            for site in self.sites
            if site.experts is not None
        }
        return ", ".join(sorted(names)) or "eager"

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
    check_regular_files(folder)
    tokenizer = _load_tokenizer(folder, trust_remote_code)
    config = read_config(folder, trust_remote_code)
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
    experts_implementation: str = "auto",
    adapter: str | Path | None = None,
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

    `experts_implementation` chooses how a fused experts module computes (one of `EXPERTS_IMPLEMENTATIONS`):
    `"auto"` leaves it to transformers, which runs its `grouped_mm` kernel where the family's experts support
    it (DeepSeek-V3, Qwen3-MoE, Mixtral and most v5 families) and the per-expert loop elsewhere; `"eager"`
    forces the per-expert loop; `"grouped_mm"` and `"batched_mm"` are refused for a family whose experts have
    only the loop. The routing is captured from the experts module's arguments under each. In fp32,
    `grouped_mm` routes as the loop does (the same experts for every token, weights within float rounding:
    tests/models/test_experts_implementation.py) and runs the 256-expert DeepSeek-V3 shape ~1.8x faster on
    a CPU (benchmarks/bench_capture_scale.py). In bf16/fp16 the two add the k expert outputs differently
    (the loop rounds after each, grouped_mm once), so near-tied routing later in the model can differ: pass
    `"eager"` to capture what the per-expert loop routes. `loaded.experts_implementation` says what runs.

    `adapter`: a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) merged into the
    base's weights after they load (`moeviz.models.adapters`), so captures see ordinary modules; its
    config, file and every tensor's shape are checked against the base first, and `info.adapter` records it.
    Not with `device_map` (offloaded weights are not merged in memory) or a model that runs quantised.
    """
    options = (device_map, offload_folder, max_memory, experts_implementation)
    checked = _check(source, trust_remote_code, *options)
    lora = None if adapter is None else _check_adapter(adapter, checked, device_map)
    plan = _plan(checked, dtype, device, device_map, offload_folder, max_memory, check_memory)
    if lora is not None and plan.quantization_note and plan.quantization_note.startswith(RUNS_QUANTISED):
        raise LoadOptionError(f"an adapter merges into the weights; {checked.source} runs quantised")
    loaded = _materialise(checked, plan, progress)
    return loaded if lora is None else _with_adapter(loaded, lora)


def _check_adapter(adapter: str | Path, checked: _CheckedSource, device_map: Any) -> CheckedAdapter:
    """The adapter's refusals that need no weights (`adapters.check_adapter`), before the base loads."""
    if device_map is not None:
        raise LoadOptionError("an adapter merges into weights in memory: load it without a device_map")
    return check_adapter(adapter, checked.source, str(checked.config.model_type))


def _with_adapter(loaded: LoadedModel, adapter: CheckedAdapter) -> LoadedModel:
    """`loaded` with the adapter merged into its weights, its MoE layers found again and the adapter in its
    info (`ModelInfo.adapter`, and its notes)."""
    model, info = merge_adapter(loaded.model, adapter)
    notes = [*loaded.info.notes, *adapter.notes]
    model_info = dataclasses.replace(loaded.info, adapter=info.to_json(), notes=notes)
    return dataclasses.replace(loaded, model=model, sites=find_moe_sites(model), info=model_info)


@dataclass
class _CheckedSource:
    """A source that passed every check made before anything is built (`load_model`'s first step)."""

    source: str
    folder: Path
    config: Any  # the transformers config, checked against the weights
    use_safetensors: bool
    trust_remote_code: bool
    note: str | None = None  # what was loaded when it is not the whole checkpoint (`runnable_config`)
    experts_implementation: str = "auto"  # one of EXPERTS_IMPLEMENTATIONS
    headers: dict[str, dict[str, Any]] = field(default_factory=dict)  # {tensor: safetensors header entry}


@dataclass
class _LoadPlan:
    """How a checked source will load (`load_model`'s second step): decided on a meta-device skeleton."""

    auto_class: Any  # a transformers auto class (`composite.auto_class_for`)
    dtype: torch.dtype
    placement: dict[str, Any]  # `from_pretrained` keywords (`placement.placement_keywords`)
    device_map: str | int | dict[str, Any] | None
    estimate: MemoryEstimate
    quantization_note: str | None


def _check(
    source: str | Path,
    trust_remote_code: bool,
    device_map: str | int | dict[str, Any] | None,
    offload_folder: str | Path | None,
    max_memory: dict[int | str, int | str] | None,
    experts_implementation: str = "auto",
) -> _CheckedSource:
    """The refusals before anything is built: the options, the folder, its config and its weight files."""
    if device_map is None and (offload_folder is not None or max_memory is not None):
        raise LoadOptionError("offload_folder and max_memory need a device_map (e.g. device_map='auto')")
    if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
        raise LoadOptionError(
            f"unknown experts_implementation {experts_implementation!r}: use "
            + ", ".join(repr(name) for name in EXPERTS_IMPLEMENTATIONS)
        )
    folder = resolve_source(source)
    check_regular_files(folder)  # before anything is opened: a FIFO would block the open forever
    config, note = runnable_config(read_config(folder, trust_remote_code))
    reason = refusal(config.model_type)
    if reason is not None:
        raise UnsupportedModelError(
            f"{folder}: moeviz does not capture model_type {config.model_type!r}: {reason}"
        )
    use_safetensors, headers = check_weight_files(folder)  # headers only: cheap, and bounds the config
    check_config_against_weights(folder, config, headers)
    return _CheckedSource(
        str(source), folder, config, use_safetensors, trust_remote_code, note, experts_implementation, headers
    )


def _plan(
    checked: _CheckedSource,
    dtype: str | torch.dtype,
    device: str | torch.device,
    device_map: str | int | dict[str, Any] | None,
    offload_folder: str | Path | None,
    max_memory: dict[int | str, int | str] | None,
    check_memory: bool,
) -> _LoadPlan:
    """Build the model on the meta device (no weights allocated) to find its MoE layers and size it; choose
    its dtype and device, ask whether its quantisation runs here, and refuse it when it does not fit."""
    folder, config = checked.folder, checked.config
    auto_class = auto_class_for(config, folder)
    target = pick_device(device)  # with a device_map, only the dtype rule and messages use it
    load_dtype = resolve_dtype(dtype, config, folder, target)
    try:
        with MODEL_BUILD_LOCK, torch.device("meta"):
            skeleton = auto_class.from_config(config, trust_remote_code=checked.trust_remote_code)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError) as exc:
        raise NotAModelFolderError(
            f"transformers cannot build a model from {folder}/config.json: {exception_line(exc)}"
        ) from exc
    sites = find_moe_sites(skeleton)
    if not sites:
        raise NotMoEModelError(
            f"{folder} holds a dense model ({type(skeleton).__name__}, model_type {config.model_type!r}): "
            "no MoE layer (router + experts) was found"
        )
    _check_experts_implementation(checked, sites, type(skeleton).__name__)
    check_stored_dtypes(folder, skeleton, config, checked.headers)  # what the header checks cannot see
    quantization_note = check_quantization(config, folder, target, device_map, load_dtype)
    quantised = quantization_note is not None and quantization_note.startswith(RUNS_QUANTISED)
    stored = stored_bytes(folder) if quantised else None
    estimate = estimate_memory(skeleton, config, load_dtype, target, stored_bytes=stored)
    del skeleton
    if check_memory and device_map is None:
        refuse_if_too_large(estimate, checked.source)
    placement = placement_keywords(target, device_map, offload_folder, max_memory)
    return _LoadPlan(auto_class, load_dtype, placement, device_map, estimate, quantization_note)


def _check_experts_implementation(checked: _CheckedSource, sites: list[MoESite], architecture: str) -> None:
    """LoadOptionError when a kernel is asked for (`grouped_mm`, `batched_mm`) and some MoE layer's experts
    have only transformers' per-expert loop: the request would be ignored there without a word."""
    if checked.experts_implementation in ("auto", "eager"):
        return
    if not sites or not all(switchable_experts(site.experts) for site in sites):
        raise LoadOptionError(
            f"experts_implementation={checked.experts_implementation!r} does not apply to "
            f"{architecture} (model_type {checked.config.model_type!r}): its experts have only transformers' "
            "per-expert loop; use 'auto' or 'eager'"
        )


def switchable_experts(experts: nn.Module | None) -> bool:
    """Whether transformers' `@use_experts_implementation` wraps this experts module, so that its forward
    runs the kernel `config._experts_implementation` names; the decorator marks each instance with these
    attributes (transformers has no public flag for it)."""
    marks = ("has_gate", "is_concatenated", "_is_expert_parallel")
    return experts is not None and all(hasattr(experts, mark) for mark in marks)


def _materialise(
    checked: _CheckedSource, plan: _LoadPlan, progress: Callable[[int, int], None] | None
) -> LoadedModel:
    """Read the weights into the planned placement, refuse incomplete ones, and load the tokenizer."""
    folder, config = checked.folder, checked.config
    try:
        with MODEL_BUILD_LOCK, reporting_progress(progress, folder):
            model, loading_info = plan.auto_class.from_pretrained(
                folder,
                config=config,
                dtype=plan.dtype,
                local_files_only=True,
                trust_remote_code=checked.trust_remote_code,
                use_safetensors=checked.use_safetensors,
                output_loading_info=True,
                **plan.placement,
                **_experts_keywords(checked.experts_implementation),
            )
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, struct.error, SafetensorError) as exc:
        if plan.device_map is not None:  # the weights were checked above: more likely the map does not fit
            raise ModelSourceError(
                f"could not load {folder} with device_map={plan.device_map!r}: {exception_line(exc)}"
            ) from exc
        raise CorruptWeightsError(f"could not read the weights in {folder}: {exception_line(exc)}") from exc
    missing = [k for k in loading_info.get("missing_keys", []) if k]
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise CorruptWeightsError(
            f"weights in {folder} are incomplete: {len(missing)} tensors missing ({shown}…)"
        )
    model.eval()
    if plan.placement:
        align_inputs(model)
    sites = find_moe_sites(model)
    text_path, text_model = language_model(model)
    notes = [n for n in (checked.note, plan.quantization_note) if n]
    declared = read_config_json(folder).get("model_type")
    if declared != config.model_type and checked.note is None:
        notes.append(
            f"config declares model_type {declared!r}; read as the built-in {config.model_type!r} "
            "(the folder's own code was not run)"
        )
    return LoadedModel(
        model=model,
        tokenizer=_load_tokenizer(folder, checked.trust_remote_code),
        sites=sites,
        info=ModelInfo(
            source=checked.source,
            model_type=str(config.model_type),
            architecture=type(model).__name__,
            num_layers=_num_layers(config, text_model),
            num_parameters=sum(p.numel() for p in model.parameters()),
            dtype=str(plan.dtype).removeprefix("torch."),
            device=placement_summary(model),
            parameter_bytes=plan.estimate.parameter_bytes,
            notes=notes,
            language_model=f"{text_path} ({type(text_model).__name__})" if text_path else "",
        ),
        folder=folder,
        max_length=_max_length(config),
        device=input_device(model),
        memory=plan.estimate,
    )


def _experts_keywords(experts_implementation: str) -> dict[str, str]:
    """`from_pretrained` keywords for the experts implementation: none for "auto" (transformers' choice)."""
    return {} if experts_implementation == "auto" else {"experts_implementation": experts_implementation}


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
            f"the tokenizer files in {folder} could not be read: {exception_line(exc)}"
        ) from exc


def _num_layers(config, text_model: nn.Module | None = None) -> int:
    """Decoder layers in execution order: the length of the text model's `layers` where it has one
    (LongCat-Flash's config counts two sub-layers per block), else the config's count; a looped block counts
    once per pass (`sites.pass_layers`)."""
    if text_model is not None and not getattr(config, "is_encoder_decoder", False):
        for name, module in text_model.named_modules():
            if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(module):
                return pass_layers(text_config(config), len(module) - 1)[-1] + 1
    return config_int(text_config(config), LAYER_COUNT_KEYS) or config_int(config, LAYER_COUNT_KEYS) or 0


def _max_length(config) -> int | None:
    for source in (text_config(config), config):
        for attr in ("max_position_embeddings", "max_seq_len", "n_positions"):
            value = getattr(source, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None
