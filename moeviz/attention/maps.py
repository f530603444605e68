"""`AttentionCapture`: the attention of one capture, with exact maps and per-head summaries on demand.

What is stored (all linear in T): per softmax-attention layer an `AttentionLayer` (post-RoPE queries and
keys exactly as the model's attention function received them, the mask as one allowed key interval per query
row, `scaling`, optional soft-cap and GPT-OSS sink logits), per linear-attention layer a
`LinearAttentionLayer`. Query head h reads key head h // (H / Hkv), as `repeat_kv` does.

Maps are recomputed as softmax(scaling · q kᵀ + mask) — with the sink logit as one more column that is then
dropped, as GPT-OSS's eager attention does — so a row, a block or a full [T, T] map is only built when
asked for (linear layers: `moeviz.attention.linear`). Summaries come from one fused pass per layer
(`moeviz.attention.summaries`), cached per window and tabulated here. The KV-cache what-if that reads these
statistics is `moeviz.whatif.kv_cache`.

Not persisted: `Trace.to_parquet` does not store attention; a trace read back has `attention = None`.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from moeviz.attention.layers import AttentionLayer, LinearAttentionLayer
from moeviz.attention.linear import linear_rows
from moeviz.attention.summaries import SUMMARY_STATS, layer_stats, score_precision


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
    _cache: dict[tuple, dict[str, np.ndarray]] = field(default_factory=dict, repr=False)
    _precision: dict[int, str] = field(default_factory=dict, repr=False)  # layer -> `score_precision`
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
        return sum(x.nbytes for x in self.layers.values()) + sum(x.nbytes for x in self.linear.values())

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
        self, spec: AttentionLayer | LinearAttentionLayer, head: int, seq: int, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Attention of query positions `rows` over every key position of the sequence, in float64.

        Returns (probs [R, L], learned sink mass [R]); probs exclude the sink, as eager maps do. Linear
        layers: (attention-like map [R, L], zeros [R]).
        """
        import torch

        off, n = int(self.offsets[seq]), int(self.lengths[seq])
        if isinstance(spec, LinearAttentionLayer):
            return linear_rows(spec, head, seq, off, n, rows), np.zeros(len(rows))
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
                linear_rows(spec, h, seq, off, n, rows) @ spec.value[seq, h, off : off + n].astype(np.float64)
                for h in range(spec.num_heads)
            ]
        )

    # ---- streaming summaries ------------------------------------------------------------------------
    def token_statistics(
        self, layer: int, window: int, global_tokens: int, geometry: dict | None = None
    ) -> dict[str, np.ndarray]:
        """Per-token statistics of every head of one layer, streamed over query blocks.

        Returns arrays [B, H, T] (query columns): mass (on real keys), entropy, mean_distance, sink_mass,
        local_mass (0 <= i - j < window), kept_mass (local or j < global_tokens), learned_sink_mass.
        One fused pass over the layer (`layer_stats`); cached per (layer, window, global_tokens). Callers
        that pass several layers share one `geometry` (the blocks' masks and weights, the same for every
        layer with the same intervals: built once instead of once per layer).
        """
        key = (layer, window, global_tokens)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        spec = self.layers[self._layers_arg([layer])[0]]  # refuses linear layers, as `summaries` does
        with self._lock:
            precision = self._precision.get(layer)
        if precision is None:  # probed once per layer, whatever the windows asked for
            precision = score_precision(spec)
            with self._lock:
                self._precision[layer] = precision
        out = layer_stats(spec, self.offsets, window, global_tokens, geometry, precision)
        with self._lock:
            self._cache[key] = out
        return out

    def has_statistics(self, layer: int, window: int, global_tokens: int = 0) -> bool:
        """Whether `token_statistics(layer, window, global_tokens)` is cached (a call costs nothing)."""
        with self._lock:
            return (layer, window, global_tokens) in self._cache

    def summaries(self, window: int = 32, layers: list[int] | None = None) -> pd.DataFrame:
        """Tidy per-token head summaries: one row per (layer, head, seq, pos) of every real token.

        entropy (nats) of the attention row; mean_distance = Σ p_j (i − j) / Σ p_j; sink_mass = attention
        on position 0; local_mass = attention on keys with 0 <= i − j < `window`; learned_sink_mass = the
        GPT-OSS sink's share (not part of the map). Linear memory: no T × T map is built.
        """
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        layers = self._layers_arg(layers)
        geometry: dict = {}  # shared by the layers: those with the same intervals share block masks
        stats = [self.token_statistics(layer, window, 0, geometry) for layer in layers]
        return self._frame(layers, stats, SUMMARY_STATS)

    def head_summary(self, window: int = 32) -> pd.DataFrame:
        """One row per (layer, head): mean entropy, mean distance, sink and local mass over real tokens, and a
        `kind` label for the head grid: "sink" (mean sink mass > 0.5), "local" (local mass > 0.5) or
        "global". Linear-attention layers with an attention-like map are listed once (head -1) with kind
        "linear" (no probability statistics); layers without a map with kind "no map" and their reason."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        means: dict[str, list[np.ndarray]] = {name: [] for name in SUMMARY_STATS}  # per layer: [H]
        geometry: dict = {}
        for layer in self.map_layers:  # means over real tokens, without building the per-token frame
            stats = self.token_statistics(layer, window, 0, geometry)
            for name, per_layer in means.items():
                real = [stats[name][b, :, off : off + n] for b, (off, n) in self.sequences()]
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

    def subset(self, layers: list[int]) -> AttentionCapture:
        """A view of the softmax layers `layers` only (those without a softmax map left out), sharing this
        capture's statistics cache: what a page showing some layers summarises, computed once for both."""
        keep = sorted(int(layer) for layer in layers if int(layer) in self.layers)
        return dataclasses.replace(
            self, layers={layer: self.layers[layer] for layer in keep}, no_map={}, linear={},
            _cache=self._cache, _precision=self._precision, _lock=self._lock,
        )  # fmt: skip

    # ---- KV cache ------------------------------------------------------------------------------------
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

    def kv_cache_tokens(self, layer: int, tokens: int) -> int:
        """Tokens softmax layer `layer` keeps in its KV cache after `tokens` tokens: all of them, or at most
        its own sliding window (min(sliding_window, T))."""
        cap = self.layers[layer].sliding_window
        return tokens if cap is None else min(tokens, int(cap))

    def kv_cache_bytes(self, tokens: int) -> int:
        """Bytes of the whole KV cache after `tokens` tokens: Σ over softmax layers of bytes per token
        (`kv_cache_bytes_per_token`: Hkv · (Dk + Dv) · dtype bytes, i.e. 2 · Hkv · head dim · dtype bytes when
        Dk = Dv) · the tokens that layer keeps (`kv_cache_tokens`: T, or min(sliding_window, T) for
        sliding-window layers). Linear/Mamba layers keep a fixed-size state and are not counted."""
        per_layer = self.kv_cache_bytes_per_token().set_index("layer")["bytes_per_token"]
        return sum(int(per_layer[layer]) * self.kv_cache_tokens(layer, tokens) for layer in self.layers)

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

    def sequences(self) -> Iterator[tuple[int, tuple[int, int]]]:
        """(b, (offset, length)) of each captured sequence: its row b of the [B, H, T] statistics, the
        column of its position 0 and its real tokens."""
        return enumerate(zip(self.offsets.tolist(), self.lengths.tolist(), strict=True))

    def _frame(
        self, layers: list[int], stats: list[dict[str, np.ndarray]], names: tuple[str, ...]
    ) -> pd.DataFrame:
        """The tidy frame of `layers`' per-token statistics (one `token_statistics` result each): built from
        numpy columns at once (one DataFrame, no concatenation of per-layer frames)."""
        columns: dict[str, list[np.ndarray]] = {c: [] for c in ("layer", "head", "seq", "pos", *names)}
        for layer, per_token in zip(layers, stats, strict=True):
            h_n = self.layers[layer].num_heads
            for b, (off, n) in self.sequences():
                columns["layer"].append(np.full(h_n * n, layer, dtype=np.int64))
                columns["head"].append(np.repeat(np.arange(h_n, dtype=np.int64), n))
                columns["seq"].append(np.full(h_n * n, b, dtype=np.int64))
                columns["pos"].append(np.tile(np.arange(n, dtype=np.int64), h_n))
                for name in names:
                    columns[name].append(per_token[name][b, :, off : off + n].reshape(-1).astype(np.float32))
        empty = {
            c: np.zeros(0, np.int64 if c in ("layer", "head", "seq", "pos") else np.float32) for c in columns
        }
        return pd.DataFrame({c: np.concatenate(parts) if parts else empty[c] for c, parts in columns.items()})
