"""The dtypes a safetensors header declares, checked against the model they load into. The header checks
(`safetensors_headers`) prove each tensor's bytes match its shape × dtype, which cannot tell apart two dtypes
of one width: a float16 router declared int16 spans the same bytes, and transformers would cast those
integers to floats without a word. A checkpoint that is not quantised stores integers only where the model
holds integer tensors (hash tables, position ids), so an integer dtype on a name the model keeps in floating
point is refused, naming the tensor."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from torch import nn

from moeviz.errors import CorruptWeightsError
from moeviz.models.composite import text_config

INTEGER_DTYPES = frozenset({"BOOL", "I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64"})


def check_stored_dtypes(
    folder: Path, skeleton: nn.Module, config: Any, entries: dict[str, dict[str, Any]]
) -> None:
    """CorruptWeightsError when a tensor of `entries` ({name: safetensors header entry}) is stored in an
    integer dtype under a name (its last component: `weight`, `bias`, ...) that `skeleton` (the model on the
    meta device) holds only as floating-point tensors. Quantised checkpoints pack their weights in integers:
    not checked. A name the model does not hold at all is left alone (transformers ignores it)."""
    if any(getattr(c, "quantization_config", None) for c in (config, text_config(config))):
        return
    floating: set[str] = set()
    integer: set[str] = set()
    for name, tensor in itertools.chain(skeleton.named_parameters(), skeleton.named_buffers()):
        (floating if tensor.is_floating_point() else integer).add(name.rsplit(".", 1)[-1])
    for key, entry in entries.items():
        leaf = key.rsplit(".", 1)[-1]
        if entry["dtype"] in INTEGER_DTYPES and leaf in floating and leaf not in integer:
            raise CorruptWeightsError(
                f"{folder}: tensor {key!r} is declared {entry['dtype']} (integers) in its safetensors "
                f"header, but the model holds its {leaf!r} tensors in floating point: the header's dtype "
                "does not describe its bytes (refusing to cast them)"
            )
