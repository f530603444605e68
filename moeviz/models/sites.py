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

from moeviz.models.composite import language_model, text_config
from moeviz.models.config_keys import (
    ROUTER_NAMES,
    SHARED_EXPERT_KEYS,
    TOP_K_KEYS,
    ZERO_EXPERT_KEYS,
    config_int,
    layer_index,
)
from moeviz.models.decoding import NEEDS_EXPERT_ARGS, product_key_logits
from moeviz.models.families import FAMILIES, Family, family
from moeviz.scoring import SCORE_FUNCTIONS, BiasOn, GroupScore, ScoreFn
from moeviz.trace.records import Site

SUPPORTED_FAMILIES = tuple(sorted(t for t, row in FAMILIES.items() if row.support != "refused"))

_DEFAULT_TOP_K = {"one_hot_mask": 1, "dense_weights": 2}
# balancing-bias names: DeepSeek-V3 and most, AFMoE and LFM2-MoE (on the MoE block), ZAYA
_BIAS_NAMES = ("e_score_correction_bias", "expert_bias", "balancing_biases")
# routed experts that serve another modality than text (ERNIE-4.5-VL's `vision_moe`): text never reaches them
_OTHER_MODALITIES = re.compile(r"(^|\.)(vision|visual|audio)[a-z_]*(\.|$)")
_SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")
_LOOP_KEYS = ("loop_layer_index_start", "loop_layer_index_end", "loop_num_passes")


@dataclass
class MoESite:
    """One MoE layer: a router and (where the family passes the decision to it) its experts module.

    `site` tells MoE layers apart within one block index: "mlp" normally, "attention" for JetMoE's
    mixture-of-attention, "encoder"/"decoder" for encoder-decoder models.
    """

    name: str
    layer: int
    site: Site
    stream: str  # which token stream the router sees: "input" or, in encoder-decoders, "decoder"
    router: nn.Module
    experts: nn.Module | None
    logits_index: int | None  # position of the raw logits in the router's output tuple; None = output itself
    decoder: str  # key into decoding.DECODERS, or "auto" for structural discovery
    score_fn: ScoreFn
    num_experts: int
    top_k: int | None
    bias: torch.Tensor | None = field(default=None, repr=False)  # live reference: read at capture time
    capacity: int | None = None
    shared_experts: int = 0
    n_group: int | None = None  # group-limited routing (see `LayerRouting`); None = no group limit
    topk_group: int | None = None
    group_score: GroupScore | None = None
    zero_experts: int = (
        0  # the last ids of the E router outputs compute nothing (`LayerRouting.zero_experts`)
    )
    hash_routed: bool = False  # experts chosen by a token-id table, not by the scores (`LayerRouting`)
    bias_on: BiasOn = "scores"
    outputs_probabilities: bool = False  # the router outputs probabilities: logits are recorded as log p
    # a looped block's router runs once per pass: the layer occurrence of each pass (`LayerRouting.loop_pass`)
    pass_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.pass_layers:
            self.pass_layers = (self.layer,)

    @property
    def passes(self) -> int:
        return len(self.pass_layers)

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
        if self.decoder == "product_keys":
            return product_key_logits(tensor)
        if self.outputs_probabilities:  # softmax(log p) = p: the scores come out as the model's
            tensor = torch.log(tensor.float())
        return tensor.reshape(-1, tensor.shape[-1])

    def router_scores(self, logits: torch.Tensor, selection: bool = False) -> torch.Tensor:
        """Router scores [..., E] from logits, in torch with autograd kept (`moeviz.scoring` is the numpy
        version): softmax over experts, sigmoid or sqrt(softplus); plus the balancing bias when
        `selection`."""
        if self.score_fn == "sigmoid":
            scores = torch.sigmoid(logits)
        elif self.score_fn == "sqrtsoftplus":
            scores = torch.nn.functional.softplus(logits).sqrt()
        else:
            scores = torch.softmax(logits, dim=-1)
        if selection and self.bias is not None:
            scores = scores + self.bias.detach().float().reshape(-1)
        return scores


