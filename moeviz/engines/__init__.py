"""Routing that other engines produced: importers of SGLang, vLLM and Megatron files and of public traces.

`import_routing(format, files, model)` reads files in one of `FORMATS`, exactly as their engine writes them
(docs/engine-formats.md), checks them against the model's config (`layout.routing_layout`: no weights
needed) and returns the one data model: a `Trace` for per-token routing (each layer's `decision_source` is
the format name, logits and weights marked absent where the format has none), or an `ExpertLoad` for an
engine's expert counts. Every page, report, store and what-if then takes it unchanged.

Each format's module exposes `read(fmt, files, layout, token_ids) -> Trace | ExpertLoad`.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from moeviz.errors import InputError

if TYPE_CHECKING:
    import numpy as np

    from moeviz.trace import ExpertLoad, Trace

# format name -> (module that reads it, what it is)
FORMATS: dict[str, tuple[str, str]] = {
    "sglang-dump": (
        "moeviz.engines.sglang_dump",
        "SGLang expert-distribution dump (.pt: stat/stat_approx counts, per_pass counts, per_token ids)",
    ),
    "sglang-routed": (
        "moeviz.engines.sglang_routed",
        "SGLang return_routed_experts (a saved /generate or OpenAI response, JSON or JSONL)",
    ),
    "vllm-routed": (
        "moeviz.engines.vllm_routed",
        "vLLM routed experts (a saved response, JSON or JSONL, in any of its three forms; or .npy)",
    ),
    "megatron-trace": (
        "moeviz.engines.megatron",
        "Megatron-Core routing trace (router_trace_rank{r}.jsonl, optional logits sidecar)",
    ),
    "megatron-replay": (
        "moeviz.engines.megatron",
        "Megatron-Core inference response with moe_topk_indices (JSON or JSONL)",
    ),
    "flame": ("moeviz.engines.flame", "FLAME-MoE trace parquet (actives/iter_N/layer_NN.parquet + samples)"),
    "moe-infinity": ("moeviz.engines.moe_infinity", "MoE-Infinity expert count matrices (.npy)"),
}


def import_routing(
    fmt: str,
    files: Sequence[str | Path],
    model: str | Path,
    *,
    token_ids: list[np.ndarray] | None = None,
    texts: Sequence[str] | None = None,
) -> Trace | ExpertLoad:
    """Read `files` in format `fmt` for `model` (a folder with config.json, or `sample:NAME`).

    `token_ids` (one array per sequence) or `texts` (tokenised with the model's tokenizer) give the tokens
    when the format lacks them, and are checked against them when it has them."""
    if fmt not in FORMATS:
        raise InputError(f"unknown routing format {fmt!r}; one of {', '.join(FORMATS)}")
    if token_ids is not None and texts is not None:
        raise InputError("give token ids or texts, not both")
    paths = [Path(f) for f in files]
    if not paths:
        raise InputError(f"{fmt}: no file given")
    for path in paths:
        if not path.exists():
            raise InputError(f"{path} does not exist")
    from moeviz.engines.layout import routing_layout

    layout = routing_layout(model)
    if texts is not None:
        from moeviz.engines.tokens import text_token_ids

        token_ids = text_token_ids(layout, texts)
    reader = import_module(FORMATS[fmt][0])
    return reader.read(fmt, paths, layout, token_ids)
