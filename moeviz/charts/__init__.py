"""Charts: one small pure function per view, a frame in, an `alt.Chart` out (no Streamlit, no torch)."""

from moeviz.charts.routing import expert_load_chart, router_score_heatmap, token_label, token_window

__all__ = ["expert_load_chart", "router_score_heatmap", "token_label", "token_window"]
