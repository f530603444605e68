"""A callback between decoder layers: progress for long actions, and the point where they can be cancelled.

A forward of a large model takes a minute; a callback that runs only between forwards reports (and can be
stopped: the app's Stop raises from the next progress update) once a minute. `layer_progress` registers
forward pre-hooks on the decoder layers that call the running thread's callback before each layer, so an
exception raised there ends the forward within one layer. Hooks come from the shared registry
(`moeviz.hooks`): reference-counted per model, acting only on the thread that asked, and removed when the
block ends, also when the callback raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from moeviz.hooks import active_on_thread, shared_hooks
from moeviz.hooks import installed_hook_count as shared_hook_count

# The names transformers gives the list of a text model's blocks ("layers"; GPT-style "h"; T5 "block").
LAYER_LIST_NAMES = ("layers", "h", "block", "blocks")
KIND = "layer-progress"

_active = threading.local()  # .callback: this thread's Callable[[], None], or None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks of `model` in execution order: the members of every non-empty `nn.ModuleList` named
    `layers` (or `h`, `block`, `blocks`) that is not inside another such list (an encoder-decoder has two)."""
    found: list[nn.Module] = []
    lists: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module):
            continue
        if name.rsplit(".", 1)[-1] not in LAYER_LIST_NAMES or any(name.startswith(f"{p}.") for p in lists):
            continue
        lists.append(name)
        found.extend(module)
    return found


@contextmanager
def watching_layers(model: nn.Module) -> Iterator[int]:
    """While the block runs, every decoder layer of `model` calls this thread's active callback (set by
    `layer_progress`, possibly for another model, e.g. the original of a copy) before it runs. Yields the
    number of layers watched; a model without a recognisable list of blocks has none (no hooks)."""
    layers = decoder_layers(model)

    def before_layer(_module: nn.Module, _args: Any) -> None:
        callback = getattr(_active, "callback", None)
        if callback is not None:
            callback()

    def install() -> list[Any]:
        return [layer.register_forward_pre_hook(before_layer) for layer in layers]

    with shared_hooks(model, KIND, install):
        yield len(layers)


class LayerTicker:
    """Counts decoder layers run and reports `progress(fraction, message)` for a planned number of forwards
    (fraction = layers run / (forwards × layers per forward), at most 1). `what` names the current step in
    the message and may be changed between forwards."""

    def __init__(
        self, progress: Callable[[float, str], None], forwards: int, layers: int, what: str = ""
    ) -> None:
        self.progress, self.forwards, self.layers, self.what = (
            progress,
            max(forwards, 1),
            max(layers, 1),
            what,
        )
        self.done = 0

    def __call__(self) -> None:
        forward, layer = divmod(self.done, self.layers)
        self.done += 1
        forward = min(forward + 1, self.forwards)
        where = f"forward {forward} of {self.forwards}, layer {layer + 1} of {self.layers}"
        fraction = min(self.done / (self.forwards * self.layers), 1.0)
        self.progress(fraction, f"{self.what} · {where}" if self.what else where)


@contextmanager
def layer_progress(
    model: nn.Module, progress: Callable[[float, str], None] | None, *, forwards: int, what: str = ""
) -> Iterator[LayerTicker | None]:
    """Call `progress(fraction, message)` before each decoder layer of every forward of `model` this thread
    runs inside the block (`forwards`: how many are planned, for the fraction). An exception `progress`
    raises ends the forward before that layer and leaves the block with the hooks removed. None: nothing
    is installed (yields None)."""
    if progress is None:
        yield None
        return
    with watching_layers(model) as layers:
        ticker = LayerTicker(progress, forwards, layers, what)
        with active_on_thread(_active, "callback", ticker):
            yield ticker


def installed_hook_count(model: nn.Module) -> int:
    """How many layer-progress hooks are on `model` now (0 when no block is running): for tests."""
    return shared_hook_count(model, KIND)
