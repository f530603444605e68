"""Model-size calculator: total vs active parameters per token, weight bytes per dtype, KV cache per token and
GPUs needed, for a loaded model or for well-known MoE architectures built from transformers' config classes.

Parameters are counted on the meta device (no memory, no weights): `AutoModelForCausalLM.from_config` under
`torch.device("meta")`. Counting rules:
- total = every parameter of the built model, tied weights once; the lm_head counts when it is not tied to
  the embedding; DeepSeek-V3's multi-token-prediction module is not part of the transformers model and is
  not counted (671 B, as published, excludes its 14 B).
- routed = the parameters of every MoE layer's routed-experts module (weights and biases);
  active per token = total − routed × (1 − k/E) (a token uses k of E routed experts; embeddings, attention,
  dense layers, routers and shared experts all count as active).
- KV cache per token at bf16: GQA/MHA 2 (K and V) × layers × kv_heads × head_dim × 2 B; MLA (DeepSeek-V3)
  layers × (kv_lora_rank + qk_rope_head_dim) × 2 B (the compressed latent and the shared RoPE key). Every
  layer is counted at full length: sliding-window layers (gpt-oss, Mixtral's config) need less at long
  contexts, which `notes` says.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moeviz.errors import InputError
from moeviz.models.config_keys import LAYER_COUNT_KEYS, config_int
from moeviz.models.loading import LoadedModel
from moeviz.models.sites import MoESite, find_moe_sites

BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
DEFINITION = (
    "active = total − routed × (1 − k/E); KV per token at bf16 (MLA: latent + RoPE key); scales not counted"
)


@dataclass(frozen=True)
class ModelSize:
    """Sizes of one MoE architecture (parameter counts are exact counts of the built model)."""

    name: str
    total_params: int
    active_params: int
    expert_params: int  # one routed expert
    routed_experts: int  # per MoE layer
    top_k: int
    shared_experts: int
    moe_layers: int
    layers: int
    hidden_size: int
    kv_bytes_per_token: int  # at bf16, all layers, MLA-aware
    routed_params: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)
    definition: str = DEFINITION

    def weight_bytes(self, dtype: str) -> int:
        """Bytes of every parameter at `dtype`; quantisation scales not counted."""
        return math.ceil(self.total_params * _bytes_per_param(dtype))

    def kv_bytes(self, context: int, batch: int = 1) -> int:
        """KV cache bytes at bf16 for `batch` sequences of `context` tokens."""
        return int(self.kv_bytes_per_token) * int(context) * int(batch)

    def gpus_needed(self, dtype: str, context: int, batch: int, gpu_gib: float, usable: float = 0.9) -> int:
        """GPUs of `gpu_gib` GiB (a `usable` share of each for weights + KV cache) that hold the weights at
        `dtype` and the bf16 KV cache of `batch` × `context` tokens: ceil(need / (gpu_gib · 2^30 · usable)).
        Activations and framework overhead are what the unusable share is left for."""
        if gpu_gib <= 0 or not 0 < usable <= 1:
            raise InputError(f"GPU memory must be > 0 and usable in (0, 1], got {gpu_gib} GiB, {usable}")
        need = self.weight_bytes(dtype) + self.kv_bytes(context, batch)
        return max(1, math.ceil(need / (gpu_gib * 2**30 * usable)))

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "total_params": int(self.total_params),
            "active_params": int(self.active_params),
            "expert_params": int(self.expert_params),
            "routed_experts": int(self.routed_experts),
            "top_k": int(self.top_k),
            "shared_experts": int(self.shared_experts),
            "moe_layers": int(self.moe_layers),
            "layers": int(self.layers),
            "hidden_size": int(self.hidden_size),
            "kv_bytes_per_token": int(self.kv_bytes_per_token),
            "notes": list(self.notes),
            "definition": self.definition,
        }


def _bytes_per_param(dtype: str) -> float:
    if dtype not in BYTES_PER_PARAM:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(BYTES_PER_PARAM)}")
    return BYTES_PER_PARAM[dtype]


# ---- building ---------------------------------------------------------------------------------------------
def build_on_meta(config) -> nn.Module:
    """The causal-LM model of `config` on the meta device (shapes only, no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _as_model(model_or_config) -> nn.Module:
    if isinstance(model_or_config, LoadedModel):
        return model_or_config.model
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    return build_on_meta(model_or_config)


def _routed_module(model: nn.Module, site: MoESite) -> nn.Module | None:
    if site.experts is not None:
        return site.experts
    block = dict(model.named_modules()).get(site.name.rsplit(".", 1)[0])
    experts = getattr(block, "experts", None)
    return experts if isinstance(experts, nn.Module) else None


def model_size(model_or_config, name: str = "") -> ModelSize:
    """Sizes of a loaded model, an nn.Module, or a transformers config (built on the meta device)."""
    model = _as_model(model_or_config)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    sites = find_moe_sites(model)
    if not sites:
        raise InputError(f"{name or type(model).__name__} has no MoE layer")
    total = sum(p.numel() for p in model.parameters())
    routed_modules = [_routed_module(model, s) for s in sites]
    routed = sum(p.numel() for m in routed_modules if m is not None for p in m.parameters())
    first = sites[0]
    experts, k = first.num_experts, int(first.top_k or 1)
    per_expert = sum(p.numel() for p in routed_modules[0].parameters()) // experts if routed_modules[0] else 0
    kv, notes = kv_bytes_per_token(config)
    return ModelSize(
        name=name or str(getattr(config, "_name_or_path", "") or type(model).__name__),
        total_params=int(total),
        active_params=round(total - routed * (1 - k / experts)),
        expert_params=int(per_expert),
        routed_experts=int(experts),
        top_k=k,
        shared_experts=int(first.shared_experts),
        moe_layers=len(sites),
        layers=config_int(config, LAYER_COUNT_KEYS) or 0,
        hidden_size=int(getattr(config, "hidden_size", 0) or 0),
        kv_bytes_per_token=kv,
        routed_params=int(routed),
        notes=tuple(notes),
    )


def kv_bytes_per_token(config) -> tuple[int, list[str]]:
    """(bytes of KV cache per token at bf16 over all layers, notes) from a decoder config."""
    layers = config_int(config, LAYER_COUNT_KEYS) or 0  # the one table of config keys (moeviz.models)
    notes = []
    lora = getattr(config, "kv_lora_rank", None)
    if isinstance(lora, int) and lora > 0:
        rope = int(getattr(config, "qk_rope_head_dim", 0) or 0)
        notes.append("MLA: the cache holds the compressed KV latent and the shared RoPE key per layer")
        return layers * (lora + rope) * 2, notes
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or (int(config.hidden_size) // max(heads, 1))
    types = getattr(config, "layer_types", None) or []
    sliding = sum(1 for t in types if "sliding" in str(t))
    window = getattr(config, "sliding_window", None)
    if sliding:
        notes.append(
            f"{sliding} of {layers} layers use a sliding window of {window} tokens: beyond it they cache "
            "only the window (the figure counts every layer at full length, an upper bound)"
        )
    elif window:
        notes.append(f"the config sets a sliding window of {window} tokens; counted at full length")
    return 2 * layers * kv_heads * int(head_dim) * 2, notes


# ---- one expert -------------------------------------------------------------------------------------------
def _one_expert_tensors(model: nn.Module) -> list[tuple[int, int, int]]:
    """(numel, input width, element size) of each tensor of one routed expert of the first MoE layer: a
    fused [E, ...] tensor contributes its slice [e], a ModuleList its first expert's tensors."""
    site = find_moe_sites(model)[0]
    module = _routed_module(model, site)
    if module is None:
        raise InputError("cannot find the routed experts of this model")
    children = list(module.children())
    if len(children) == site.num_experts:  # one module per expert
        return [(p.numel(), p.shape[-1], p.element_size()) for p in children[0].parameters()]
    transposed = bool(getattr(module, "is_transposed", False))
    out = []
    for p in module.parameters(recurse=False):
        if p.shape[0] != site.num_experts:
            continue
        width = p.shape[-2] if transposed and p.dim() == 3 else p.shape[-1]
        out.append((p[0].numel(), width if p.dim() >= 3 else 1, p.element_size()))
    return out


def expert_bytes(loaded_or_model, dtype: str | None = None) -> int:
    """Bytes of one routed expert: at the tensors' own dtype (`dtype` None), or at `dtype` with the
    quantisation scales of `moeviz.whatif.quant` (fp32 per row for fp8/int8, 16-bit per 128-group for
    int4; biases stay at bf16)."""
    from moeviz.whatif.quant import ELEMENT_BYTES, INT4_GROUP, SCALE_BYTES

    tensors = _one_expert_tensors(_as_model(loaded_or_model))
    if dtype is None:
        return int(sum(n * size for n, _, size in tensors))
    total = 0.0
    for numel, width, _ in tensors:
        if width <= 1:  # a bias vector
            total += 2 * numel
        elif dtype in SCALE_BYTES:
            groups = -(-width // INT4_GROUP) if dtype == "int4" else 1
            total += ELEMENT_BYTES[dtype] * numel + SCALE_BYTES[dtype] * (numel // width) * groups
        else:
            total += _bytes_per_param(dtype) * numel
    return math.ceil(total)


def expert_flops_per_token(loaded_or_model) -> float:
    """2 × the parameters of one routed expert (a multiply-add per weight per token)."""
    return 2.0 * sum(n for n, _, _ in _one_expert_tensors(_as_model(loaded_or_model)))


# ---- well-known architectures ---------------------------------------------------------------------------
def _mixtral_8x7b():
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False,
    )  # fmt: skip


def _deepseek_v3():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=163840, tie_word_embeddings=False,
    )  # fmt: skip


def _qwen3_moe(layers: int, hidden: int, heads: int, moe_inter: int, inter: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=moe_inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=40960, tie_word_embeddings=False,
    )  # fmt: skip


def _olmoe_1b_7b():
    from transformers import OlmoeConfig

    return OlmoeConfig(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip


def _gpt_oss_120b():
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
        num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072, tie_word_embeddings=False,
    )  # fmt: skip


KNOWN_MODELS: dict[str, Callable[[], Any]] = {
    "Mixtral-8x7B": _mixtral_8x7b,
    "DeepSeek-V3": _deepseek_v3,
    "Qwen3-30B-A3B": lambda: _qwen3_moe(48, 2048, 32, 768, 6144),
    "Qwen3-235B-A22B": lambda: _qwen3_moe(94, 4096, 64, 1536, 12288),
    "OLMoE-1B-7B": _olmoe_1b_7b,
}
try:  # gpt-oss needs a transformers that knows it
    from transformers import GptOssConfig as _GptOssConfig  # noqa: F401

    KNOWN_MODELS["gpt-oss-120b"] = _gpt_oss_120b
except ImportError:  # pragma: no cover - older transformers
    pass


@functools.cache
def known_model_size(name: str) -> ModelSize:
    """`model_size` of one of KNOWN_MODELS (built on the meta device)."""
    if name not in KNOWN_MODELS:
        raise InputError(f"unknown model {name!r}; choose one of {', '.join(KNOWN_MODELS)}")
    return model_size(KNOWN_MODELS[name](), name=name)
