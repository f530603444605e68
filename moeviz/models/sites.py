"""Find the MoE layers of a model: where each router and its experts live, and how to decode them.

This module (with `decoding`) is the only place that knows model internals. Discovery uses the table
transformers itself uses for `output_router_logits` (`_can_record_outputs["router_logits"]`), which skips
dense layers and covers encoder/decoder halves, and falls back to structural discovery (a module with an
`experts` child and a router sibling) for models that lack it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moeviz.models.config_keys import ROUTER_NAMES, SHARED_EXPERT_KEYS, TOP_K_KEYS, config_int, layer_index
from moeviz.models.decoding import NEEDS_EXPERT_ARGS

# model_type -> (score function, decoder). Score function: how router logits become router scores.
FAMILY_RULES: dict[str, tuple[str, str]] = {
    **{
        family: ("softmax", "expert_args")
        for family in (
            "mixtral",
            "minimax",
            "qwen2_moe",
            "qwen3_moe",
            "qwen3_next",
            "olmoe",
            "hunyuan_v1_moe",
            "jamba",
            "deepseek_v2",
            "ernie4_5_moe",
            "gpt_oss",
            "granitemoe",
            "phimoe",
            "dbrx",
        )
    },
    **{family: ("sigmoid", "expert_args") for family in ("deepseek_v3", "glm4_moe", "kimi_linear")},
    "llama4_text": ("sigmoid", "sigmoid_router_scores"),
    "llama4": ("sigmoid", "sigmoid_router_scores"),
    "jetmoe": ("softmax", "sorted_gating"),
    "switch_transformers": ("softmax", "one_hot_mask"),
    "nllb-moe": ("softmax", "dense_weights"),
}
SUPPORTED_FAMILIES = tuple(sorted(FAMILY_RULES))

_DEFAULT_TOP_K = {"one_hot_mask": 1, "dense_weights": 2}
_BIAS_NAME = "e_score_correction_bias"


@dataclass
class MoESite:
    """One MoE layer: a router and (where the family passes the decision to it) its experts module.

    `site` tells MoE layers apart within one block index: "mlp" normally, "attention" for JetMoE's
    mixture-of-attention, "encoder"/"decoder" for encoder-decoder models.
    """

    name: str
    layer: int
    site: str
    stream: str  # which token stream the router sees: "input" or, in encoder-decoders, "decoder"
    router: nn.Module
    experts: nn.Module | None
    logits_index: int | None  # position of the raw logits in the router's output tuple; None = output itself
    decoder: str  # key into decoding.DECODERS, or "auto" for structural discovery
    score_fn: str  # "softmax" | "sigmoid"
    num_experts: int
    top_k: int | None
    bias: torch.Tensor | None = field(default=None, repr=False)  # live reference: read at capture time
    capacity: int | None = None
    shared_experts: int = 0
    n_group: int | None = None  # group-limited routing (see `LayerRouting`); None = no group limit
    topk_group: int | None = None
    group_score: str | None = None  # "top2_sum" (DeepSeek-V3, GLM-4.5, Kimi) | "max" (DeepSeek-V2)

    @property
    def key(self) -> tuple[str, int]:
        return (self.site, self.layer)

    @property
    def needs_expert_args(self) -> bool:
        return self.decoder in NEEDS_EXPERT_ARGS or self.decoder == "auto"

    def router_logits(self, output: Any) -> torch.Tensor | None:
        """The raw logits [N, E] (tokens flattened, autograd kept) in one output of the router: the output
        itself, its `logits_index` entry, or its first float [..., E] tensor. None when there is none."""
        if torch.is_tensor(output):
            tensor = output
        elif self.logits_index is not None:
            tensor = output[self.logits_index]
        else:
            floats = (t for t in output if torch.is_tensor(t) and t.is_floating_point() and t.dim() >= 2)
            tensor = next((t for t in floats if t.shape[-1] == self.num_experts), None)
            if tensor is None:
                return None
        return tensor.reshape(-1, tensor.shape[-1])

    def router_scores(self, logits: torch.Tensor, selection: bool = False) -> torch.Tensor:
        """Router scores [..., E] from logits, in torch with autograd kept (`moeviz.scoring` is the numpy
        version): sigmoid or softmax over experts, plus the balancing bias when `selection`."""
        scores = torch.sigmoid(logits) if self.score_fn == "sigmoid" else torch.softmax(logits, dim=-1)
        if selection and self.bias is not None:
            scores = scores + self.bias.detach().float().reshape(-1)
        return scores


def find_moe_sites(model: nn.Module) -> list[MoESite]:
    """All MoE layers of `model`, in module order. Empty for a dense model."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    recorder = _router_recorder(model)
    if recorder is not None:
        sites = _sites_from_recorder(model, recorder, model_type)
        if sites:
            return sites
    return _sites_by_structure(model, model_type)


