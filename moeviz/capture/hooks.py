"""Thread-aware hooks on routers and experts, installed only while a capture runs.

One loaded model serves many app sessions, so several threads may capture on the same modules at once.
Hooks are reference-counted per model (installed by the first active capture, removed by the last) and
each hook writes to the recorder of the thread that is running the forward, so captures never mix. The
reference counting itself lives in `moeviz.hooks` (shared with `moeviz.interventions`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from moeviz.hooks import active_on_thread, shared_hooks
from moeviz.models.sites import MoESite

_active = threading.local()


@dataclass
class Recorder:
    """What one capture's hooks saw: per site, router outputs and experts-module arguments, in call order."""

    router_outputs: list[list[Any]]
    expert_args: list[list[Sequence[Any]]]
    on_router: Callable[[int], None] | None = None  # called with the site index after each router call

    @classmethod
    def for_sites(cls, n_sites: int) -> Recorder:
        return cls([[] for _ in range(n_sites)], [[] for _ in range(n_sites)])


def _router_hook(index: int):
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        recorder = getattr(_active, "recorder", None)
        if recorder is not None:
            recorder.router_outputs[index].append(output)
            if recorder.on_router is not None:
                recorder.on_router(index)

    return hook


def _experts_hook(index: int):
    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        recorder = getattr(_active, "recorder", None)
        if recorder is not None:
            # the decision only: keeping the hidden states (args[0]) alive until the capture ends would
            # keep the allocator from reusing their memory (a page-faulting fresh allocation per layer)
            recorder.expert_args[index].append((None, *args[1:]) if args else args)

    return hook


@contextmanager
def recording(model: nn.Module, sites: list[MoESite]) -> Iterator[Recorder]:
    """Record routing on this thread for the duration of the block; hooks are gone afterwards."""

    def install() -> list[Any]:
        handles = []
        for index, site in enumerate(sites):
            handles.append(site.router.register_forward_hook(_router_hook(index)))
            if site.experts is not None and site.needs_expert_args:
                handles.append(site.experts.register_forward_pre_hook(_experts_hook(index), with_kwargs=True))
        return handles

    recorder = Recorder.for_sites(len(sites))
    with shared_hooks(model, "routing", install), active_on_thread(_active, "recorder", recorder):
        yield recorder
