"""Thread-aware hooks that rewrite the dispatched routing (and read router logits) during one call.

Same contract as `moeviz.capture.hooks` (both build on the registry in `moeviz.hooks`): one model serves
many sessions, so hooks are reference-counted per model, act only on the thread whose `Probe` is active,
and are removed when the last user leaves, also on error. The experts pre-hook is *prepended* so a capture
running in the same thread records the decision after the intervention (what the experts actually
computed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moeviz.hooks import active_on_thread, shared_hooks
from moeviz.hooks import installed_hook_count as shared_hook_count
from moeviz.models.dispatch import read_decision, write_decision
from moeviz.models.sites import MoESite

# (site index, top_k_index [N, k], top_k_weights [N, k], router logits [N, E] | None) -> (index, weights)
Rewrite = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]

_active = threading.local()


class StopForward(Exception):
    """Raised by the router hook once the probed router has run, to skip the rest of the forward."""


@dataclass
class Probe:
    """What one thread asks of the hooks: rewrite decisions (given the router logits), stop early."""

    rewrite: Rewrite | None = None
    rewrite_sites: set[int] = field(default_factory=set)  # site indices `rewrite` applies to
    stop_after: int | None = None  # site index whose router ends the forward (raises StopForward)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # site index -> [N, E] (with grad)


def _router_logits(site: MoESite, output: Any) -> torch.Tensor:
    logits = site.router_logits(output)
    if logits is None:
        raise RuntimeError(
            f"layer {site.layer} ({site.name}): no [N, {site.num_experts}] logits in router output"
        )
    return logits


def _router_hook(index: int, site: MoESite):
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        probe: Probe | None = getattr(_active, "probe", None)
        if probe is None:
            return
        if index in probe.rewrite_sites or probe.stop_after == index:
            probe.logits[index] = _router_logits(site, output)
        if probe.stop_after == index:
            raise StopForward

    return hook


def _experts_hook(index: int, site: MoESite):
    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        probe: Probe | None = getattr(_active, "probe", None)
        if probe is None or probe.rewrite is None or index not in probe.rewrite_sites:
            return None
        top_k_index, top_k_weights = read_decision(site, args)
        logits = probe.logits.get(index)
        new_index, new_weights = probe.rewrite(index, top_k_index, top_k_weights, logits)
        if new_index is top_k_index and new_weights is top_k_weights:
            return None
        return write_decision(args, new_index, new_weights), kwargs

    return hook


@contextmanager
def probing(model: nn.Module, sites: list[MoESite], probe: Probe) -> Iterator[Probe]:
    """Run `probe` on this thread for the duration of the block; hooks are gone afterwards."""

    def install() -> list[Any]:
        handles = []
        for index, site in enumerate(sites):
            handles.append(site.router.register_forward_hook(_router_hook(index, site)))
            if site.experts is not None:
                # prepend: rewrite the decision before a capture in the same thread records it
                hook = _experts_hook(index, site)
                handles.append(site.experts.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
        return handles

    with shared_hooks(model, "interventions", install), active_on_thread(_active, "probe", probe):
        yield probe


def installed_hook_count(model: nn.Module) -> int:
    """How many intervention hooks are on `model` now (0 when no call is running): for tests."""
    return shared_hook_count(model, "interventions")
