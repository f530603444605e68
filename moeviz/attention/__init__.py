"""Attention patterns per token: exact maps on demand and per-head summaries in linear memory."""

from moeviz.attention.build import build_attention
from moeviz.attention.maps import SUMMARY_COLUMNS, AttentionCapture, AttentionLayer, LinearAttentionLayer

__all__ = ["SUMMARY_COLUMNS", "AttentionCapture", "AttentionLayer", "LinearAttentionLayer", "build_attention"]
