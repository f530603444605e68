"""Pure analysis functions over a Trace or its frames."""

from moeviz.analysis.load import expert_load_frame, layer_summary_frame, load_stats

__all__ = ["expert_load_frame", "layer_summary_frame", "load_stats"]
