"""The per-layer records of an attention capture: what one softmax or linear-attention layer received.

`AttentionLayer` holds a softmax layer's post-RoPE queries and keys and its mask as one allowed key interval
per query row; `LinearAttentionLayer` holds the kernel inputs an exact attention-like map of a linear layer
is rebuilt from. Plain numpy: `moeviz.capture.attention_build` fills them, `AttentionCapture` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class AttentionLayer:
    """One softmax-attention layer of a capture.

    query [B, H, T, Dk], key [B, Hkv, S, Dk] (fp32), lo/hi [B, T] inclusive allowed key columns per query
    column (hi < lo: none), sinks [H] learned sink logits (GPT-OSS) or None.
    """

    layer: int
    module: str
    query: np.ndarray
    key: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    scaling: float
    value_dim: int
    sinks: np.ndarray | None = None
    softcap: float | None = None
    sliding_window: int | None = None
    implementation: str = "sdpa"

    def __post_init__(self) -> None:
        b, h, t, d = self.query.shape
        if self.key.ndim != 4 or self.key.shape[0] != b or self.key.shape[3] != d or h % self.key.shape[1]:
            raise ValueError(
                f"layer {self.layer}: key {list(self.key.shape)} does not fit query [{b},{h},{t},{d}]"
            )
        if self.lo.shape != (b, t) or self.hi.shape != (b, t):
            raise ValueError(
                f"layer {self.layer}: mask intervals must be [{b}, {t}], got {list(self.lo.shape)}"
            )

    @property
    def num_heads(self) -> int:
        return int(self.query.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.key.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.query.shape[3])

    def kv_head(self, head: int) -> int:
        """The key/value head a query head reads (grouped-query attention)."""
        return head // (self.num_heads // self.num_kv_heads)

    @property
    def nbytes(self) -> int:
        return int(self.query.nbytes + self.key.nbytes + self.lo.nbytes + self.hi.nbytes)


@dataclass
class LinearAttentionLayer:
    """One linear-attention layer with an exact *attention-like* map (not softmax probabilities).

    query/key [B, H, T, Dk], value [B, H, T, Dv], log_decay [B, H, T] (log of the per-step state decay) or
    [B, H, T, Dk] (kind "kda": one decay per key channel), beta [B, H, T] (delta rule write strength) or None,
    all fp32 as the layer's kernel used them. The map
    A [T, T] is lower-triangular and satisfies o_t = Σ_j A[t, j] v_j exactly, where o is the layer's
    attention output before its norm / gate / output projection (see `moeviz.models.attention`):

    - kind "decay" (MiniMax lightning attention): A[t, j] = (q_t · k_j) · exp(L_t − L_j),
      L = cumsum(log_decay)
    - kind "delta" (Qwen3-Next gated DeltaNet): A[t, j] = β_j k_j · r_j with r_t = q_t,
      r_{j−1} = exp(g_j) (r_j − β_j k_j (k_j · r_j)) — the delta rule's state updates unrolled.
    - kind "kda" (Kimi Linear KDA): the same with a per-channel gate g_j [Dk],
      r_{j−1} = exp(g_j) ⊙ (r_j − β_j k_j (k_j · r_j)), from S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1}
      + β_t k_t v_tᵀ. For both delta kinds q, k, v are the kernel's inputs (after the short convolution).

    Entries may be negative and rows need not sum to 1.
    """

    layer: int
    module: str
    kind: str
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    log_decay: np.ndarray
    beta: np.ndarray | None = None

    @property
    def num_heads(self) -> int:
        return int(self.query.shape[1])

    @property
    def value_dim(self) -> int:
        return int(self.value.shape[3])

    @property
    def nbytes(self) -> int:
        extra = 0 if self.beta is None else self.beta.nbytes
        return int(self.query.nbytes + self.key.nbytes + self.value.nbytes + self.log_decay.nbytes + extra)
