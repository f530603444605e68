"""Attention patterns per token: exact maps on demand and per-head summaries in linear memory.

Data objects only: `moeviz.capture.attention_build.build_attention` turns a capture's recorder into an
`AttentionCapture`; this package never imports `moeviz.capture` (see `[tool.importlinter]`).
"""

from moeviz.attention.maps import SUMMARY_COLUMNS, AttentionCapture, AttentionLayer, LinearAttentionLayer

__all__ = ["SUMMARY_COLUMNS", "AttentionCapture", "AttentionLayer", "LinearAttentionLayer"]
