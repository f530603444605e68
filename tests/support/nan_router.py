"""A tiny mixtral whose router scores are not finite (one router weight of its last MoE layer set to NaN),
with the sample's tokenizer: what the library, the CLI and the app must warn about."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.scale_models import with_tokenizer


def poison(model: torch.nn.Module) -> None:
    """One router weight of MoE layer 1 (the last) set to NaN."""
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight[0, 0] = float("nan")


def save_nan_router_model(folder: Path) -> Path:
    """The tiny mixtral (the sample's 2,048-id vocabulary) with a poisoned router, saved in `folder`."""
    from moeviz.testing.tiny_models import build_tiny_model

    model = build_tiny_model("mixtral", vocab_size=2048)
    poison(model)
    model.save_pretrained(folder)
    return with_tokenizer(folder)
