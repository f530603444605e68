"""Which model class a checkpoint builds, and which part of it routes text.

A text-only MoE checkpoint builds a causal LM; a multimodal one (Kimi K2.5, Qwen3-VL-MoE, GLM-4.5V,
ERNIE-4.5-VL, …) builds an image-text-to-text or multimodal model whose language model is one sub-module
among vision and audio towers. moeviz builds the class the config maps to (as transformers' own pipelines
would), feeds it text only, and captures the routers of its language model (what `get_decoder()` returns).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moeviz.errors import NotAModelFolderError

# The auto classes that generate text from token ids, in the order a config is looked up in them: a
# checkpoint that has a causal-LM class is built as one even when it also has a multimodal class.
# A token classifier (OpenAI's privacy filter) comes last: it reads text but predicts no tokens.
_TEXT_AUTO_CLASSES = (
    "AutoModelForCausalLM",
    "AutoModelForImageTextToText",
    "AutoModelForMultimodalLM",
    "AutoModelForTokenClassification",
)


def auto_class_for(config: Any, folder: Any = None):
    """The transformers auto class that builds `config`'s model: seq2seq for an encoder-decoder, else the
    first of causal LM, image-text-to-text, multimodal LM and token classification whose mapping holds the
    config's class.
    NotAModelFolderError (naming the model type) when none does."""
    import transformers

    if getattr(config, "is_encoder_decoder", False):
        return transformers.AutoModelForSeq2SeqLM
    for name in _TEXT_AUTO_CLASSES:
        auto = getattr(transformers, name, None)
        if auto is not None and type(config) in auto._model_mapping:
            return auto
    where = f"{folder}: " if folder is not None else ""
    raise NotAModelFolderError(
        f"{where}model_type {getattr(config, 'model_type', None)!r} has no text-generating model class in "
        "transformers (causal LM, image-text-to-text, multimodal LM or token classification)"
    )


def runnable_config(config: Any) -> tuple[Any, str | None]:
    """(config, note) of the model moeviz builds from a checkpoint's `config`: the config itself (note None),
    or, for an omni checkpoint whose outer class has no forward of its own (Qwen3-Omni-MoE: a thinker that
    reads text, images and audio, and a talker that speaks), its thinker's config, with a note saying so."""
    thinker = getattr(config, "thinker_config", None)
    if thinker is None or not hasattr(thinker, "model_type"):
        return config, None
    return thinker, (
        f"the {config.model_type} checkpoint's thinker (its text model, {thinker.model_type}) was loaded; "
        "its talker (speech output) was not"
    )


def language_model(model: nn.Module) -> tuple[str, nn.Module]:
    """(module path, module) of the part of `model` that routes text: the module `get_decoder()` returns
    in a composite (multimodal) model, e.g. ("model.language_model", <DeepseekV3Model>); ("", model) for a
    text-only or encoder-decoder model, whose routers are all captured."""
    if getattr(model.config, "is_encoder_decoder", False) or not _is_composite(model):
        return "", model
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if isinstance(decoder, nn.Module):
        for name, module in model.named_modules():
            if module is decoder and name:
                return name, module
    return "", model


def _is_composite(model: nn.Module) -> bool:
    """A model whose config nests a text config of its own (vision-language, omni): its text part is one
    sub-model among others."""
    return text_config(model.config) is not model.config


def text_config(config: Any) -> Any:
    """The config of the text model: a composite config's nested text config, else the config itself
    (None stays None)."""
    if config is None or getattr(config, "is_encoder_decoder", False):
        return config
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config
