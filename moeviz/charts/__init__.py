"""Charts: one small pure function per view, a frame in, an `alt.Chart` out (no Streamlit, no torch)."""

from moeviz.charts._common import INK, PAPER
from moeviz.charts.about import bias_chart
from moeviz.charts.attention import (
    HEAD_METRICS,
    HEAD_SELECTION,
    attention_block_frame,
    attention_map_chart,
    attention_row_chart,
    attention_row_frame,
    head_grid_frame,
    head_metric_heatmap,
    kv_whatif_heatmap,
)
from moeviz.charts.binning import bin_rows, bin_size, binned_dispatch_heatmap
from moeviz.charts.compare import agreement_chart, load_shift_heatmap
from moeviz.charts.engines import (
    layer_mismatch_chart,
    margin_quartile_chart,
    position_heatmap,
    routers_per_token_chart,
    routers_strip_chart,
)
from moeviz.charts.load import (
    UNIFORM_VALUE,
    aux_loss_chart,
    balance_chart,
    load_heatmap,
)
from moeviz.charts.routing import (
    TOKEN_SELECTION,
    expert_load_chart,
    expert_timeline_chart,
    router_score_heatmap,
    token_label,
    token_layer_scores_chart,
    token_margin_chart,
    token_path_chart,
    token_strip_chart,
    token_window,
)
from moeviz.charts.scale import (
    EXPERT_BRUSH,
    MAX_CATEGORICAL,
    expert_colour,
    expert_load_curve_chart,
    layer_expert_heatmap,
    token_rank_path_chart,
)
from moeviz.charts.structure import coactivation_heatmap, path_chart, repetition_chart, transition_heatmaps
from moeviz.charts.tables import dead_hot_experts, stack_scores, token_options

__all__ = [
    "EXPERT_BRUSH",
    "HEAD_METRICS",
    "HEAD_SELECTION",
    "INK",
    "MAX_CATEGORICAL",
    "PAPER",
    "TOKEN_SELECTION",
    "UNIFORM_VALUE",
    "agreement_chart",
    "attention_block_frame",
    "attention_map_chart",
    "attention_row_chart",
    "attention_row_frame",
    "aux_loss_chart",
    "balance_chart",
    "bias_chart",
    "bin_rows",
    "bin_size",
    "binned_dispatch_heatmap",
    "coactivation_heatmap",
    "dead_hot_experts",
    "expert_colour",
    "expert_load_chart",
    "expert_load_curve_chart",
    "expert_timeline_chart",
    "head_grid_frame",
    "head_metric_heatmap",
    "kv_whatif_heatmap",
    "layer_expert_heatmap",
    "layer_mismatch_chart",
    "load_heatmap",
    "load_shift_heatmap",
    "margin_quartile_chart",
    "path_chart",
    "position_heatmap",
    "repetition_chart",
    "router_score_heatmap",
    "routers_per_token_chart",
    "routers_strip_chart",
    "stack_scores",
    "token_label",
    "token_layer_scores_chart",
    "token_margin_chart",
    "token_options",
    "token_path_chart",
    "token_rank_path_chart",
    "token_strip_chart",
    "token_window",
    "transition_heatmaps",
]
