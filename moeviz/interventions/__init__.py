"""Counterfactual routing: disable, force or re-route experts through hooks, and measure the effect.

from moeviz.interventions import DisableExpert, ForceExpert, NextBest, counterfactual
result = counterfactual(loaded, "The quick brown fox", interventions=[DisableExpert(expert=3, layer=1)])
result.next_logprob_change, result.layer_summary(), result.routing_changes()
expert_importance(loaded, text)  # Δ loss per (layer, expert) beside load and gate-weighted load
"""

from moeviz.interventions.counterfactual import (
    Counterfactual,
    counterfactual,
    expert_importance,
    intervening,
    next_token_logprobs,
)
from moeviz.interventions.specs import (
    DisableExpert,
    ForceExpert,
    ForceRouting,
    Intervention,
    InterventionError,
    NextBest,
)

__all__ = [
    "Counterfactual",
    "DisableExpert",
    "ForceExpert",
    "ForceRouting",
    "Intervention",
    "InterventionError",
    "NextBest",
    "counterfactual",
    "expert_importance",
    "intervening",
    "next_token_logprobs",
]
