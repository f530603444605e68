"""Expert load and the basic balance indicators (definitions: shared/docs/routing-metrics.md).

Loads count dispatched (token, expert) pairs; slots dropped by capacity (-1) count for no expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from moeviz.trace import LayerRouting, Trace


@dataclass(frozen=True)
class LoadStats:
    """Balance of one layer. `counts` [E]: tokens dispatched to each expert."""

    tokens: int
    counts: np.ndarray
    load_entropy: float  # H(f) / log E, 1 = perfectly uniform
    max_share: float  # max_e f_e, f_e = c_e / Σc (uniform = 1/E)
    dead_experts: int  # experts that received no token
    dropped: int  # slots dropped by capacity

    @property
    def num_experts(self) -> int:
        return len(self.counts)

    @property
    def dead_fraction(self) -> float:
        return self.dead_experts / self.num_experts


def expert_counts(routing: LayerRouting) -> np.ndarray:
    """Tokens dispatched to each expert [E] (a token counts once per expert it was sent to)."""
    experts = routing.experts[routing.experts >= 0]
    return np.bincount(experts, minlength=routing.num_experts).astype(np.int64)


def load_stats(routing: LayerRouting) -> LoadStats:
    counts = expert_counts(routing)
    total = counts.sum()
    shares = counts / total if total else np.zeros(len(counts))
    nonzero = shares[shares > 0]
    entropy = float(-(nonzero * np.log(nonzero)).sum())
    return LoadStats(
        tokens=len(routing.token_rows),
        counts=counts,
        load_entropy=entropy / np.log(len(counts)) if len(counts) > 1 else 1.0,
        max_share=float(shares.max()) if total else 0.0,
        dead_experts=int((counts == 0).sum()),
        dropped=int((routing.experts < 0).sum()),
    )


def layer_summary_frame(trace: Trace) -> pd.DataFrame:
    """One row per MoE layer: layer, site, tokens, experts, top_k, load_entropy, max_share, dead_experts,
    dropped."""
    rows = []
    for routing in trace.layers:
        stats = load_stats(routing)
        rows.append(
            {
                "layer": routing.layer,
                "site": routing.site,
                "tokens": stats.tokens,
                "experts": stats.num_experts,
                "top_k": routing.k,
                "load_entropy": stats.load_entropy,
                "max_share": stats.max_share,
                "dead_experts": stats.dead_experts,
                "dropped": stats.dropped,
            }
        )
    return pd.DataFrame(rows)


def expert_load_frame(trace: Trace) -> pd.DataFrame:
    """One row per (layer, site, expert): count, share (of dispatched slots) and utilisation
    (count / fair share; 1 = fair)."""
    parts = []
    for routing in trace.layers:
        counts = expert_counts(routing)
        total = counts.sum()
        e = routing.num_experts
        parts.append(
            pd.DataFrame(
                {
                    "layer": routing.layer,
                    "site": routing.site,
                    "expert": np.arange(e),
                    "count": counts,
                    "share": counts / total if total else 0.0,
                    "utilisation": counts / (total / e) if total else 0.0,
                }
            )
        )
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
