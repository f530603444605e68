"""Tables shaped for views: small pure pandas reshapes of library frames (no altair, no Streamlit)."""

from __future__ import annotations

import pandas as pd

from moeviz.charts.routing import _labelled


def stack_scores(frames: dict[tuple[str, int], pd.DataFrame]) -> pd.DataFrame:
    """`Trace.scores_frame(layer, site)` of several layers stacked, with columns site and layer added.

    Input: {(site, layer): scores frame}. Output: every input column plus site, layer; in key order.
    """
    parts = [frame.assign(site=site, layer=layer) for (site, layer), frame in frames.items()]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def token_options(tokens: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """Picker labels ("pos:token", or "seq/pos:token" over several sequences) → (seq, pos), in input order.

    Input: `Trace.tokens` (columns seq, pos, token).
    """
    labels = _labelled(tokens)
    return {label: (int(s), int(p)) for label, s, p in zip(labels, tokens["seq"], tokens["pos"], strict=True)}


def dead_hot_experts(expert_balance: pd.DataFrame, hot_factor: float = 2.5) -> pd.DataFrame:
    """Experts that got no token (dead) or more than `hot_factor` × their fair share (hot).

    Input: `moeviz.analysis.expert_balance_frame(trace)` (columns layer, site, expert, count, share,
    utilisation, dead). Output: site, layer, expert, status ("dead" | "hot"), count, share, utilisation;
    sorted by layer, then utilisation (hot first).
    """
    frame = expert_balance
    status = pd.Series("", index=frame.index, dtype=object)
    status[frame["utilisation"] > hot_factor] = "hot"
    status[frame["dead"]] = "dead"
    out = frame.assign(status=status)[status != ""]
    out = out[["site", "layer", "expert", "status", "count", "share", "utilisation"]]
    return out.sort_values(["site", "layer", "utilisation"], ascending=[True, True, False]).reset_index(
        drop=True
    )
