"""Exact attention-like maps of linear-attention layers, rebuilt from the kernel inputs a capture kept.

Not softmax probabilities: the rows A[t, :] satisfy o_t = Σ_j A[t, j] v_j for the layer's own output o (see
`LinearAttentionLayer` for each kind's formula); entries may be negative and rows need not sum to 1.
"""

from __future__ import annotations

import numpy as np

from moeviz.attention.layers import LinearAttentionLayer


def linear_rows(spec: LinearAttentionLayer, head: int, seq: int, off: int, n: int, rows: np.ndarray):
    """[R, n] float64 attention-like map of query positions `rows` over the sequence's n real keys."""
    import torch

    cols = slice(off, off + n)
    q = torch.from_numpy(spec.query[seq, head, cols]).double()  # [n, Dk]
    k = torch.from_numpy(spec.key[seq, head, cols]).double()
    g = torch.from_numpy(spec.log_decay[seq, head, cols]).double()  # [n], or [n, Dk] for "kda"
    rows_t = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    out = torch.zeros(len(rows_t), n, dtype=torch.float64)
    if not len(rows_t):
        return out.numpy()
    if spec.kind == "decay":
        cum = torch.cumsum(g, 0)
        scores = q[rows_t] @ k.T  # [R, n]
        delta = cum[rows_t][:, None] - cum[None, :]
        causal = torch.arange(n)[None, :] <= rows_t[:, None]
        return torch.where(causal, scores * torch.exp(delta.clamp(max=0.0)), 0.0).numpy()
    if spec.kind not in ("delta", "kda"):
        raise ValueError(f"unknown linear-attention kind {spec.kind!r}")
    assert spec.beta is not None  # "delta" and "kda" layers always record beta
    beta = torch.from_numpy(spec.beta[seq, head, cols]).double()
    decay = torch.exp(g)  # a per-channel gate ("kda") scales r elementwise, a scalar one uniformly
    r = torch.zeros(len(rows_t), q.shape[1], dtype=torch.float64)
    for j in range(int(rows_t.max()), -1, -1):  # unroll the state updates backwards from each query row
        starting = rows_t == j
        if bool(starting.any()):
            r[starting] = q[j]
        dot = r @ k[j]  # [R]
        out[:, j] = beta[j] * dot
        r = decay[j] * (r - (beta[j] * dot)[:, None] * k[j][None, :])
    return out.numpy()
