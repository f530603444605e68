"""Loading progress: `progress(bytes_read, total_bytes)` called as transformers materialises a checkpoint's
tensors, by standing in for its "Loading weights" bar on the loading thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moeviz.models.safetensors_headers import tensor_bytes


class _Progress:
    def __init__(self, callback: Callable[[int, int], None], sizes: dict[str, int], total: int) -> None:
        self.callback, self.sizes, self.total, self.done = callback, sizes, total, 0

    def track(self, items: Any) -> Iterator[Any]:
        for item in items:
            yield item  # the loader converts and places this entry's tensors before asking for the next
            mapping = item[1] if isinstance(item, tuple) and len(item) == 2 else None
            sources = getattr(mapping, "layer_targets", None) or {}
            self.done += sum(self.sizes.get(key, 0) for keys in sources.values() for key in keys)
            self.callback(min(self.done, self.total), self.total)


_progress_local = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0


def _tracking_tqdm(original: Callable[..., Any]) -> Callable[..., Any]:
    def tqdm(iterable: Any = None, *args: Any, **kwargs: Any) -> Any:
        state = getattr(_progress_local, "state", None)
        if state is None or kwargs.get("desc") != "Loading weights":
            return original(iterable, *args, **kwargs)
        return state.track(iterable)

    tqdm.moeviz_original = original  # type: ignore[attr-defined]
    return tqdm


@contextmanager
def reporting_progress(callback: Callable[[int, int], None] | None, folder: Path) -> Iterator[None]:
    """Call `callback(bytes_read, total_bytes)` as transformers materialises the checkpoint's tensors (total
    = the safetensors data bytes; pickled weights report only start and end). transformers' own "Loading
    weights" bar is replaced by the callback on this thread; other threads' loads are untouched."""
    if callback is None:
        yield
        return
    global _patch_users
    sizes = tensor_bytes(folder)
    total = sum(sizes.values()) or sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    try:
        from transformers import core_model_loading as loader
    except ImportError:
        loader = None
    with _patch_lock:
        if loader is not None and hasattr(loader, "tqdm"):
            if _patch_users == 0:
                loader.tqdm = _tracking_tqdm(loader.tqdm)
            _patch_users += 1
        else:
            loader = None
    previous = getattr(_progress_local, "state", None)
    _progress_local.state = _Progress(callback, sizes, total)
    try:
        callback(0, total)
        yield
        callback(total, total)
    finally:
        _progress_local.state = previous
        if loader is not None:
            with _patch_lock:
                _patch_users -= 1
                if _patch_users == 0:
                    loader.tqdm = getattr(loader.tqdm, "moeviz_original", loader.tqdm)