def find_moe_sites(model: nn.Module) -> list[MoESite]:
    """All MoE layers of `model`'s text path, in module order (in a composite model, those of its language
    model: `composite.language_model`). Empty for a dense model."""
    prefix, text_model = language_model(model)
    config = getattr(model, "config", None)
    # a composite's text model is often a known family inside (Kimi K2.5: deepseek_v3)
    row = family(getattr(text_config(config), "model_type", None)) or family(
        getattr(config, "model_type", None)
    )
    recorder = _router_recorder(text_model)
    sites = _sites_from_recorder(text_model, prefix, recorder, row) if recorder is not None else []
    # MoE blocks transformers' router table leaves out (DeepSeek-V4's hash routers) are found by structure;
    # a recorded module that holds such blocks (ERNIE-4.5-VL's modality block) gives way to them
    seen = {id(m) for site in sites for m in (site.router, site.experts) if m is not None}
    extra = [
        site
        for site in _sites_by_structure(text_model, prefix, row)
        if id(site.router) not in seen and id(site.experts) not in seen
    ]
    if not extra:
        return sites
    sites = [s for s in sites if not any(x.name.startswith(s.name + ".") for x in extra)]
    extra = [x for x in extra if not _OTHER_MODALITIES.search(x.name.removeprefix(prefix))]
    order = {name: i for i, (name, _) in enumerate(text_model.named_modules(prefix=prefix))}
    return sorted(sites + extra, key=lambda site: order[site.name])


def _router_recorder(model: nn.Module):
    for module in model.modules():
        table = getattr(type(module), "_can_record_outputs", None) or {}
        recorder = table.get("router_logits")
        if recorder is not None and getattr(recorder, "target_class", None) is not None:
            return recorder
    return None


def _sites_from_recorder(model: nn.Module, prefix: str, recorder, row: Family | None) -> list[MoESite]:
    sites = []
    modules = dict(model.named_modules(prefix=prefix))
    for name, module in modules.items():
        if not isinstance(module, recorder.target_class):
            continue
        if recorder.layer_name and not name.endswith(recorder.layer_name):
            continue
        parent = modules.get(name.rsplit(".", 1)[0], model) if "." in name else model
        experts = getattr(parent, "experts", None)
        experts = experts if isinstance(experts, nn.Module) and experts is not module else None
        sites.append(_make_site(model, modules, name, module, experts, recorder.index, row))
    return sites


def _sites_by_structure(model: nn.Module, prefix: str, row: Family | None) -> list[MoESite]:
    sites = []
    modules = dict(model.named_modules(prefix=prefix))
    for name, block in modules.items():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        for router_name in ROUTER_NAMES:
            router = getattr(block, router_name, None)
            weight = _router_weight(router) if isinstance(router, nn.Module) else None
            if weight is not None and weight.shape[0] > 1:
                full = f"{name}.{router_name}" if name else router_name
                sites.append(_make_site(model, modules, full, router, experts, None, row))
                break
    return sites


def _make_site(model, modules, name, router, experts, logits_index, row: Family | None) -> MoESite:
    """The site of the router at `name` (in `modules`, the model's named modules); its block is the router's
    parent."""
    config = text_config(getattr(model, "config", None))
    block_name = name.rsplit(".", 1)[0] if "." in name else ""
    block = modules.get(block_name, model)
    outer = modules.get(block_name.rsplit(".", 1)[0] if "." in block_name else "", model)
    decoder = row.decoder if row is not None else "auto"
    bias = _find_bias(router)
    bias = bias if bias is not None else _find_bias(block)
    weight = _router_weight(router)
    if decoder == "product_keys":  # Doge: K keys on each side, expert i·K + j
        num_experts = int(router.num_keys) ** 2
    elif bias is not None:  # one bias per router output (Inkling's projection also scores shared experts)
        num_experts = int(bias.numel())
    elif weight is not None:
        num_experts = int(weight.shape[0])
    else:
        num_experts = int(getattr(router, "num_experts", 0))
    score_fn = row.score_fn if row is not None else None
    if score_fn is None:  # the score function the config names, else softmax
        named = (getattr(config, key, None) for key in ("scoring_func", "score_func", "expert_selection_fn"))
        scoring = str(next((n for n in named if n), "")).lower()
        score_fn = scoring if scoring in SCORE_FUNCTIONS else "softmax"
    is_enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    in_encoder = bool(re.search(r"(^|\.)encoder\.", name))
    site: Site
    if is_enc_dec:
        site, stream = ("encoder", "input") if in_encoder else ("decoder", "decoder")
    else:
        site, stream = ("attention" if "attention" in name else "mlp"), "input"
    # Doge's product-key block runs its own dense MLP beside the retrieved experts
    shared = router if decoder == "product_keys" else _shared_module(block, outer, experts)
    block_index = layer_index(name.removeprefix(_prefix_of(modules))) or 0
    occurrences = pass_layers(config, block_index)
    return MoESite(
        name=name,
        layer=occurrences[0],
        pass_layers=occurrences,
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
        zero_experts=1 if decoder == "zaya_skip" else _zero_expert_count(config, num_experts),
        hash_routed=_hash_table(router) is not None,
        bias_on=row.bias_on if row is not None else "scores",
        outputs_probabilities=row.outputs_probabilities if row is not None else False,
    )


