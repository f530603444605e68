"""Where a family's routing decision can be rewritten before the experts run (for counterfactual routing).

Most families call `experts(hidden [N, H], top_k_index [N, k], top_k_weights [N, k])` after every
selection rule (bias, group limits, scaling, sparsemixer), so a forward pre-hook on `experts` that swaps
the last two arguments changes what is dispatched, whatever rule chose it. Families whose `experts` module
does not receive the decision in that form (Llama4 and JetMoE decode it inside the router output; Switch
and NLLB pass capacity-masked dense masks) are not supported for interventions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moeviz.models.decoding import expert_args_look_like_decision
from moeviz.models.sites import MoESite

_REWRITABLE = {"expert_args", "auto"}


def unsupported_reason(site: MoESite) -> str | None:
    """Why routing interventions cannot act on `site`, or None when they can."""
    if site.experts is None:
        return (
            f"layer {site.layer} ({site.name}): this family's experts module does not receive the routing "
            "decision, so moeviz cannot rewrite it"
        )
    if site.decoder not in _REWRITABLE:
        return (
            f"layer {site.layer} ({site.name}): the experts module gets the routing as '{site.decoder}' "
            "(not (hidden, top_k_index, top_k_weights)); routing interventions support only families that "
            "pass the top-k decision to their experts"
        )
    return None


def read_decision(site: MoESite, args: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k_index [N, k], top_k_weights [N, k]) from the experts module's positional args."""
    if not expert_args_look_like_decision(args):
        raise TypeError(
            f"layer {site.layer} ({site.name}): the experts module was not called as "
            "experts(hidden, top_k_index, top_k_weights); cannot intervene on its routing"
        )
    return args[1], args[2]


def write_decision(args: Sequence[Any], index: torch.Tensor, weights: torch.Tensor) -> tuple[Any, ...]:
    """The experts args with the decision replaced (dtype, device and shape of the originals kept)."""
    old_index, old_weights = args[1], args[2]
    index = index.to(dtype=old_index.dtype, device=old_index.device).reshape(old_index.shape)
    weights = weights.to(dtype=old_weights.dtype, device=old_weights.device).reshape(old_weights.shape)
    return (args[0], index, weights, *args[3:])
