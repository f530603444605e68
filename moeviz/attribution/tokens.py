"""Which input tokens drove one scalar of the model (a router score, a next-token log-probability)?

Method: Integrated Gradients (captum) on the token embeddings, i.e. on the output of the model's input
embedding layer, as LayerIntegratedGradients on that layer computes it, but run as IntegratedGradients on
`inputs_embeds` so the baseline can be any embedding and no hook is put on the shared embedding module.

Baseline (documented choice): `"pad"` (default) replaces every token by the pad token's embedding (the
model's own "nothing here" token); `"zero"` uses the all-zero embedding. Attributions per position are the
IG attributions summed over the hidden dimension; by completeness they sum to value(input) −
value(baseline) up to captum's convergence delta, which is reported and warned about when large.

Cross-check: feature ablation (captum `FeatureAblation`), replacing one position's embedding by the
baseline at a time: attribution_i = value(input) − value(input with token i at baseline).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from captum.attr import FeatureAblation, IntegratedGradients

from moeviz.errors import InputError
from moeviz.models.loading import LoadedModel

BASELINES = ("pad", "zero")
# value(embeds [B, P, H]) -> [B]
ValueFn = Callable[[torch.Tensor], torch.Tensor]


class AttributionWarning(UserWarning):
    """IG did not converge well: its attributions do not add up to value(input) − value(baseline)."""


@dataclass
class TokenAttribution:
    """Attribution of one scalar to input positions 0..P-1 (P = tokens the scalar can depend on).

    - what: the scalar, in words (e.g. "router score of expert 3 at layer 1, position 7")
    - token_ids [P], tokens [P]: the input tokens
    - ig [P]: Integrated Gradients attribution per position (summed over the hidden dimension)
    - delta: captum's convergence delta, sum(ig) − (value − baseline_value)
    - value / baseline_value: the scalar on the input and on the baseline
    - ablation [P] | None: value − value with position i replaced by the baseline (perturbation check)
    - baseline: "pad" | "zero"; n_steps: IG steps; warnings: messages about the result's reliability
    """

    what: str
    token_ids: np.ndarray
    tokens: list[str]
    ig: np.ndarray
    delta: float
    value: float
    baseline_value: float
    baseline: str
    n_steps: int
    ablation: np.ndarray | None = None
    warnings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        p = len(self.token_ids)
        if self.token_ids.ndim != 1:
            raise ValueError(f"token_ids: expected a 1-D array [P], got shape {list(self.token_ids.shape)}")
        if len(self.tokens) != p:
            raise ValueError(f"tokens: expected {p} strings (one per token id), got {len(self.tokens)}")
        if self.ig.shape != (p,):
            raise ValueError(
                f"ig: expected shape [{p}] (one attribution per position), got {list(self.ig.shape)}"
            )
        if self.ablation is not None and self.ablation.shape != (p,):
            raise ValueError(f"ablation: expected shape [{p}], got {list(self.ablation.shape)}")
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline: expected one of {BASELINES}, got {self.baseline!r}")

    @property
    def relative_delta(self) -> float:
        """|delta| / |value − baseline_value|: the share of the difference IG failed to account for."""
        return abs(self.delta) / max(abs(self.value - self.baseline_value), 1e-12)

    @property
    def agreement(self) -> float | None:
        """Spearman rank correlation of IG and ablation over positions (None without ablation)."""
        if self.ablation is None or len(self.ig) < 2:
            return None
        ranks = [pd.Series(v).rank().to_numpy() for v in (self.ig, self.ablation)]
        if ranks[0].std() == 0 or ranks[1].std() == 0:
            return None
        return float(np.corrcoef(ranks[0], ranks[1])[0, 1])

    def top(self, n: int = 5, method: str = "ig") -> list[int]:
        """Positions with the largest |attribution| (method "ig" or "ablation"), largest first."""
        values = self.ig if method == "ig" else self.ablation
        if values is None:
            raise ValueError("no ablation attributions: computed with ablation=False")
        return [int(i) for i in np.argsort(-np.abs(values), kind="stable")[:n]]

    def frame(self) -> pd.DataFrame:
        """One row per position: pos, token_id, token, ig, ig_share (ig / Σ|ig|), ablation."""
        total = float(np.abs(self.ig).sum()) or 1.0
        return pd.DataFrame(
            {
                "pos": np.arange(len(self.token_ids)),
                "token_id": self.token_ids,
                "token": self.tokens,
                "ig": self.ig,
                "ig_share": self.ig / total,
                "ablation": self.ablation if self.ablation is not None else np.full(len(self.ig), np.nan),
            }
        )


def pad_token_id(loaded: LoadedModel) -> int:
    """The model's pad token id (0 when its config has none): what the "pad" baseline puts everywhere."""
    pad = getattr(loaded.model.config.get_text_config(), "pad_token_id", None)
    return int(pad) if pad is not None else 0


def embeddings(loaded: LoadedModel, ids: list[int], baseline: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embeddings [1, P, H], baseline embeddings [1, P, H]), detached, in the model's dtype."""
    if baseline not in BASELINES:
        raise InputError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    embed = loaded.model.get_input_embeddings()
    with torch.no_grad():
        inputs = embed(torch.tensor([ids])).detach()
        if baseline == "zero":
            base = torch.zeros_like(inputs)
        else:
            base = embed(torch.full((1, len(ids)), pad_token_id(loaded))).detach()
    return inputs, base


def attribute(
    loaded: LoadedModel,
    value_fn: ValueFn,
    ids: list[int],
    what: str,
    *,
    baseline: str = "pad",
    n_steps: int = 32,
    ablation: bool = True,
    internal_batch_size: int | None = None,
    delta_tolerance: float = 0.05,
    ablation_fn: Callable[[], np.ndarray] | None = None,
) -> TokenAttribution:
    """IG (and optionally feature ablation) of `value_fn` over the token embeddings of `ids`."""
    inputs, base = embeddings(loaded, ids, baseline)
    ig = IntegratedGradients(value_fn)
    attributions, delta = ig.attribute(
        inputs,
        baselines=base,
        n_steps=n_steps,
        internal_batch_size=internal_batch_size,
        return_convergence_delta=True,
    )
    with torch.no_grad():
        value, base_value = (float(v) for v in value_fn(torch.cat([inputs, base])))
    ablated = None
    if ablation:
        if ablation_fn is not None:
            ablated = ablation_fn()
        else:
            mask = torch.arange(len(ids)).view(1, -1, 1).expand_as(inputs)
            with torch.no_grad():
                result = FeatureAblation(value_fn).attribute(
                    inputs, baselines=base, feature_mask=mask, perturbations_per_eval=min(16, len(ids))
                )
            ablated = result[0, :, 0].detach().double().numpy()
    result = TokenAttribution(
        what=what,
        token_ids=np.asarray(ids, dtype=np.int64),
        tokens=loaded.token_texts(list(ids)),
        ig=attributions[0].sum(-1).detach().double().numpy(),
        delta=float(delta.reshape(-1)[0]),
        value=value,
        baseline_value=base_value,
        baseline=baseline,
        n_steps=n_steps,
        ablation=ablated,
    )
    if abs(result.delta) > delta_tolerance * max(abs(value - base_value), 1e-4):
        message = (
            f"IG convergence delta {result.delta:+.3g} is {result.relative_delta:.0%} of value − baseline "
            f"({value - base_value:+.3g}): attributions are approximate; raise n_steps (now {n_steps})"
        )
        result.warnings.append(message)
        warnings.warn(message, AttributionWarning, stacklevel=3)
    return result