def _prefix_of(modules: dict[str, nn.Module]) -> str:
    """The path prefix of a named-module listing (its first key: the root's name)."""
    return next(iter(modules), "")


def pass_layers(config, block: int) -> tuple[int, ...]:
    """The layer occurrence of each pass of decoder block `block`, counting blocks in execution order: a
    looped model (Inkling2-Loop: blocks `loop_layer_index_start` … `loop_layer_index_end` − 1 run
    `loop_num_passes` times per forward) runs the loop's blocks pass after pass, so pass p of looped block b
    is occurrence b + p·L (L looped blocks) and every later block moves down by (P − 1)·L."""
    start, end, passes = (getattr(config, key, None) for key in _LOOP_KEYS)
    if (
        not (isinstance(start, int) and isinstance(end, int) and isinstance(passes, int))
        or passes <= 1
        or not start < end
        or block < start
    ):
        return (block,)
    looped = end - start
    if block >= end:
        return (block + (passes - 1) * looped,)
    return tuple(block + p * looped for p in range(passes))


def _shared_module(block: nn.Module, outer: nn.Module, experts: nn.Module | None) -> nn.Module | None:
    """The always-on expert beside the routed ones: on the MoE block (`shared_experts`, `shared_expert`),
    on its parent (Granite's `shared_mlp`, ERNIE-4.5-VL's outer block), or — where the router and experts
    sit directly in the decoder layer (Gemma 4) — the layer's dense `mlp`, which runs in parallel."""
    for holder in (block, outer):
        for name in _SHARED_NAMES:
            module = getattr(holder, name, None)
            if isinstance(module, nn.Module):
                return module
    mlp = getattr(block, "mlp", None)
    return (
        mlp
        if isinstance(mlp, nn.Module) and experts is not None and getattr(block, "experts", None) is experts
        else None
    )


def _hash_table(router: nn.Module) -> torch.Tensor | None:
    """A hash router's token-id → experts table (DeepSeek-V4's `tid2eid` [V, k]): an integer buffer of two
    dimensions; None for a learned router."""
    for _, tensor in router.named_buffers(recurse=False):
        if tensor.dim() == 2 and not tensor.is_floating_point():
            return tensor
    return None


def _zero_expert_count(config, num_experts: int) -> int:
    """Zero-computation experts among the router's `num_experts` outputs (LongCat-Flash's
    `zero_expert_num`): 0 when the config declares none, or not fewer than the router has."""
    zero = config_int(config, ZERO_EXPERT_KEYS) or 0
    return zero if zero < num_experts else 0


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
    """The router's output projection [E, H]: its last two-dimensional parameter with more than one row
    (ZAYA's router is an MLP whose `out_proj` comes last; ERNIE's [1, E] bias is not a projection)."""
    if router is None:
        return None
    weights = [p for p in router.parameters() if p.dim() == 2 and p.shape[0] > 1]
    return weights[-1] if weights else None


def _find_bias(module: nn.Module) -> torch.Tensor | None:
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if name.endswith(_BIAS_NAMES):
            return tensor
    return None


def _top_k(router: nn.Module, block: nn.Module, config) -> int | None:
    """Experts per token: the router's or its block's own attribute, else the config's (DBRX: its
    ffn_config)."""
    table = _hash_table(router)
    if table is not None:
        return int(table.shape[1])
    for source in (router, block, config, getattr(config, "ffn_config", None)):
        k = config_int(source, TOP_K_KEYS) if source is not None else None
        if k is not None:
            return k
    return None


def _shared_expert_count(config) -> int:
    return config_int(config, SHARED_EXPERT_KEYS) or 1
