"""Exact attention maps and per-head summaries, computed on demand from a capture's queries and keys.

What is stored (all linear in T): per softmax-attention layer the post-RoPE queries [B, H, T, Dk] and keys
[B, Hkv, S, Dk] exactly as the model's attention function received them, the mask reduced to one allowed
key interval per query row (lo/hi [B, T]; causal, padding, sliding-window and chunked masks are all
intervals), `scaling`, optional soft-cap and GPT-OSS sink logits [H]. Query head h reads key head
h // (H / Hkv), as `repeat_kv` does.

Maps are recomputed as softmax(scaling · q kᵀ + mask) — with the sink logit as one more column that is then
dropped, as GPT-OSS's eager attention does — so a row, a block or a full [T, T] map is only built when
asked for. Summaries stream over query blocks (memory O(block · T), never T × T).

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
_BLOCK_ELEMENTS = 1 << 23  # [H, rows, keys] scores per step in the streaming pass (32 MiB of fp32)


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
    def _pass(self, layer: int, window: int, global_tokens: int) -> dict[str, np.ndarray]:
        """Per-token statistics of every head of one layer, streamed over query blocks.

        Returns arrays [B, H, T] (query columns): mass (on real keys), entropy, mean_distance, sink_mass,
        local_mass (0 <= i - j < window), kept_mass (local or j < global_tokens), learned_sink_mass.
        """
        key = (layer, window, global_tokens)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        import torch

        spec = self.layer(layer)
        b_n, h_n, t_n, _ = spec.query.shape
        heads = torch.tensor([spec.kv_head(h) for h in range(h_n)])
        names = (
            "mass",
            "entropy",
            "mean_distance",
            "sink_mass",
            "local_mass",
            "kept_mass",
            "learned_sink_mass",
        )
        out = {name: np.zeros((b_n, h_n, t_n), dtype=np.float64) for name in names}
        sinks = None if spec.sinks is None else torch.from_numpy(spec.sinks).float()[:, None]  # [H, 1]
        for b in range(b_n):
            off = int(self.offsets[b])
            q_all = torch.from_numpy(spec.query[b])  # [H, T, D]
            k_all = torch.from_numpy(spec.key[b])[heads]  # [H, S, D]: GQA heads expanded once per sequence
            lo_all, hi_all = torch.from_numpy(spec.lo[b]), torch.from_numpy(spec.hi[b])
            start = 0
            while start < t_n:
                # Rows per block so that [H, rows, keys] stays near _BLOCK_ELEMENTS; the keys a block needs
                # span from its rows' first key to their last (causal rows widen, sliding windows do not).
                rows = max(1, _BLOCK_ELEMENTS // max(1, h_n * _key_span(lo_all, hi_all, start, start + 1)))
                stop = min(t_n, start + rows)
                while stop - start > 1 and h_n * (stop - start) * _key_span(lo_all, hi_all, start, stop) > (
                    2 * _BLOCK_ELEMENTS
                ):
                    stop = start + (stop - start) // 2
                lo, hi = lo_all[start:stop], hi_all[start:stop]
                if not bool((hi >= lo).any()):  # padding only: no statistics to compute
                    start = stop
                    continue
                k0 = int(lo[hi >= lo].min())
                k1 = int(hi.max()) + 1
                stats = _block_stats(
                    q_all[:, start:stop],
                    k_all[:, k0:k1],
                    lo - k0,
                    hi - k0,
                    spec,
                    sinks,
                    query_cols=torch.arange(start, stop),
                    key_cols=torch.arange(k0, k1),
                    first_col=off,
                    window=window,
                    global_tokens=global_tokens,
                )
                for name, value in stats.items():
                    out[name][b, :, start:stop] = value.numpy()
                start = stop
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
        frames = []
        for layer in self._layers_arg(layers):
            stats = self._pass(layer, window, 0)
            frames.append(
                self._frame(
                    layer, stats, ("entropy", "mean_distance", "sink_mass", "local_mass", "learned_sink_mass")
                )
            )
        if not frames:
            return pd.DataFrame({c: [] for c in SUMMARY_COLUMNS})
        return pd.concat(frames, ignore_index=True)[SUMMARY_COLUMNS]

    def head_summary(self, window: int = 32) -> pd.DataFrame:
        """One row per (layer, head): mean entropy, mean distance, sink and local mass over real tokens, and a
        `kind` label for the head grid: "sink" (mean sink mass > 0.5), "local" (local mass > 0.5) or
        "global". Linear-attention layers with an attention-like map are listed once (head -1) with kind
        "linear" (no probability statistics); layers without a map with kind "no map" and their reason."""
        frame = self.summaries(window)
        grid = (
            frame.groupby(["layer", "head"], as_index=False)[
                ["entropy", "mean_distance", "sink_mass", "local_mass", "learned_sink_mass"]
            ]
            .mean()
            .rename(columns=lambda c: c if c in ("layer", "head") else f"mean_{c}")
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
        rows = []
        for layer in self.map_layers:
            full_tokens = self.kv_cache_tokens(layer, longest)
            kept_tokens = self.kv_cache_tokens(layer, longest, window, global_tokens)
            stats = self._pass(layer, window, global_tokens)
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

    def _frame(self, layer: int, stats: dict[str, np.ndarray], names: tuple[str, ...]) -> pd.DataFrame:
        h_n = self.layers[layer].num_heads
        parts = []
        for b, (off, n) in self._seqs():
            part = {
                "layer": np.full(h_n * n, layer, dtype=np.int64),
                "head": np.repeat(np.arange(h_n, dtype=np.int64), n),
                "seq": np.full(h_n * n, b, dtype=np.int64),
                "pos": np.tile(np.arange(n, dtype=np.int64), h_n),
            }
            for name in names:
                part[name] = stats[name][b, :, off : off + n].reshape(-1).astype(np.float32)
            parts.append(pd.DataFrame(part))
        return pd.concat(parts, ignore_index=True)


def _key_span(lo, hi, start: int, stop: int) -> int:
    """Keys the query rows start:stop attend to, from the first to the last (rows without keys ignored)."""
    lo, hi = lo[start:stop], hi[start:stop]
    real = hi >= lo
    if not bool(real.any()):
        return 1
    return int(hi[real].max()) - int(lo[real].min()) + 1


def _block_stats(
    q, k, lo, hi, spec: AttentionLayer, sinks, *, query_cols, key_cols, first_col, window, global_tokens
) -> dict:
    """Statistics of one query block. q [H, R, D], k [H, K, D], lo/hi [R] relative to k; returns [H, R].

    Works in place on the one [H, R, K] buffer: this pass is the whole cost of summaries on long inputs.
    """
    import torch

    scores = torch.matmul(q, k.transpose(1, 2)).mul_(spec.scaling)  # [H, R, K]
    if spec.softcap is not None:
        scores.div_(spec.softcap).tanh_().mul_(spec.softcap)
    rel = torch.arange(k.shape[1])
    allowed = (rel[None, :] >= lo[:, None]) & (rel[None, :] <= hi[:, None])  # [R, K]
    # A finite floor instead of -inf: exp() still gives exactly 0 and 0 * floor stays 0 (no NaN in Σ p·s).
    floor = torch.finfo(scores.dtype).min
    scores.masked_fill_(~allowed, floor)
    m = scores.amax(-1)  # [H, R]
    if sinks is not None:
        m = torch.maximum(m, sinks.expand_as(m))
    e = torch.exp(scores - m[..., None])  # masked -> 0
    weighted = torch.matmul(e.unsqueeze(-2), scores.unsqueeze(-1))[..., 0, 0]  # Σ e·s, [H, R]
    del scores
    sink_e = torch.exp(sinks - m) if sinks is not None else torch.zeros_like(m)
    mass_e = e.sum(-1)
    z = mass_e + sink_e
    z = torch.where(z > 0, z, torch.ones_like(z))
    distance = query_cols[:, None] - key_cols[None, :]  # [R, K] i - j (columns; same as positions)
    local = ((distance >= 0) & (distance < window)).to(e.dtype)
    kept = torch.maximum(local, ((key_cols - first_col) < global_tokens).to(e.dtype)[None, :])
    local_e = torch.einsum("hrk,rk->hr", e, local)
    kept_e = torch.einsum("hrk,rk->hr", e, kept) if global_tokens > 0 else local_e
    key_e = torch.matmul(e, key_cols.to(e.dtype))  # Σ e·j
    dist_e = query_cols.to(e.dtype)[None, :] * mass_e - key_e
    sink_col = first_col - int(key_cols[0]) if len(key_cols) else -1
    sink_e_pos0 = e[..., sink_col] if 0 <= sink_col < k.shape[1] else torch.zeros_like(m)
    mass = mass_e / z
    entropy = (m + torch.log(z)) * mass - weighted / z
    return {
        "mass": mass.double(),
        "entropy": entropy.double(),
        "mean_distance": (dist_e / torch.where(mass_e > 0, mass_e, torch.ones_like(mass_e))).double(),
        "sink_mass": (sink_e_pos0 / z).double(),
        "local_mass": (local_e / z).double(),
        "kept_mass": (kept_e / z).double(),
        "learned_sink_mass": (sink_e / z).double(),
    }
