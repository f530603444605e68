"""Attention patterns per token: exact maps on demand and per-head summaries in linear memory.

Data objects only: `moeviz.capture.attention_build.build_attention` turns a capture's recorder into an
`AttentionCapture`; this package never imports `moeviz.capture` (see `[tool.importlinter]`). Modules:
`layers` (what one layer's capture holds), `maps` (`AttentionCapture`: rows, blocks, summary frames, KV-cache
sizes), `summaries` (the streaming statistics kernel), `linear` (linear-attention maps).
"""

from moeviz.attention.layers import AttentionLayer, LinearAttentionLayer
from moeviz.attention.maps import AttentionCapture
from moeviz.attention.summaries import SUMMARY_COLUMNS

__all__ = ["SUMMARY_COLUMNS", "AttentionCapture", "AttentionLayer", "LinearAttentionLayer"]
