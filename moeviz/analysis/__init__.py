"""Pure analysis functions over a Trace or its frames."""

# balance, losses, confidence, collapse
from moeviz.analysis.balance import (
    BalanceStats,
    balance_frame,
    balance_stats,
    contiguous_device_load,
    ep_balancedness,
    ep_balancedness_over_layers,
    expert_balance_frame,
    load_entropy,
    load_entropy_nats,
    trace_device_load,
)
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
from moeviz.analysis.losses import (
    AUX_LOSS_FORMS,
    aux_loss_dispatched,
    aux_loss_frame,
    aux_loss_megatron,
    aux_loss_top1,
    aux_loss_topk,
    aux_loss_topk_pooled,
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
# views at scale: expert axis orders and filters; one token's, one layer's and one expert's frames without
# the N × E × L tables
from moeviz.analysis.expert_order import expert_options, expert_order, top_experts
from moeviz.analysis.scale_frames import (
    coactivation_pair_counts,
    expert_scores_frame,
    filter_experts,
    layer_coactivation_frame,
    layer_scores_frame,
    layer_trace,
    mean_score_frame,
    next_layer_transition_frame,
    token_confidence_frame,
    token_scores_frame,
)

# balance, losses, confidence, collapse
__all__ = [
    "AUX_LOSS_FORMS",
    "BalanceStats",
    "CollapseReport",
    "CollapseThresholds",
    "LayerVerdict",
    "Verdict",
    "aux_loss_dispatched",
    "aux_loss_frame",
    "aux_loss_megatron",
    "aux_loss_top1",
    "aux_loss_topk",
    "aux_loss_topk_pooled",
    "balance_frame",
    "balance_stats",
    "collapse_frame",
    "collapse_report",
    "confidence_frame",
    "confidence_summary_frame",
    "contiguous_device_load",
    "ep_balancedness",
    "ep_balancedness_over_layers",
    "expert_balance_frame",
    "layer_confidence",
    "layer_verdict",
    "load_entropy",
    "load_entropy_nats",
    "loss_frame",
    "loss_stats",
    "router_probs",
    "seq_aux_loss",
    "trace_device_load",
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
    "coactivation_pair_counts",
    "expert_options",
    "expert_order",
    "expert_scores_frame",
    "filter_experts",
    "layer_coactivation_frame",
    "layer_scores_frame",
    "layer_trace",
    "mean_score_frame",
    "next_layer_transition_frame",
    "token_confidence_frame",
    "token_scores_frame",
    "top_experts",
]


def __getattr__(name: str):
    """Names renamed in 0.2 (CHANGELOG.md), kept for one release with a DeprecationWarning."""
    from moeviz.analysis import losses

    return losses.deprecated(name, f"moeviz.analysis.{name}")
