"""Exact attention maps and per-head summaries, computed on demand from a capture's queries and keys.

What is stored (all linear in T): per softmax-attention layer the post-RoPE queries [B, H, T, Dk] and keys
[B, Hkv, S, Dk] exactly as the model's attention function received them, the mask reduced to one allowed
key interval per query row (lo/hi [B, T]; causal, padding, sliding-window and chunked masks are all
intervals), `scaling`, optional soft-cap and GPT-OSS sink logits [H]. Query head h reads key head
h // (H / Hkv), as `repeat_kv` does.

Maps are recomputed as softmax(scaling · q kᵀ + mask) — with the sink logit as one more column that is then
dropped, as GPT-OSS's eager attention does — so a row, a block or a full [T, T] map is only built when
asked for. Summaries are one fused pass per layer over query blocks of all heads at once (`_layer_stats`:
each [H, rows, keys] block of scores is built once and yields every statistic; memory O(block), never
T × T), within 1e-6 of float64.

Not persisted: `Trace.to_parquet` does not store attention; a trace read back has `attention = None`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

SUMMARY_COLUMNS = [
    "layer",
    "head",
    "seq",
    "pos",
    "entropy",
    "mean_distance",
    "sink_mass",
    "local_mass",
    "learned_sink_mass",
]
_BLOCK_ELEMENTS = 1 << 21  # [H, rows, keys] scores per block of the streaming pass (8 MiB of fp32 per buffer)
_MAX_ROWS = 512  # query rows per block at most
_ROWS_DIVISOR = 2  # rows per block: the widest row's keys / 2 (a sliding window: blocks over ~1.5 W keys)
_EXP_FLOOR = -80.0  # shifted scores are clamped here: exp(-80) < 2e-35, and exp's underflow path is slow
# Precision of the streaming pass (torch dtype names), so that every statistic stays within 1e-6 of a
# float64 computation from the full map (tests/test_attention_exact.py). Scores q·kᵀ: float32 only where a
# probe of the layer shows its rounding moves the statistics by at most _FLOAT32_SCORE_TOLERANCE (small
# scores; on the trained samples, |s| ~ 30, a float32 q·kᵀ alone moves entropies by ~2.6e-6), else float64.
# exp and the sums over keys run in float32: ~5e-7 at most on the samples (mean_distance: relative).
_SCORE_DTYPE = "float64"
_FLOAT32_SCORE_TOLERANCE = 4e-7
_PROBE_ROWS = 16  # query rows per sequence the probe measures
_FLOAT32_SCORE_BOUND = 16.0  # scaling · max |q| · max |k| above this: float64 scores, no probe needed
_SUM_DTYPE = "float32"
_SUMMARY_STATS = ("entropy", "mean_distance", "sink_mass", "local_mass", "learned_sink_mass")
_STATS = ("mass", "entropy", "mean_distance", "sink_mass", "local_mass", "kept_mass", "learned_sink_mass")


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


def _linear_rows(spec: LinearAttentionLayer, head: int, seq: int, off: int, n: int, rows: np.ndarray):
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


@dataclass
class AttentionCapture:
    """Attention of one capture, computed lazily. `Trace.attention` holds one (None unless captured).

    - layers: layer index -> AttentionLayer (softmax-attention layers only)
    - no_map: layer index -> why that layer has no attention map (Mamba, unsupported linear attention, ...)
    - linear: layer index -> LinearAttentionLayer: exact attention-like maps of linear-attention layers
      (MiniMax lightning, Qwen3-Next DeltaNet, Kimi Linear KDA). `row/block/full` serve them too; they are
      not probabilities (rows need not sum to 1, entries may be negative), so summaries and the KV what-if
      skip them.
    - offsets [B], lengths [B]: column of position 0 and number of real tokens of each sequence
    - dtype_bytes: bytes per element of the model's KV cache; geometry: facts from `models.attention`

    Positions are token positions within a sequence (padding excluded), as in `Trace.tokens`.
    """

    layers: dict[int, AttentionLayer]
    no_map: dict[int, str]
    offsets: np.ndarray
    lengths: np.ndarray
    dtype_bytes: int = 4
    geometry: dict[str, Any] = field(default_factory=dict)
    linear: dict[int, LinearAttentionLayer] = field(default_factory=dict)
    _cache: dict[tuple, dict[int, dict[str, np.ndarray]]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __eq__(self, other: object) -> bool:  # identity: comparing arrays elementwise is not meaningful
        return self is other

    # ---- lookup ------------------------------------------------------------------------------------
    @property
    def map_layers(self) -> list[int]:
        """Softmax-attention layers (probability maps; summaries and the KV what-if cover these)."""
        return sorted(self.layers)

    @property
    def linear_layers(self) -> list[int]:
        """Linear-attention layers with an exact attention-like map (`kind` "decay", "delta" or "kda")."""
        return sorted(self.linear)

    @property
    def nbytes(self) -> int:
        """Bytes held by the capture (queries, keys, intervals, linear q/k/v): grows linearly with tokens."""
        return sum(layer.nbytes for layer in (*self.layers.values(), *self.linear.values()))

    def has_map(self, layer: int) -> bool:
        return layer in self.layers or layer in self.linear

    def layer(self, layer: int) -> AttentionLayer | LinearAttentionLayer:
        if layer in self.layers:
            return self.layers[layer]
        if layer in self.linear:
            return self.linear[layer]
        if layer in self.no_map:
            raise KeyError(f"layer {layer} has no attention map: {self.no_map[layer]}")
        known = sorted(set(self.layers) | set(self.no_map) | set(self.linear))
        raise KeyError(f"no layer {layer} in this capture (layers {known[0]}..{known[-1]})")

    def _check(self, layer: int, head: int, seq: int) -> AttentionLayer | LinearAttentionLayer:
        spec = self.layer(layer)
        if not 0 <= head < spec.num_heads:
            raise IndexError(f"head {head} out of range: layer {layer} has {spec.num_heads} heads")
        if not 0 <= seq < len(self.lengths):
            raise IndexError(f"seq {seq} out of range: the capture has {len(self.lengths)} sequences")
        return spec

    def _positions(self, seq: int, which, what: str) -> np.ndarray:
        n = int(self.lengths[seq])
        if which is None:
            return np.arange(n)
        if isinstance(which, slice):
            return np.arange(n)[which]
        pos = np.atleast_1d(np.asarray(which, dtype=np.int64))
        if pos.size and (pos.min() < 0 or pos.max() >= n):
            raise IndexError(f"{what} position out of range: sequence {seq} has {n} tokens")
        return pos

    # ---- maps ----------------------------------------------------------------------------------------
    def _rows(
        self, spec: AttentionLayer, head: int, seq: int, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Attention of query positions `rows` over every key position of the sequence, in float64.

        Returns (probs [R, L], learned sink mass [R]); probs exclude the sink, as eager maps do. Linear
        layers: (attention-like map [R, L], zeros [R]).
        """
        import torch

        off, n = int(self.offsets[seq]), int(self.lengths[seq])
        if isinstance(spec, LinearAttentionLayer):
            return _linear_rows(spec, head, seq, off, n, rows), np.zeros(len(rows))
        cols = off + rows
        q = torch.from_numpy(spec.query[seq, head, cols]).double()  # [R, Dk]
        k = torch.from_numpy(spec.key[seq, spec.kv_head(head), off : off + n]).double()  # [L, Dk]
        scores = (q @ k.T) * spec.scaling
        if spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
        key_cols = torch.arange(off, off + n)
        lo = torch.from_numpy(spec.lo[seq, cols])[:, None]
        hi = torch.from_numpy(spec.hi[seq, cols])[:, None]
        allowed = (key_cols[None, :] >= lo) & (key_cols[None, :] <= hi)
        scores = scores.masked_fill(~allowed, -math.inf)
        m = scores.amax(-1)
        sink = None
        if spec.sinks is not None:
            sink = torch.full_like(m, float(spec.sinks[head]))
            m = torch.maximum(m, sink)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(scores - m[:, None])
        z = e.sum(-1)
        sink_e = torch.exp(sink - m) if sink is not None else torch.zeros_like(z)
        z = z + sink_e
        z = torch.where(z > 0, z, torch.ones_like(z))
        return (e / z[:, None]).numpy(), (sink_e / z).numpy()

    def row(self, layer: int, head: int, seq: int, pos: int) -> np.ndarray:
        """[L] attention of the token at `pos` over the L key positions of its sequence (0 where masked).
        Linear layers: the exact attention-like row (not a probability; see `LinearAttentionLayer`)."""
        spec = self._check(layer, head, seq)
        return self._rows(spec, head, seq, self._positions(seq, pos, "query"))[0][0]

    def block(self, layer: int, head: int, seq: int, rows=None, cols=None) -> np.ndarray:
        """[R, C] block of the map: query positions `rows`, key positions `cols` (slices, lists or None for
        all). Rows are normalised over all keys, so a block equals the same cells of the full map."""
        spec = self._check(layer, head, seq)
        probs, _ = self._rows(spec, head, seq, self._positions(seq, rows, "query"))
        return probs[:, self._positions(seq, cols, "key")]

    def full(self, layer: int, head: int, seq: int) -> np.ndarray:
        """[L, L] map of one head over one sequence: quadratic, for short sequences or on request only."""
        return self.block(layer, head, seq)

    def learned_sink_mass(self, layer: int, head: int, seq: int, rows=None) -> np.ndarray:
        """[R] mass each query gives the learned sink (GPT-OSS `sinks`; eager maps drop it). 0 elsewhere."""
        spec = self._check(layer, head, seq)
        return self._rows(spec, head, seq, self._positions(seq, rows, "query"))[1]

    def linear_output(self, layer: int, seq: int) -> np.ndarray:
        """[H, L, Dv] Σ_j A[t, j] v_j of a linear layer from its map and recorded values: equals the layer's
        own attention output (before norm, gate and output projection) of the sequence's real tokens."""
        spec = self.layer(layer)
        if not isinstance(spec, LinearAttentionLayer):
            raise KeyError(f"layer {layer} is a softmax-attention layer; linear_output is for linear layers")
        off, n = int(self.offsets[seq]), int(self.lengths[seq])
        rows = np.arange(n)
        return np.stack(
            [
                _linear_rows(spec, h, seq, off, n, rows)
                @ spec.value[seq, h, off : off + n].astype(np.float64)
                for h in range(spec.num_heads)
            ]
        )

    # ---- streaming summaries ------------------------------------------------------------------------
    def _pass(
        self, layer: int, window: int, global_tokens: int, geometry: dict | None = None
    ) -> dict[str, np.ndarray]:
        """Per-token statistics of every head of one layer, streamed over query blocks.

        Returns arrays [B, H, T] (query columns): mass (on real keys), entropy, mean_distance, sink_mass,
        local_mass (0 <= i - j < window), kept_mass (local or j < global_tokens), learned_sink_mass.
        One fused pass over the layer (`_layer_stats`); cached per (layer, window, global_tokens). Callers
        that pass several layers share one `geometry` (the blocks' masks and weights, the same for every
        layer with the same intervals: built once instead of once per layer).
        """
        key = (layer, window, global_tokens)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        out = _layer_stats(self.layer(layer), self.offsets, window, global_tokens, geometry)
        with self._lock:
            self._cache[key] = out
        return out

    def summaries(self, window: int = 32, layers: list[int] | None = None) -> pd.DataFrame:
        """Tidy per-token head summaries: one row per (layer, head, seq, pos) of every real token.

        entropy (nats) of the attention row; mean_distance = Σ p_j (i − j) / Σ p_j; sink_mass = attention
        on position 0; local_mass = attention on keys with 0 <= i − j < `window`; learned_sink_mass = the
        GPT-OSS sink's share (not part of the map). Linear memory: no T × T map is built.
        """
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        layers, geometry = self._layers_arg(layers), {}
        stats = [self._pass(layer, window, 0, geometry) for layer in layers]
        return self._frame(layers, stats, _SUMMARY_STATS)

    def head_summary(self, window: int = 32) -> pd.DataFrame:
        """One row per (layer, head): mean entropy, mean distance, sink and local mass over real tokens, and a
        `kind` label for the head grid: "sink" (mean sink mass > 0.5), "local" (local mass > 0.5) or
        "global". Linear-attention layers with an attention-like map are listed once (head -1) with kind
        "linear" (no probability statistics); layers without a map with kind "no map" and their reason."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        means: dict[str, list[np.ndarray]] = {name: [] for name in _SUMMARY_STATS}  # per layer: [H]
        geometry: dict = {}
        for layer in self.map_layers:  # means over real tokens, without building the per-token frame
            stats = self._pass(layer, window, 0, geometry)
            for name, per_layer in means.items():
                real = [stats[name][b, :, off : off + n] for b, (off, n) in self._seqs()]
                per_layer.append(np.concatenate(real, axis=1).mean(axis=1))
        heads = [self.layers[layer].num_heads for layer in self.map_layers]
        grid = pd.DataFrame(
            {
                "layer": np.repeat(np.array(self.map_layers, dtype=np.int64), heads),
                "head": np.concatenate([np.arange(h) for h in heads]) if heads else np.zeros(0, np.int64),
                **{f"mean_{name}": np.concatenate(v) if v else np.zeros(0) for name, v in means.items()},
            }
        )
        grid["kind"] = np.where(
            grid["mean_sink_mass"] > 0.5, "sink", np.where(grid["mean_local_mass"] > 0.5, "local", "global")
        )
        grid["reason"] = ""
        linear = pd.DataFrame(
            {
                "layer": self.linear_layers,
                "head": -1,
                "kind": "linear",
                "reason": [
                    f"{self.linear[i].kind} linear attention: exact attention-like map (row/block/full), "
                    "not softmax probabilities"
                    for i in self.linear_layers
                ],
            }
        )
        if len(linear):
            grid = pd.concat([grid, linear], ignore_index=True)
        missing = pd.DataFrame(
            {"layer": list(self.no_map), "head": -1, "kind": "no map", "reason": list(self.no_map.values())}
        )
        if len(missing):
            grid = pd.concat([grid, missing], ignore_index=True)
        return grid.sort_values(["layer", "head"], ignore_index=True)

    # ---- KV cache what-if ---------------------------------------------------------------------------
    def kv_cache_bytes_per_token(self) -> pd.DataFrame:
        """KV-cache bytes one token costs, per layer, for the captured geometry and the model's dtype.

        Softmax layers: 2 (K and V) · Hkv · head dim · dtype bytes (keys use Dk, values Dv). MLA models also
        get `mla_latent_bytes` = (kv_lora_rank + qk_rope_head_dim) · dtype bytes, what DeepSeek-style engines
        cache instead. Linear/Mamba layers keep a fixed-size state: 0 bytes per token. Sliding-window layers
        cost the same per token but stop growing at the window (`capped_at`).
        """
        rows = []
        latent = self.geometry.get("mla_latent_dim")
        for layer in sorted(set(self.layers) | set(self.no_map) | set(self.linear)):
            if layer in self.layers:
                spec = self.layers[layer]
                hf = spec.num_kv_heads * (spec.head_dim + spec.value_dim) * self.dtype_bytes
                rows.append(
                    {
                        "layer": layer,
                        "kind": "softmax",
                        "kv_heads": spec.num_kv_heads,
                        "key_dim": spec.head_dim,
                        "value_dim": spec.value_dim,
                        "bytes_per_token": hf,
                        "mla_latent_bytes": None if latent is None else latent * self.dtype_bytes,
                        "capped_at": spec.sliding_window,
                    }
                )
            elif layer in self.linear:
                rows.append({"layer": layer, "kind": "linear (state)", "bytes_per_token": 0})
            else:
                rows.append({"layer": layer, "kind": "no map (state)", "bytes_per_token": 0})
        return pd.DataFrame(rows)

    def kv_cache_tokens(
        self, layer: int, tokens: int, window: int | None = None, global_tokens: int = 0
    ) -> int:
        """Tokens softmax layer `layer` keeps in its KV cache after `tokens` tokens: all of them, or at most
        its own sliding window (min(sliding_window, T)); with a what-if `window`, at most that many plus
        `global_tokens` on top. Never more than the full cache (the what-if only takes away)."""
        cap = self.layers[layer].sliding_window
        full = tokens if cap is None else min(tokens, int(cap))
        return full if window is None else min(full, window + global_tokens)

    def kv_cache_bytes(self, tokens: int, window: int | None = None, global_tokens: int = 0) -> int:
        """Bytes of the whole KV cache after `tokens` tokens: Σ over softmax layers of bytes per token
        (`kv_cache_bytes_per_token`: Hkv · (Dk + Dv) · dtype bytes, i.e. 2 · Hkv · head dim · dtype bytes when
        Dk = Dv) · the tokens that layer keeps (`kv_cache_tokens`: T, or min(sliding_window, T) for
        sliding-window layers, capped further at window + global_tokens for a what-if). Linear/Mamba layers
        keep a fixed-size state and are not counted."""
        per_layer = self.kv_cache_bytes_per_token().set_index("layer")["bytes_per_token"]
        return sum(
            int(per_layer[layer]) * self.kv_cache_tokens(layer, tokens, window, global_tokens)
            for layer in self.layers
        )

    def kv_cache_whatif(self, window: int, global_tokens: int = 0) -> pd.DataFrame:
        """Attention mass each head would lose if it kept only the last `window` keys (0 <= i − j < window)
        plus the first `global_tokens` positions. One row per (layer, head): mean_lost, max_lost and p95_lost
        over real tokens, plus the KV bytes per token of the layer and, at the longest captured length T,
        what that layer's cache holds (`full_cache_bytes`: T tokens, or min(sliding_window, T) for a
        sliding-window layer) and would hold (`whatif_cache_bytes`: at most window + global_tokens of those,
        never more than the full cache). The byte columns repeat on every head row of a layer: sum one row per
        layer for the model's total. Computed in linear memory from the capture."""
        if window < 1 or global_tokens < 0:
            raise ValueError("window must be >= 1 and global_tokens >= 0")
        per_layer = self.kv_cache_bytes_per_token().set_index("layer")["bytes_per_token"]
        longest = int(self.lengths.max()) if len(self.lengths) else 0
        rows, geometry = [], {}
        for layer in self.map_layers:
            full_tokens = self.kv_cache_tokens(layer, longest)
            kept_tokens = self.kv_cache_tokens(layer, longest, window, global_tokens)
            stats = self._pass(layer, window, global_tokens, geometry)
            lost = np.clip(stats["mass"] - stats["kept_mass"], 0.0, None)
            for head in range(self.layers[layer].num_heads):
                values = np.concatenate([lost[b, head, off : off + n] for b, (off, n) in self._seqs()])
                rows.append(
                    {
                        "layer": layer,
                        "head": head,
                        "mean_lost": float(values.mean()),
                        "p95_lost": float(np.quantile(values, 0.95)),
                        "max_lost": float(values.max()),
                        "bytes_per_token": int(per_layer[layer]),
                        "full_cache_bytes": int(per_layer[layer]) * full_tokens,
                        "whatif_cache_bytes": int(per_layer[layer]) * kept_tokens,
                    }
                )
        return pd.DataFrame(rows)

    # ---- helpers ------------------------------------------------------------------------------------
    def _layers_arg(self, layers: list[int] | None) -> list[int]:
        if layers is None:
            return self.map_layers
        for layer in layers:
            self.layer(layer)  # raises with the reason for layers without a map
            if layer in self.linear:
                raise ValueError(
                    f"layer {layer} is a linear-attention layer: its map is attention-like, not a "
                    "probability distribution, so entropy/mass summaries are not defined"
                )
        return list(layers)

    def _seqs(self):
        return enumerate(zip(self.offsets.tolist(), self.lengths.tolist(), strict=True))

    def _frame(
        self, layers: list[int], stats: list[dict[str, np.ndarray]], names: tuple[str, ...]
    ) -> pd.DataFrame:
        """The tidy frame of `layers`' per-token statistics (one `_pass` result each): built from numpy
        columns at once (one DataFrame, no concatenation of per-layer frames)."""
        columns: dict[str, list[np.ndarray]] = {c: [] for c in ("layer", "head", "seq", "pos", *names)}
        for layer, layer_stats in zip(layers, stats, strict=True):
            h_n = self.layers[layer].num_heads
            for b, (off, n) in self._seqs():
                columns["layer"].append(np.full(h_n * n, layer, dtype=np.int64))
                columns["head"].append(np.repeat(np.arange(h_n, dtype=np.int64), n))
                columns["seq"].append(np.full(h_n * n, b, dtype=np.int64))
                columns["pos"].append(np.tile(np.arange(n, dtype=np.int64), h_n))
                for name in names:
                    columns[name].append(
                        layer_stats[name][b, :, off : off + n].reshape(-1).astype(np.float32)
                    )
        empty = {
            c: np.zeros(0, np.int64 if c in ("layer", "head", "seq", "pos") else np.float32) for c in columns
        }
        return pd.DataFrame({c: np.concatenate(parts) if parts else empty[c] for c, parts in columns.items()})


