"""Pure analysis functions over a Trace or its frames."""

# balance, losses, confidence, collapse
from moeviz.analysis.collapse import (
    CollapseReport,
    CollapseThresholds,
    LayerVerdict,
    Verdict,
    collapse_frame,
    collapse_report,
    layer_verdict,
)
from moeviz.analysis.confidence import confidence_frame, confidence_summary_frame, layer_confidence
from moeviz.analysis.load import (
    BalanceStats,
    balance_frame,
    balance_stats,
    ep_balancedness_over_layers,
    expert_balance_frame,
)
from moeviz.analysis.losses import (
    aux_loss,
    aux_loss_pooled,
    loss_frame,
    loss_stats,
    router_probs,
    seq_aux_loss,
    z_loss,
)

# isort: split
# specialisation, structure, checkpoint comparison
from moeviz.analysis.compare import (
    expert_drift_frame,
    match_tokens,
    routing_agreement_frame,
    saturation_timeline,
)
from moeviz.analysis.domains import domain_top_experts
from moeviz.analysis.lineage import Lineage, lineage
from moeviz.analysis.specialisation import (
    DomainSpecialisation,
    domain_specialisation_frame,
    expert_domain_specialisation,
    mutual_information_bits,
    vocabulary_specialisation_frame,
    vocabulary_token_frame,
)
from moeviz.analysis.structure import (
    coactivation_frame,
    coactivation_matrix,
    path_frame,
    repetition_frame,
    transition_frame,
    transition_matrix,
    uniform_repetition_baselines,
)

# isort: split
# views at scale: expert axis orders and filters, one token's frames without the N × E tables
from moeviz.analysis.expert_order import expert_options, expert_order, top_experts
from moeviz.analysis.scale_frames import mean_score_frame, token_confidence_frame, token_scores_frame

# balance, losses, confidence, collapse
__all__ = [
    "BalanceStats",
    "CollapseReport",
    "CollapseThresholds",
    "LayerVerdict",
    "Verdict",
    "aux_loss",
    "aux_loss_pooled",
    "balance_frame",
    "balance_stats",
    "collapse_frame",
    "collapse_report",
    "confidence_frame",
    "confidence_summary_frame",
    "ep_balancedness_over_layers",
    "expert_balance_frame",
    "layer_confidence",
    "layer_verdict",
    "loss_frame",
    "loss_stats",
    "router_probs",
    "seq_aux_loss",
    "z_loss",
]
# specialisation, structure, checkpoint comparison
__all__ += [
    "DomainSpecialisation",
    "Lineage",
    "coactivation_frame",
    "coactivation_matrix",
    "domain_specialisation_frame",
    "domain_top_experts",
    "expert_domain_specialisation",
    "expert_drift_frame",
    "lineage",
    "match_tokens",
    "mutual_information_bits",
    "path_frame",
    "repetition_frame",
    "routing_agreement_frame",
    "saturation_timeline",
    "transition_frame",
    "transition_matrix",
    "uniform_repetition_baselines",
    "vocabulary_specialisation_frame",
    "vocabulary_token_frame",
]
# views at scale
__all__ += [
    "expert_options",
    "expert_order",
    "mean_score_frame",
    "token_confidence_frame",
    "token_scores_frame",
    "top_experts",
]
