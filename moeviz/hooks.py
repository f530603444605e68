"""The shared hook registry: reference-counted, thread-aware hooks and patches on shared objects.

One loaded model serves many app sessions, so several threads may run a capture or an intervention on the
same modules at once. `shared_hooks` installs the hooks of one kind on one owner (a model, a registry, a
Python module) for the first concurrent user and removes them when the last one leaves; what the hooks do
per call is decided by thread-local state (`active_on_thread`), so users on different threads never mix.

Neutral and low-level on purpose (standard library only): `moeviz.capture` and `moeviz.interventions` both
build on it without importing each other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


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


def installed_hook_count(owner: object, kind: str) -> int:
    """How many hooks of `kind` are on `owner` now (0 when no call is running)."""
    hooks = _registry.get((id(owner), kind))
    return 0 if hooks is None else len(hooks.handles)


__all__ = ["Restore", "active_on_thread", "installed_hook_count", "shared_hooks"]
