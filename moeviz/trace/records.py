"""What a Trace is made of: the model facts it carries (`ModelInfo`), one MoE layer's routing
(`LayerRouting`), a token table built on first use (`LazyTokens`), and the columns of its two tables.

Plain numpy and pandas, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np
import pandas as pd

from moeviz.scoring import BiasOn, GroupScore, ScoreFn, scores_from_logits, selection_scores

# Which MoE layer of a block: "mlp" normally, "attention" for JetMoE's mixture-of-attention, "encoder" and
# "decoder" in encoder-decoder models.
Site = Literal["mlp", "attention", "encoder", "decoder"]
SITES: tuple[Site, ...] = get_args(Site)
# `LayerRouting.decision_source` of moeviz's own captures: the experts the dispatch received, decoded from the
# router's output, or recomputed from the logits (not the model's own). Routing imported from an engine names
# its format instead (`moeviz.engines.FORMATS`), so the field itself is a plain str.
CaptureSource = Literal["dispatch", "router_output", "recomputed"]
CAPTURE_SOURCES: tuple[CaptureSource, ...] = get_args(CaptureSource)

UNKNOWN_TOKEN = -1  # token_id of a position whose id the source did not give (an engine import without ids)
TOKEN_COLUMNS = ["seq", "pos", "stream", "token_id", "token", "phase", "step", "predicted_id"]
ROUTING_COLUMNS = [
    "seq",
    "pos",
    "token_id",
    "token",
    "layer",
    "rank",
    "expert",
    "weight",
    "score",
    "selection_score",
    "logit",
    "site",
    "stream",
    "phase",
    "step",
]


@dataclass
class ModelInfo:
    """What the capture knows about the model as a whole."""

    source: str
    model_type: str
    architecture: str
    num_layers: int
    num_parameters: int = 0
    dtype: str = "float32"  # the dtype the weights were loaded (or dequantised) at
    device: str = "cpu"  # where the weights are: "cuda:0"; with a device map "cuda:0 (30 modules), disk (16)"
    parameter_bytes: int = 0  # parameters and buffers at `dtype`
    notes: list[str] = field(default_factory=list)
    # in a composite (multimodal) model, the sub-model whose routing was captured: "model.language_model
    # (DeepseekV3Model)"; "" when the model is a text model as a whole
    language_model: str = ""
    # the PEFT adapter merged over the base (`load_model(adapter=...)`), as the JSON of
    # `moeviz.models.adapters.AdapterInfo`: folder, type, rank, alpha, targets; "" for the base alone
    adapter: str = ""


@dataclass
class LayerRouting:
    """Routing of one MoE layer over all captured tokens it saw.

    N = tokens this layer routed (padding excluded), E = experts, k = slots per token.
    - token_rows [N]: row of each token in `Trace.tokens`
    - logits [N, E]: raw router logits (fp32)
    - scores [N, E] (derived, read-only): router scores, `score_fn(logits)`, before any top-k renormalisation
    - selection_scores [N, E] (derived, read-only): what the experts were selected on (scores + balancing
      bias, if any)
    - experts [N, k]: dispatched expert ids, -1 for a slot dropped by capacity; slots by descending weight
    - weights [N, k]: combination weights the model applied (0 for dropped)
    - bias [E] | None: balancing bias added for selection only
    - has_logits: False for routing read from an engine that records only the chosen experts (an import,
      `moeviz.engines`): `logits` (and so `scores`, `selection_scores`) are then a read-only all-NaN
      broadcast view (no memory), and every value derived from them is NaN
    - has_weights: False where the source records no combination weights: `weights` is an all-NaN view
    - ranked: slot 0 is the top choice and slots follow by descending weight (or score); False where the
      engine writes a token's experts in another order (Megatron's routing trace: ascending expert id),
      so only the set of a token's experts means something
    - n_group, topk_group, group_score: group-limited routing (DeepSeek-V2/V3 style): experts are split into
      `n_group` contiguous groups, each token picks its best `topk_group` groups by `group_score` of the
      selection scores ("top2_sum": sum of the group's two best, V3/GLM/Kimi; "max": V2) and selects only
      among their experts. None when the router does not limit groups.
    - zero_experts: how many of the E router outputs are zero-computation experts (LongCat-Flash's identity
      experts, ZAYA's skip): the last `zero_experts` ids, E − zero_experts … E − 1. A slot sent there skips
      the FFN; loads, dead experts and balance count only the routed experts (`routed_experts`).
    - bias_on: what the balancing bias is added to for selection: "scores" (DeepSeek-V3 and most) or
      "logits" (Kolibri-1 selects on the raw logit + bias)
    - loop_pass: which pass of a looped block this is (Inkling2-Loop runs blocks s … e − 1 P times per
      forward): each pass is its own layer occurrence, `layer` counting blocks in execution order (pass p of
      block b is layer b + p·(e − s); later blocks shift by (P − 1)·(e − s)) and `module` naming the block;
      0 for a block that runs once
    - hash_routed: the experts were chosen by a fixed token-id → experts table (DeepSeek-V4's first MoE
      layers), not by the router's scores, which only weight the chosen experts: margins and near-misses
      of the scores do not explain the choice
    """

    layer: int
    site: Site
    token_rows: np.ndarray
    logits: np.ndarray
    experts: np.ndarray
    weights: np.ndarray
    score_fn: ScoreFn
    bias: np.ndarray | None = None
    # a `CaptureSource`, or the import format of routing an engine wrote ("sglang-routed", "vllm-routed",
    # "megatron-trace", …; moeviz.engines.FORMATS)
    decision_source: str = "dispatch"
    top_k: int | None = None
    capacity: int | None = None
    shared_experts: int = 0
    module: str = ""
    n_group: int | None = None
    topk_group: int | None = None
    group_score: GroupScore | None = None
    has_logits: bool = True
    has_weights: bool = True
    ranked: bool = True
    zero_experts: int = 0
    hash_routed: bool = False
    bias_on: BiasOn = "scores"
    loop_pass: int = 0
    # derived arrays, computed on first use and kept while logits, score_fn and bias are the same objects
    _derived: dict[str, tuple[Any, np.ndarray]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        n = len(self.token_rows)
        for name, arr, dims in (
            ("logits", self.logits, 2),
            ("experts", self.experts, 2),
            ("weights", self.weights, 2),
        ):
            if arr.ndim != dims or arr.shape[0] != n:
                raise ValueError(f"layer {self.layer} {name}: expected [{n}, ...], got {list(arr.shape)}")
        if self.experts.shape != self.weights.shape:
            raise ValueError(
                f"layer {self.layer}: experts {self.experts.shape} != weights {self.weights.shape}"
            )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_derived": {}}  # a pickle carries the logits, not what derives from them

    def _cached(self, name: str, key: tuple[Any, ...], compute) -> np.ndarray:
        hit = self._derived.get(name)
        if hit is not None and all(a is b for a, b in zip(hit[0], key, strict=True)):
            return hit[1]
        value = compute()
        self._derived[name] = (key, value)
        return value

    @property
    def scores(self) -> np.ndarray:
        """[N, E] router scores, `score_fn(logits)` in fp32 (`moeviz.scoring.scores_from_logits`): derived
        from `logits` on first use, never stored apart from them (read-only)."""
        if not self.has_logits:
            return self.logits  # the all-NaN view: no scores without logits
        key = (self.logits, self.score_fn)
        return self._cached("scores", key, lambda: scores_from_logits(self.logits, self.score_fn))

    @property
    def selection_scores(self) -> np.ndarray:
        """[N, E] what the experts were selected on: `scores` + `bias` (`scores` itself without a bias;
        `logits` + `bias` where the bias is on the logits)."""
        if not self.has_logits:
            return self.logits
        key = (self.logits, self.score_fn, self.bias, self.bias_on)
        base = self.logits if self.bias is not None and self.bias_on == "logits" else None
        return self._cached(
            "selection_scores",
            key,
            lambda: selection_scores(self.scores if base is None else base, self.bias),
        )

    @property
    def num_experts(self) -> int:
        return int(self.logits.shape[1])

    @property
    def routed_experts(self) -> int:
        """Experts that compute: E less the zero-computation experts (ids 0 … routed_experts − 1)."""
        return self.num_experts - self.zero_experts

    @property
    def k(self) -> int:
        return int(self.experts.shape[1])

    @property
    def key(self) -> tuple[str, int]:
        return (self.site, self.layer)


def absent(rows: int, width: int) -> np.ndarray:
    """[rows, width] float32 all NaN as a read-only broadcast view (no memory): the logits or weights of
    routing whose source does not record them (`LayerRouting.has_logits` / `has_weights` False)."""
    return np.broadcast_to(np.float32(np.nan), (rows, width))


class LazyTokens:
    """A token table built on first use: `Trace(tokens=LazyTokens(build))` calls `build()` (→ the
    DataFrame, TOKEN_COLUMNS) the first time `trace.tokens` is read, so a capture whose caller never looks
    at the token strings does not decode them."""

    __slots__ = ("build",)

    def __init__(self, build: Callable[[], pd.DataFrame]) -> None:
        self.build = build
