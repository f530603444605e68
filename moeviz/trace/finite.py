"""Router scores that are not finite: which layers hold them, and the warning `capture` gives (as a
`RoutingWarning`) and the app and CLI print. No torch: it reads a trace's layers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moeviz.trace.records import LayerRouting


def non_finite_layers(layers: Sequence[LayerRouting]) -> list[str]:
    """`layer L (site)` of each layer whose router logits hold a NaN or an infinity (its scores, computed
    from them, then do too)."""
    return [f"layer {layer.layer} ({layer.site})" for layer in layers if not np.isfinite(layer.logits).all()]


def routing_warning(layers: Sequence[LayerRouting]) -> str | None:
    """The warning for router scores that are not finite, naming the layers; None when every layer's are."""
    return non_finite_warning(non_finite_layers(layers))


def non_finite_warning(bad: Sequence[str]) -> str | None:
    """`routing_warning`'s text for the layers named in `bad` (`layer L (site)`); None when empty."""
    if not bad:
        return None
    return (
        f"router scores are not finite (NaN or infinite) in {', '.join(bad)}: the experts chosen there "
        "mean nothing; check the checkpoint's router weights (and the dtype it was loaded at)"
    )
