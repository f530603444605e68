"""The routing layout of a model, read from its config alone (no weights): which hidden layers route, over
how many experts, with how many per token, by which rule — what an importer needs to check and place an
engine's routing arrays.

The layout is found the way `load_model` finds MoE layers (`moeviz.models.sites.find_moe_sites` on a
meta-device skeleton that transformers builds from config.json), so dense layers (DeepSeek's
`first_k_dense_replace`, Qwen's `mlp_only_layers`, …) are known for every family transformers ships,
without a rule per family here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeviz.errors import LayoutError, NotMoEModelError
from moeviz.scoring import GroupScore, ScoreFn
from moeviz.trace import ModelInfo


@dataclass(frozen=True)
class RoutingLayout:
    """What an importer checks engine routing against.

    - num_hidden_layers: the model's blocks (engines that write every hidden layer use this axis)
    - moe_layers: block index of each MoE layer, ascending (engines that write MoE layers only use this axis)
    - num_experts (E), top_k (k): routed experts and experts per token (shared experts are not routed)
    - score_fn, n_group, topk_group, group_score, shared_experts: the routing rule's facts, as captured
    """

    source: str
    folder: Path
    model_type: str
    architecture: str
    num_hidden_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    score_fn: ScoreFn
    vocab_size: int
    n_group: int | None = None
    topk_group: int | None = None
    group_score: GroupScore | None = None
    shared_experts: int = 0
    has_bias: bool = False
    _tokenizer: list[Any] = field(default_factory=list, repr=False, compare=False)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in moe)

    def tokenizer(self) -> Any | None:
        """The folder's tokenizer (None when it ships none), loaded on first use."""
        if not self._tokenizer:
            from moeviz.models.loading import _load_tokenizer

            self._tokenizer.append(_load_tokenizer(self.folder, False))
        return self._tokenizer[0]

    def model_info(self, notes: list[str]) -> ModelInfo:
        """The ModelInfo of a trace imported for this model: no weights were loaded, so no dtype or device."""
        return ModelInfo(
            source=self.source,
            model_type=self.model_type,
            architecture=self.architecture,
            num_layers=self.num_hidden_layers,
            dtype="",
            device="",
            notes=list(notes),
        )


@functools.lru_cache(maxsize=16)
def _cached_layout(folder: str, source: str, mtime_ns: int) -> RoutingLayout:
    import torch

    from moeviz.models.checks import exception_line, read_config
    from moeviz.models.composite import auto_class_for, runnable_config
    from moeviz.models.loading import MODEL_BUILD_LOCK, _num_layers
    from moeviz.models.sites import find_moe_sites

    path = Path(folder)
    config, _ = runnable_config(read_config(path, trust_remote_code=False))
    if getattr(config, "is_encoder_decoder", False):
        raise LayoutError(f"{source} is an encoder-decoder model: engine routing imports are for decoders")
    try:
        with MODEL_BUILD_LOCK, torch.device("meta"):
            skeleton = auto_class_for(config, path).from_config(config)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError) as exc:
        from moeviz.errors import NotAModelFolderError

        raise NotAModelFolderError(
            f"transformers cannot build a model from {path}/config.json: {exception_line(exc)}"
        ) from exc
    sites = [s for s in find_moe_sites(skeleton) if s.site == "mlp"]
    if not sites:
        raise NotMoEModelError(f"{source} holds a dense model (model_type {config.model_type!r})")
    first = sites[0]
    differing = [s.layer for s in sites if (s.num_experts, s.top_k) != (first.num_experts, first.top_k)]
    if differing:
        raise LayoutError(
            f"{source}: MoE layer {differing[0]} has {sites[differing[0]].num_experts} experts / top-k "
            f"{sites[differing[0]].top_k}, layer {first.layer} {first.num_experts} / {first.top_k}; "
            "importers need one expert count and one k"
        )
    if not first.top_k:
        raise LayoutError(f"{source}: the config does not say how many experts a token is sent to")
    text = config.get_text_config()
    return RoutingLayout(
        source=source,
        folder=path,
        model_type=str(config.model_type),
        architecture=type(skeleton).__name__,
        num_hidden_layers=_num_layers(config),
        moe_layers=tuple(sorted(s.layer for s in sites)),
        num_experts=first.num_experts,
        top_k=int(first.top_k),
        score_fn=first.score_fn,
        vocab_size=int(getattr(text, "vocab_size", 0) or 0),
        n_group=first.n_group,
        topk_group=first.topk_group,
        group_score=first.group_score,
        shared_experts=first.shared_experts,
        has_bias=first.bias is not None,
    )


def routing_layout(model: str | Path) -> RoutingLayout:
    """The routing layout of `model` (a folder with config.json, or `sample:NAME`); weights are not needed
    and not read. Cached per folder while its config.json is unchanged."""
    from moeviz.models.checks import check_regular_files
    from moeviz.models.loading import resolve_source

    folder = resolve_source(model)
    check_regular_files(folder)
    config = folder / "config.json"
    return _cached_layout(str(folder), str(model), config.stat().st_mtime_ns)