def _router_recorder(model: nn.Module):
    for module in model.modules():
        table = getattr(type(module), "_can_record_outputs", None) or {}
        recorder = table.get("router_logits")
        if recorder is not None and getattr(recorder, "target_class", None) is not None:
            return recorder
    return None


def _sites_from_recorder(model: nn.Module, recorder, model_type: str | None) -> list[MoESite]:
    score_fn, decoder = FAMILY_RULES.get(model_type, (None, "auto"))
    sites = []
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if not isinstance(module, recorder.target_class):
            continue
        if recorder.layer_name and not name.endswith(recorder.layer_name):
            continue
        parent = modules[name.rsplit(".", 1)[0]] if "." in name else model
        experts = getattr(parent, "experts", None)
        experts = experts if isinstance(experts, nn.Module) and experts is not module else None
        sites.append(_make_site(model, name, module, parent, experts, recorder.index, decoder, score_fn))
    return sites


def _sites_by_structure(model: nn.Module, model_type: str | None) -> list[MoESite]:
    sites = []
    for name, block in model.named_modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        for router_name in ROUTER_NAMES:
            router = getattr(block, router_name, None)
            weight = _router_weight(router) if isinstance(router, nn.Module) else None
            if weight is not None and weight.shape[0] > 1:
                full = f"{name}.{router_name}" if name else router_name
                sites.append(_make_site(model, full, router, block, experts, None, "auto", None))
                break
    return sites


def _make_site(model, name, router, block, experts, logits_index, decoder, score_fn) -> MoESite:
    config = getattr(model, "config", None)
    bias = _find_bias(router)
    bias = bias if bias is not None else _find_bias(block)
    weight = _router_weight(router)
    num_experts = int(weight.shape[0]) if weight is not None else int(getattr(router, "num_experts", 0))
    if score_fn is None:  # unknown family: sigmoid when the config says so, else softmax
        scoring = str(getattr(config, "scoring_func", "") or getattr(config, "score_func", "")).lower()
        score_fn = "sigmoid" if scoring == "sigmoid" else "softmax"
    is_enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    in_encoder = bool(re.search(r"(^|\.)encoder\.", name))
    if is_enc_dec:
        site, stream = ("encoder", "input") if in_encoder else ("decoder", "decoder")
    else:
        site, stream = ("attention" if "attention" in name else "mlp"), "input"
    shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
    return MoESite(
        name=name,
        layer=layer_index(name) or 0,
        site=site,
        stream=stream,
        router=router,
        experts=experts,
        logits_index=logits_index,
        decoder=decoder,
        score_fn=score_fn,
        num_experts=num_experts,
        top_k=_top_k(router, block, config) or _DEFAULT_TOP_K.get(decoder),
        bias=bias,
        capacity=getattr(router, "expert_capacity", None),
        shared_experts=_shared_expert_count(config) if isinstance(shared, nn.Module) else 0,
        **_group_limit(router, num_experts),
    )


def _group_limit(router: nn.Module, num_experts: int) -> dict[str, Any]:
    """n_group / topk_group / group_score of a group-limited router (the DeepSeek-V2/V3 routers, GLM-4.5 and
    Kimi, which hold `num_group` and `topk_group`); empty when groups do not limit the choice."""
    n_group, topk_group = getattr(router, "num_group", None), getattr(router, "topk_group", None)
    if not (isinstance(n_group, int) and isinstance(topk_group, int)):
        return {}
    if n_group <= 1 or topk_group >= n_group or num_experts % n_group:
        return {}
    method = getattr(router, "topk_method", None)  # DeepSeek-V2: "greedy" ignores the groups
    if method is not None and method != "group_limited_greedy":
        return {}
    return {"n_group": n_group, "topk_group": topk_group, "group_score": "max" if method else "top2_sum"}


def _router_weight(router: nn.Module | None) -> torch.Tensor | None:
    if router is None:
        return None
    for param in router.parameters():
        if param.dim() == 2:
            return param
    return None


def _find_bias(module: nn.Module) -> torch.Tensor | None:
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if name.endswith(_BIAS_NAME):
            return tensor
    return None


def _top_k(router: nn.Module, block: nn.Module, config) -> int | None:
    """Experts per token: the router's or its block's own attribute, else the config's (DBRX: its
    ffn_config)."""
    for source in (router, block, config, getattr(config, "ffn_config", None)):
        k = config_int(source, TOP_K_KEYS) if source is not None else None
        if k is not None:
            return k
    return None


def _shared_expert_count(config) -> int:
    return config_int(config, SHARED_EXPERT_KEYS) or 1