def _key_span(lo, hi, start: int, stop: int) -> int:
    """Keys the query rows start:stop attend to, from the first to the last (rows without keys ignored)."""
    lo, hi = lo[start:stop], hi[start:stop]
    real = hi >= lo
    if not bool(real.any()):
        return 1
    return int(hi[real].max()) - int(lo[real].min()) + 1


def _blocks(lo: np.ndarray, hi: np.ndarray, heads: int):
    """Query blocks (start, stop, first key, last key + 1) of one sequence for the streaming pass.

    A block's keys span from its rows' first allowed key to their last, so rows per block follow the widest
    row: about half of it (a sliding window of W keys gives blocks of W/2 rows over 1.5 W keys, not rows over
    all T keys), at most `_MAX_ROWS`, and halved while [heads, rows, keys] exceeds `_BLOCK_ELEMENTS` (one row
    at least). Blocks of padding rows only are skipped.
    """
    real = hi >= lo
    if not bool(real.any()):
        return
    widest = int((hi - lo + 1)[real].max())
    rows = max(1, min(_MAX_ROWS, widest // _ROWS_DIVISOR))
    start, t_n = 0, len(lo)
    while start < t_n:
        stop = min(t_n, start + rows)
        while stop - start > 1 and heads * (stop - start) * _key_span(lo, hi, start, stop) > _BLOCK_ELEMENTS:
            stop = start + (stop - start) // 2
        block_real = real[start:stop]
        if bool(block_real.any()):
            yield (
                start,
                stop,
                int(lo[start:stop][block_real].min()),
                int(hi[start:stop][block_real].max()) + 1,
            )
        start = stop


def _dtypes():
    import torch

    return getattr(torch, _SCORE_DTYPE), getattr(torch, _SUM_DTYPE)


def _buffer(pool: dict, name: str, shape: tuple[int, ...], dtype):
    """A view of `shape` on a scratch buffer reused across blocks (grown when a block needs more): fresh
    large allocations page-fault on every block, which costs more than the arithmetic."""
    import torch

    size = math.prod(shape)
    flat = pool.get(name)
    if flat is None or flat.numel() < size:
        flat = pool[name] = torch.empty(size, dtype=dtype)
    return flat[:size].view(shape)


def _block_weights(
    geometry: dict, lo, hi, start: int, stop: int, k0: int, k1: int, off, window, global_tokens, score_dtype
) -> dict:
    """Masks and weights of one block, shared by every block of the same shape relative to its keys (all
    steady-state blocks of a sliding-window sequence):

    - bias [R, K]: 0 allowed, -inf blocked (None when nothing is blocked); empty [R]: rows without keys
    - distance [R, K]: i − j where allowed, else 0
    - local: (first, last, [R, last − first]) the key columns of the band 0 <= i − j < window, 1 where
      local and allowed; extra: the same for global keys (position < global_tokens) outside the band
    - pos0 [R]: 1 where position 0 is an allowed key of the row, None when the block does not reach it
    """
    import torch

    rows, keys = stop - start, k1 - k0
    rel_lo, rel_hi = lo[start:stop] - k0, hi[start:stop] - k0
    sink_col = off - k0
    global_end = min(max(sink_col + global_tokens, 0), keys)
    key = (start - k0, keys, rel_lo.tobytes(), rel_hi.tobytes(), sink_col if 0 <= sink_col < keys else None)
    key += (global_end, window, score_dtype)
    found = geometry.get(key)
    if found is not None:
        return found
    f32 = torch.float32
    cols = torch.arange(keys, dtype=f32)
    allowed = (cols >= torch.from_numpy(rel_lo).to(f32)[:, None]) & (
        cols <= torch.from_numpy(rel_hi).to(f32)[:, None]
    )
    distance = (
        torch.arange(start - k0, stop - k0, dtype=f32)[:, None] - cols
    )  # i − j (columns = pos + offset)
    first, last = min(max(start - k0 - window + 1, 0), keys), min(max(stop - k0, 0), keys)
    band = distance[:, first:last]
    local = ((band >= 0) & (band < window) & allowed[:, first:last]).to(f32)
    extra = None
    if global_end:
        extra = (
            allowed[:, :global_end] & ((distance[:, :global_end] < 0) | (distance[:, :global_end] >= window))
        ).to(f32)
    empty = rel_hi < rel_lo
    all_allowed = bool((rel_lo <= 0).all() and (rel_hi >= keys - 1).all())
    found = {
        "bias": None
        if all_allowed
        else torch.full((rows, keys), -math.inf, dtype=score_dtype).masked_fill_(allowed, 0.0),
        "empty": torch.from_numpy(empty) if empty.any() else None,
        "distance": distance.mul_(allowed),
        "local": (first, last, local),
        "extra": (0, global_end, extra) if global_end else None,
        "pos0": allowed[:, sink_col].to(f32) if 0 <= sink_col < keys else None,
    }
    # Kept for reuse up to 2 · _BLOCK_ELEMENTS cells in all (causal blocks all differ: bounded memory).
    cells = geometry.get("cells", 0) + rows * keys
    if cells <= 2 * _BLOCK_ELEMENTS:
        geometry[key] = found
        geometry["cells"] = cells
    return found


def _float32_scores_suffice(spec: AttentionLayer) -> bool:
    """Whether computing this layer's scores q·kᵀ in float32 keeps every statistic within
    `_FLOAT32_SCORE_TOLERANCE` of a float64 computation, measured on a probe of `_PROBE_ROWS` query rows
    per sequence spread over it (all heads, all their allowed keys): the first-order change of the
    statistics under the score errors δs = s32 − s64, with p the float64 map and δ̄ = Σ p δs:
    total variation Σ p |δs − δ̄| (bounds every mass), Σ p |δs − δ̄| |log p + 1| (entropy) and
    Σ p |δs − δ̄| |i − j| / mass relative to max(1, mean distance). Large scores (trained models: |s| ~ 30)
    fail it, small ones (random weights) pass."""
    import torch

    bound = (
        spec.scaling
        * float(torch.linalg.vector_norm(torch.from_numpy(spec.query), dim=-1).max())
        * float(torch.linalg.vector_norm(torch.from_numpy(spec.key), dim=-1).max())
    )
    if bound > _FLOAT32_SCORE_BOUND:  # |s| may reach it (Cauchy-Schwarz): float64 without probing
        return False
    b_n, h_n, _, dim = spec.query.shape
    groups = h_n // spec.num_kv_heads
    worst = 0.0
    for b in range(b_n):
        real = np.flatnonzero(spec.hi[b] >= spec.lo[b])
        if not len(real):
            continue
        rows = real[np.linspace(0, len(real) - 1, min(_PROBE_ROWS, len(real))).astype(np.int64)]
        lo, hi = spec.lo[b, rows], spec.hi[b, rows]
        k0, k1 = int(lo.min()), int(hi.max()) + 1
        q = torch.from_numpy(spec.query[b][:, rows])  # [H, P, D]
        k = torch.from_numpy(spec.key[b][:, k0:k1])  # [Hkv, K, D]
        n = len(rows)
        scores = []
        for dtype in (torch.float32, torch.float64):
            s = torch.matmul(
                (q.to(dtype) * spec.scaling).reshape(-1, groups * n, dim), k.to(dtype).transpose(1, 2)
            )
            s = s.reshape(h_n, n, -1).double()
            if spec.softcap is not None:
                s = torch.tanh(s / spec.softcap) * spec.softcap
            scores.append(s)
        cols = torch.arange(k0, k1)
        allowed = (cols >= torch.from_numpy(lo)[:, None]) & (cols <= torch.from_numpy(hi)[:, None])
        logits = scores[1].masked_fill(~allowed, -math.inf)
        if spec.sinks is not None:
            sink = torch.from_numpy(spec.sinks).double()[:, None, None].expand(h_n, n, 1)
            p = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
        else:
            p = torch.softmax(logits, -1)
        delta = (scores[0] - scores[1]).masked_fill(~allowed, 0.0)
        change = p * (delta - (p * delta).sum(-1, keepdim=True)).abs()  # |δp| to first order
        mass = p.sum(-1).clamp_min(1e-300)
        distance = (torch.from_numpy(rows)[:, None] - cols).abs().double()
        mean_distance = (p * distance).sum(-1) / mass
        log_p = torch.log(p.clamp_min(1e-300))
        bounds = (
            change.sum(-1),
            (change * (log_p + 1).abs()).sum(-1),
            (change * distance).sum(-1) / mass / mean_distance.clamp_min(1.0),
        )
        worst = max(worst, *(float(x.max()) for x in bounds))
    return worst <= _FLOAT32_SCORE_TOLERANCE


def _layer_stats(
    spec: AttentionLayer, offsets: np.ndarray, window: int, global_tokens: int, geometry: dict | None = None
) -> dict[str, np.ndarray]:
    """All per-token statistics of all heads of one softmax layer in one streaming pass (see `_pass`).

    Per query block, all heads at once: the scores [H, R, K] are computed once (one matmul per KV head: the
    query heads of a group share it, no GQA expansion), shifted by the row maximum and exponentiated into a
    second buffer e; every statistic is then one multiply-and-sum of e with the shifted scores or with an
    [R, K] weight (key distance, local band, kept keys; built once per block shape), and the [H, R] sums are
    combined in float64. Scores are computed and shifted in float32 where `_float32_scores_suffice`, else in
    `_SCORE_DTYPE`; exp and sums run in `_SUM_DTYPE` (see there for the precision each needs). Shifted
    scores are clamped at `_EXP_FLOOR` (exp < 2e-35, far below the resolution of a row sum >= 1) so exp
    never takes its slow underflow path; blocked keys carry -inf before the row maximum and zero weight in
    every masked sum. Memory: a few [H, R, K] buffers of about `_BLOCK_ELEMENTS` each, never [T, T].
    """
    import torch

    score_dtype, sum_dtype = _dtypes()
    if score_dtype == torch.float64 and _float32_scores_suffice(spec):
        score_dtype = torch.float32
    b_n, h_n, t_n, dim = spec.query.shape
    groups = h_n // spec.num_kv_heads
    raw = np.zeros((6, b_n, h_n, t_n), dtype=np.float64)  # per row: the sums over keys `_combine` needs
    row_max = None if spec.sinks is None else np.zeros((b_n, h_n, t_n), dtype=np.float64)
    query = torch.from_numpy(spec.query)
    sinks = None if spec.sinks is None else torch.from_numpy(spec.sinks).to(score_dtype)[:, None, None]
    pool: dict = {}
    geometry = {} if geometry is None else geometry  # one per (window, global_tokens): see _block_weights
    for b in range(b_n):
        off = int(offsets[b])
        lo_b, hi_b = spec.lo[b], spec.hi[b]
        key = torch.from_numpy(spec.key[b]).to(score_dtype)  # [Hkv, S, D]
        plan = ("blocks", lo_b.tobytes(), hi_b.tobytes(), h_n)  # layers with the same intervals share it
        if plan not in geometry:
            geometry[plan] = list(_blocks(lo_b, hi_b, h_n))
        for start, stop, k0, k1 in geometry[plan]:
            rows, keys = stop - start, k1 - k0
            w = _block_weights(
                geometry, lo_b, hi_b, start, stop, k0, k1, off, window, global_tokens, score_dtype
            )
            q = _buffer(pool, "q", (h_n, rows, dim), score_dtype)
            q.copy_(query[b, :, start:stop]).mul_(spec.scaling)
            s = _buffer(pool, "s", (h_n, rows, keys), score_dtype)
            torch.matmul(
                q.view(-1, groups * rows, dim),
                key[:, k0:k1].transpose(1, 2),
                out=s.view(-1, groups * rows, keys),
            )
            if spec.softcap is not None:
                s.div_(spec.softcap).tanh_().mul_(spec.softcap)
            if w["bias"] is not None:
                s.add_(w["bias"])
            m = s.amax(-1, keepdim=True)  # [H, R, 1]
            if sinks is not None:
                m = torch.maximum(m, sinks)
            if w["empty"] is not None:
                m.masked_fill_(w["empty"][None, :, None], 0.0)
            s.sub_(m).clamp_min_(_EXP_FLOOR)
            if sum_dtype != score_dtype:
                s = _buffer(pool, "s_low", (h_n, rows, keys), sum_dtype).copy_(s)
            e = _buffer(pool, "e", (h_n, rows, keys), sum_dtype)
            torch.exp(s, out=e)
            tmp = _buffer(pool, "t", (h_n, rows, keys), sum_dtype)
            sums = [
                e.sum(-1),  # Σ e
                torch.mul(e, s, out=tmp).sum(-1),  # Σ e·(s − m)
                torch.mul(e, w["distance"], out=tmp).sum(-1),  # Σ e·(i − j)
            ]
            for part in ("local", "extra"):  # Σ e over the local band, and over global keys outside it
                if w[part] is None:
                    sums.append(torch.zeros_like(sums[0]))
                    continue
                first, last, weight = w[part]
                band = _buffer(pool, "t", (h_n, rows, last - first), sum_dtype)
                sums.append(torch.mul(e[:, :, first:last], weight, out=band).sum(-1))
            sums.append(e[:, :, off - k0] * w["pos0"] if w["pos0"] is not None else torch.zeros_like(sums[0]))
            raw[:, b, :, start:stop] = torch.stack(sums).numpy()  # float32 sums into the float64 array
            if sinks is not None:
                row_max[b, :, start:stop] = m[..., 0].numpy()
    return _combine(raw, row_max, spec, spec.hi < spec.lo)


def _combine(
    raw: np.ndarray, row_max: np.ndarray | None, spec: AttentionLayer, empty: np.ndarray
) -> dict[str, np.ndarray]:
    """The statistics from a layer's raw sums over keys (`_layer_stats`), in float64 for all rows at once.

    raw [6, B, H, T]: Σ e, Σ e·(s − m), Σ e·(i − j), Σ e over the local band, over global keys outside it,
    e at position 0; row_max [B, H, T]: the m each row was shifted by (for the learned sink's e = exp(sink −
    m)), None without sinks; empty [B, T]: rows without keys (padding), whose statistics are all 0."""
    mass_e, ent_e, dist_e, local_e, extra_e, pos0_e = raw
    sink_e = None if row_max is None else np.exp(spec.sinks.astype(np.float64)[None, :, None] - row_max)
    z = mass_e if sink_e is None else mass_e + sink_e  # >= 1 on rows with keys
    z = np.where(z > 0, z, 1.0)
    mass = mass_e / z
    values = (
        mass,
        np.log(z) * mass - ent_e / z,  # entropy
        dist_e / np.where(mass_e > 0, mass_e, 1.0),  # mean distance
        pos0_e / z,  # sink mass
        local_e / z,  # local mass
        (local_e + extra_e) / z,  # kept mass
        np.zeros_like(z) if sink_e is None else sink_e / z,  # learned sink mass
    )
    stats = dict(zip(_STATS, values, strict=True))
    for array in stats.values():
        array[np.broadcast_to(empty[:, None, :], array.shape)] = 0.0
    return stats
