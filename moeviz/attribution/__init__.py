"""Why this expert? Token attributions (captum) of router scores and next-token log-probabilities.

from moeviz.attribution import router_attribution, next_token_attribution
result = router_attribution(loaded, text, position=7, layer=1, expert=3)
result.frame()     # pos, token, ig, ig_share, ablation
result.delta, result.warnings, result.agreement
"""

from moeviz.attribution.router import next_token_attribution, router_attribution
from moeviz.attribution.tokens import BASELINES, AttributionWarning, TokenAttribution

__all__ = [
    "BASELINES",
    "AttributionWarning",
    "TokenAttribution",
    "next_token_attribution",
    "router_attribution",
]
