"""Thread-aware hooks on routers and experts, installed only while a capture runs.

One loaded model serves many app sessions, so several threads may capture on the same modules at once.
Hooks are reference-counted per model (installed by the first active capture, removed by the last) and
each hook writes to the recorder of the thread that is running the forward, so captures never mix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

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


class Restore:
    """A handle whose `remove()` undoes a patch (for `shared_hooks`)."""

    def __init__(self, undo: Callable[[], None]) -> None:
        self.remove = undo


@dataclass
class _HookSet:
    users: int = 0
    handles: list[Any] = field(default_factory=list)


_registry: dict[tuple[int, str], _HookSet] = {}
_registry_lock = threading.Lock()


@contextmanager
def shared_hooks(owner: object, kind: str, install: Callable[[], list[Any]]) -> Iterator[None]:
    """Hooks (or patches) of one `kind` on `owner` (a model, a registry), installed by the first concurrent
    user (`install()` returns handles with `.remove()`) and removed when the last one leaves, also on error.
    What the hooks do per call is decided by thread-local state, so users on different threads never see
    each other's data."""
    key = (id(owner), kind)
    with _registry_lock:
        hooks = _registry.setdefault(key, _HookSet())
        if hooks.users == 0:
            hooks.handles.extend(install())
        hooks.users += 1
    try:
        yield
    finally:
        with _registry_lock:
            hooks.users -= 1
            if hooks.users == 0:
                for handle in hooks.handles:
                    handle.remove()
                hooks.handles.clear()
                _registry.pop(key, None)


@contextmanager
def active_on_thread(local: threading.local, name: str, value: Any) -> Iterator[Any]:
    """Set `local.<name>` to `value` on this thread for the block (what `shared_hooks`' hooks read), then
    put back what was there, also on error."""
    previous = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield value
    finally:
        setattr(local, name, previous)


def installed_hook_count(model: nn.Module, kind: str) -> int:
    """How many hooks of `kind` are on `model` now (0 when no call is running)."""
    hooks = _registry.get((id(model), kind))
    return 0 if hooks is None else len(hooks.handles)


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
            recorder.expert_args[index].append(args)

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
