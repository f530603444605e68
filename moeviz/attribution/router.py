"""Why did the router at (position t, layer ℓ) score expert e? And what drove the next-token log-prob?"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
from captum.attr import FeatureAblation, LLMAttribution, TextTokenInput

from moeviz.attribution.tokens import TokenAttribution, attribute, pad_token_id
from moeviz.errors import InputError
from moeviz.interventions.counterfactual import sequence_ids
from moeviz.interventions.hooks import Probe, StopForward, probing
from moeviz.models.loading import LoadedModel

TARGETS = ("score", "logit", "selection")


def _site_index(loaded: LoadedModel, layer: int, site: str | None) -> int:
    for i, s in enumerate(loaded.sites):
        if s.layer == layer and (site is None or s.site == site):
            return i
    layers = sorted({s.layer for s in loaded.sites})
    raise InputError(f"no MoE layer {layer}{'' if site is None else f' ({site})'}: MoE layers are {layers}")


def _prefix(ids: list[int], position: int) -> list[int]:
    """Tokens 0..`position`: all a causal decoder's value at `position` can depend on."""
    if not 0 <= position < len(ids):
        raise InputError(f"position {position} outside the prompt (0..{len(ids) - 1})")
    return ids[: position + 1]


def router_value_fn(loaded: LoadedModel, site_index: int, position: int, expert: int, target: str):
    """value(embeds [B, P, H]) -> [B]: the router's `target` for `expert` at `position` of each sequence.

    The forward stops right after that router (later layers cannot change it), via the probe hooks."""
    site = loaded.sites[site_index]
    if target not in TARGETS:
        raise InputError(f"target must be one of {TARGETS}, got {target!r}")

    def value(embeds: torch.Tensor) -> torch.Tensor:
        b, p = embeds.shape[:2]
        probe = Probe(stop_after=site_index)
        with probing(loaded.model, loaded.sites, probe), contextlib.suppress(StopForward):
            loaded.model(inputs_embeds=embeds, use_cache=False)
        logits = probe.logits[site_index].reshape(b, p, -1)[:, position, :].float()  # [B, E]
        if target == "logit":
            return logits[:, expert]
        return site.router_scores(logits, selection=target == "selection")[:, expert]

    return value


def router_attribution(
    loaded: LoadedModel,
    text: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    position: int,
    layer: int,
    expert: int,
    site: str | None = None,
    target: str = "score",
    baseline: str = "pad",
    n_steps: int = 32,
    ablation: bool = True,
    internal_batch_size: int | None = None,
    delta_tolerance: float = 0.05,
) -> TokenAttribution:
    """Which input tokens drove the router's score for `expert` at (`position`, `layer`)?

    `target`: "score" (default: softmax probability or sigmoid, what selection ranks), "logit" (raw router
    logit) or "selection" (score + balancing bias; same attributions as "score", the bias is constant).
    Only positions 0..`position` can matter in a causal decoder, so the input is cut there (exact, and
    faster); the result covers those positions. See `moeviz.attribution.tokens` for the method and
    baseline.
    """
    ids = sequence_ids(loaded, text, token_ids)
    prefix = _prefix(ids, position)
    index = _site_index(loaded, layer, site)
    num_experts = loaded.sites[index].num_experts
    if not 0 <= expert < num_experts:
        raise InputError(f"expert {expert} out of range: layer {layer} has experts 0..{num_experts - 1}")
    value = router_value_fn(loaded, index, position, expert, target)
    return attribute(
        loaded,
        value,
        prefix,
        f"router {target} of expert {expert} at layer {layer}, position {position}",
        baseline=baseline,
        n_steps=n_steps,
        ablation=ablation,
        internal_batch_size=internal_batch_size,
        delta_tolerance=delta_tolerance,
    )


class _IdsTokenizer:
    """Just enough of a tokenizer for captum's `TextTokenInput`: the text *is* the given ids, so the
    attribution uses exactly our tokens (no re-tokenisation, works for models without a tokenizer)."""

    def __init__(self, loaded: LoadedModel, ids: list[int]) -> None:
        self.loaded, self.ids = loaded, ids

    def encode(self, text, add_special_tokens: bool = True, return_tensors: str | None = None):
        return torch.tensor([self.ids]) if return_tensors == "pt" else list(self.ids)

    def convert_ids_to_tokens(self, ids):
        return self.loaded.token_texts([int(i) for i in ids])

    def convert_tokens_to_ids(self, tokens):
        raise InputError("give the baseline as a token id")

    def decode(self, ids, **kwargs) -> str:
        self._last = [int(i) for i in torch.as_tensor(ids).reshape(-1)]
        return "".join(self.loaded.token_texts(self._last))

    def __call__(self, text: str, **kwargs) -> dict[str, list]:
        """Re-encoding of the text last decoded (captum uses it for display labels): its ids, with
        offsets from each token's own text."""
        ids = getattr(self, "_last", [])
        ends = np.cumsum([len(t) for t in self.loaded.token_texts(ids)]).tolist()
        return {"input_ids": ids, "offset_mapping": list(zip([0, *ends[:-1]], ends, strict=True))}


def next_token_attribution(
    loaded: LoadedModel,
    text: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    position: int | None = None,
    target_id: int | None = None,
    baseline: str = "pad",
    n_steps: int = 32,
    ablation: bool = True,
    internal_batch_size: int | None = None,
    delta_tolerance: float = 0.05,
) -> TokenAttribution:
    """Which input tokens drove log p(target | tokens 0..position)?

    `position` defaults to the last token; `target_id` to the prompt's next token (or, after the last
    token, the model's own argmax). IG on the embeddings as for routers; the perturbation check is
    captum's LLM attribution API (`LLMAttribution` over `FeatureAblation`, the token replaced by the pad
    id). captum's `LLMGradientAttribution` is not used: its LayerIntegratedGradients puts a hook on the
    embedding module, which would leak into other sessions sharing the model.
    """
    ids = sequence_ids(loaded, text, token_ids)
    position = len(ids) - 1 if position is None else position
    prefix = _prefix(ids, position)
    vocab = loaded.vocab_size
    if target_id is None:
        if position + 1 < len(ids):
            target_id = ids[position + 1]
        else:
            with torch.inference_mode():
                target_id = int(loaded.model(input_ids=torch.tensor([prefix])).logits[0, -1].argmax())
    if not 0 <= target_id < vocab:
        raise InputError(f"target_id {target_id} outside the vocabulary [0, {vocab})")

    def value(embeds: torch.Tensor) -> torch.Tensor:
        logits = loaded.model(inputs_embeds=embeds, use_cache=False).logits[:, -1].float()
        return torch.log_softmax(logits, dim=-1)[:, target_id]

    def llm_ablation() -> np.ndarray:
        tokenizer = _IdsTokenizer(loaded, prefix)
        llm = LLMAttribution(FeatureAblation(loaded.model), tokenizer)
        inp = TextTokenInput("", tokenizer, baselines=0 if baseline == "zero" else pad_token_id(loaded))
        with torch.no_grad():
            result = llm.attribute(inp, target=torch.tensor([target_id]), forward_in_tokens=False)
        return result.seq_attr.detach().double().cpu().numpy()

    target_text = loaded.token_texts([target_id])[0]
    return attribute(
        loaded,
        value,
        prefix,
        f"log p({target_text!r} | tokens 0..{position})",
        baseline=baseline,
        n_steps=n_steps,
        ablation=ablation,
        internal_batch_size=internal_batch_size,
        delta_tolerance=delta_tolerance,
        ablation_fn=llm_ablation if baseline == "pad" else None,
    )
