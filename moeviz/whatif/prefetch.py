"""Speculative expert prefetch: predict layer ℓ+1's experts by applying its router to layer ℓ's MoE input.

An offloading server that knows the next layer's experts one layer early can copy them to the GPU while
layer ℓ computes. The prediction applies router ℓ+1 (its own weights and selection rule: score function,
balancing bias, group limit) to the hidden state router ℓ received; recall = mean over tokens of
|predicted top-k ∩ actual experts at ℓ+1| / k, where the actual experts are the ones the model dispatched.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pandas as pd
import torch

from moeviz.analysis.confidence import eligible_by_groups
from moeviz.analysis.losses import top_k_indices
from moeviz.capture.forward import capture, token_batch
from moeviz.errors import CaptureError, InputError
from moeviz.hooks import active_on_thread, shared_hooks
from moeviz.models.loading import LoadedModel
from moeviz.models.sites import MoESite
from moeviz.trace import LayerRouting, Trace

DEFINITION = (
    "recall = mean over tokens of |top-k(router ℓ+offset on layer ℓ's router input) ∩ dispatched experts at "
    "ℓ+offset| / k (selection scores with bias and group limit, as the model selects)"
)
_active = threading.local()


@contextmanager
def recording_router_inputs(loaded: LoadedModel) -> Iterator[list[list[torch.Tensor]]]:
    """Keep, per MoE site and call, the hidden state [N, H] its router received, on this thread only (the
    model is shared: the hooks write to the thread's own list, as `moeviz.capture.hooks` does)."""

    def hook(index: int):
        def pre(module, args: Any, kwargs: dict[str, Any]) -> None:
            store = getattr(_active, "inputs", None)
            if store is not None:
                hidden = args[0] if args else next(iter(kwargs.values()))
                store[index].append(hidden.detach().reshape(-1, hidden.shape[-1]))

        return pre

    def install() -> list[Any]:
        return [
            site.router.register_forward_pre_hook(hook(i), with_kwargs=True)
            for i, site in enumerate(loaded.sites)
        ]

    inputs: list[list[torch.Tensor]] = [[] for _ in loaded.sites]
    with shared_hooks(loaded.model, "whatif-prefetch", install), active_on_thread(_active, "inputs", inputs):
        yield inputs


def predict_experts(site: MoESite, routing: LayerRouting, hidden: torch.Tensor) -> np.ndarray:
    """[N, k] experts `site`'s router would select for hidden [N, H]: top-k of its selection scores (scores +
    bias) among the eligible experts (the `topk_group` best groups for group-limited routers). `routing` is
    the site's captured layer: it supplies k and the group rule."""
    with torch.inference_mode():
        logits = site.router_logits(site.router(hidden))
        if logits is None:
            raise CaptureError(
                f"layer {site.layer} ({site.name}): no [N, {site.num_experts}] logits in router output"
            )
        selection = site.router_scores(logits.float(), selection=True).cpu().numpy()
    n_group, topk_group = routing.n_group, routing.topk_group
    if n_group and topk_group and n_group > 1 and topk_group < n_group and selection.shape[1] % n_group == 0:
        eligible = eligible_by_groups(selection, n_group, topk_group, routing.group_score)
        selection = np.where(eligible, selection, -np.inf)
    return top_k_indices(selection, routing.k, ordered=False)


def set_recall(predicted: np.ndarray, actual: np.ndarray, num_experts: int) -> np.ndarray:
    """[N] |predicted ∩ actual| / k for ids [N, k] (actual -1 = dropped slot, never matched)."""
    k = actual.shape[1]
    hit = np.zeros((len(actual), num_experts + 1), dtype=bool)
    rows = np.arange(len(actual))[:, None]
    hit[rows, np.where(actual >= 0, actual, num_experts)] = True
    hit[:, num_experts] = False
    return hit[rows, predicted].sum(axis=1) / k


def prefetch_recall(
    loaded: LoadedModel,
    *,
    text: str | Sequence[str] | None = None,
    token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    offset: int = 1,
    trace_out: list[Trace] | None = None,
) -> pd.DataFrame:
    """Recall of predicting MoE layer ℓ+offset's experts from layer ℓ's router input, one row per predicted
    layer: layer (ℓ+offset), from_layer (ℓ), site, recall, tokens. `offset` counts MoE layers (1 = the next
    MoE layer; 0 = a layer's own router on its own input, a sanity check that gives 1 where the recomputed
    selection matches the model's). The input is one sequence or several (`text` a list, or `token_ids` a
    list of sequences: the evaluation corpus): one forward per sequence (no padding rows), recall the mean
    over every sequence's tokens. `trace_out`, if given, receives each sequence's capture."""
    if offset < 0:
        raise InputError(f"prefetch offset must be >= 0, got {offset}")
    hits: dict[tuple[int, int, str], list[float]] = {}  # (layer, from_layer, site) -> [Σ recall, tokens]
    for ids in token_batch(loaded, text, token_ids):
        for key, (total, tokens) in _sequence_recall(loaded, ids, offset, trace_out).items():
            sums = hits.setdefault(key, [0.0, 0])
            sums[0] += total
            sums[1] += tokens
    rows = [
        {
            "layer": layer,
            "from_layer": from_layer,
            "site": site,
            "recall": total / tokens if tokens else float("nan"),
            "tokens": int(tokens),
        }
        for (layer, from_layer, site), (total, tokens) in hits.items()
    ]
    return pd.DataFrame(rows, columns=["layer", "from_layer", "site", "recall", "tokens"])


def _sequence_recall(
    loaded: LoadedModel, ids: list[int], offset: int, trace_out: list[Trace] | None
) -> dict[tuple[int, int, str], tuple[float, int]]:
    """One sequence, one forward: per predicted layer (layer, from_layer, site) → (Σ recall over its
    tokens, tokens)."""
    with recording_router_inputs(loaded) as inputs:
        trace = capture(loaded, token_ids=[ids])
    if trace_out is not None:
        trace_out.append(trace)
    out: dict[tuple[int, int, str], tuple[float, int]] = {}
    for i, site in enumerate(loaded.sites):
        j = i + offset
        if j >= len(loaded.sites) or loaded.sites[j].site != site.site or len(inputs[i]) != 1:
            continue
        nxt = loaded.sites[j]
        source, actual = trace.layer(site.layer, site.site), trace.layer(nxt.layer, nxt.site)
        hidden = inputs[i][0]
        # one sequence, no padding: the router's rows are the positions in order, as are the trace's rows
        keep = torch.as_tensor(np.sort(source.token_rows), device=hidden.device)
        predicted = predict_experts(nxt, actual, hidden[keep])
        order = np.argsort(actual.token_rows)
        recall = set_recall(predicted, actual.experts[order], actual.num_experts)
        out[(nxt.layer, site.layer, site.site)] = (float(recall.sum()), len(recall))
    return out
