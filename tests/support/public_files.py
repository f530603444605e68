"""Public routing traces written as their producers write them, for the importer tests
(tests/models/test_engines_public.py):

- FLAME-MoE (dataset CMU-FLAME/FLAME-MoE-Traces): the model's routing as FLAME's Megatron fork records it
  (`values, indices = torch.topk(probs, k)` of the router's softmax over all experts: sorted by score), stored
  as the dataset's Parquet files — `samples/NNN.parquet` (`token_id` int32) and
  `actives/iter_NNNN/layer_NN.parquet` (`scores` list<float16>, `indices` list<int16>; NN = Megatron's
  1-based layer number), row i of every file the same token;
- a FLAME-shaped model config (softmax router over 64 experts, top-6, 2 shared experts, first layer dense:
  transformers' DeepSeek-V2 family), config.json only;
- MoE-Infinity: `ExpertTracer`'s bookkeeping (moe_infinity/memory/expert_tracer.py: `create_entry` a float64
  np.zeros matrix [num_layers, num_experts], `update_entry` adding a Counter of the flattened expert list at
  `layer_idx`, `finish_entry` copying it into the first all-zero slot of the float32 `trace_collection`
  [capacity, num_layers, num_experts]), saved with `np.save`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

FLAME_EXPERTS, FLAME_K, FLAME_SHARED = 64, 6, 2


def save_flame_config(folder: Path, num_hidden_layers: int = 9, vocab_size: int = 50304) -> Path:
    """config.json of a FLAME-MoE-shaped model (narrow widths; the layout is what matters): hidden layer 0
    dense, layers 1 … num_hidden_layers−1 MoE."""
    from transformers import DeepseekV2Config

    config = DeepseekV2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=FLAME_EXPERTS,
        num_experts_per_tok=FLAME_K,
        n_shared_experts=FLAME_SHARED,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        architectures=["DeepseekV2ForCausalLM"],
    )
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    return folder


def flame_routing(
    rng: np.random.Generator, rows: int, layers: int, k: int = FLAME_K, experts: int = FLAME_EXPERTS
) -> tuple[np.ndarray, np.ndarray]:
    """(indices [rows, layers, k] int16, scores [rows, layers, k] float16): FLAME's capture of random router
    logits — softmax over all experts, then `torch.topk(probs, k)` (values sorted descending)."""
    import torch

    logits = torch.from_numpy(rng.normal(size=(rows, layers, experts)).astype(np.float32) * 2)
    probs = torch.softmax(logits, dim=-1)
    values, indices = torch.topk(probs, k=k)
    return indices.numpy().astype(np.int16), values.numpy().astype(np.float16)


def write_flame(
    model_folder: Path,
    indices: np.ndarray,
    scores: np.ndarray,
    token_ids: list[np.ndarray],
    *,
    iteration: int = 540,
    first_layer_number: int = 2,
    fixed_size: bool = False,
) -> Path:
    """Write one iteration of a FLAME-MoE trace under `model_folder` (flame-moe-NNN/): the samples files
    (one per entry of `token_ids`, their rows in order) and one layer file per layer of indices/scores
    [R, L, k], named from Megatron layer `first_layer_number` on. `fixed_size`: the list columns as Arrow
    fixed_size_list (the dataset card writes `list<int16>[6]`) instead of list. → the iteration folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    samples = model_folder / "samples"
    samples.mkdir(parents=True, exist_ok=True)
    for i, ids in enumerate(token_ids):
        table = pa.table({"token_id": pa.array(np.asarray(ids, dtype=np.int32), pa.int32())})
        pq.write_table(table, samples / f"{i:03d}.parquet")
    folder = model_folder / "actives" / f"iter_{iteration:04d}"
    folder.mkdir(parents=True, exist_ok=True)
    k = indices.shape[2]
    for layer in range(indices.shape[1]):
        columns = {
            "scores": _list_array(scores[:, layer], pa.float16(), k, fixed_size),
            "indices": _list_array(indices[:, layer], pa.int16(), k, fixed_size),
        }
        pq.write_table(pa.table(columns), folder / f"layer_{first_layer_number + layer:02d}.parquet")
    return folder


def _list_array(values: np.ndarray, kind, k: int, fixed_size: bool):
    import pyarrow as pa

    flat = pa.array(np.ascontiguousarray(values).reshape(-1), kind)
    if fixed_size:
        return pa.FixedSizeListArray.from_arrays(flat, k)
    offsets = pa.array(np.arange(0, len(values) * k + 1, k, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, flat)


def write_flame_layer(path: Path, indices: np.ndarray, scores: np.ndarray) -> Path:
    """One layer file from [R, k'] arrays (k' may differ from the model's k, for the refusals)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    k = indices.shape[1]
    table = pa.table(
        {
            "scores": _list_array(scores, pa.float16(), k, False),
            "indices": _list_array(indices, pa.int16(), k, False),
        }
    )
    pq.write_table(table, path)
    return path


class MoEInfinityTracer:
    """ExpertTracer's count bookkeeping without its GPU parts: `entries` per sequence id, `collection` the
    float32 trace collection (torch.zeros's dtype) that `np.save` writes."""

    def __init__(self, capacity: int, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.entries: dict[int, np.ndarray] = {}
        self.collection = np.zeros((capacity, num_layers, num_experts), dtype=np.float32)

    def create_entry(self, seq_id: int) -> None:
        self.entries[seq_id] = np.zeros((self.num_layers, self.num_experts))

    def update_entry(self, seq_id: int, expert_list: np.ndarray, layer_idx: int) -> None:
        for key, count in Counter(np.asarray(expert_list).flatten().tolist()).items():
            self.entries[seq_id][layer_idx, key] += count

    def finish_entry(self, seq_id: int) -> None:
        free = np.flatnonzero(self.collection.sum(axis=(1, 2)) == 0)
        self.collection[free[0]] = self.entries[seq_id]


def moe_infinity_run(
    tracer: MoEInfinityTracer, seq_id: int, forwards: list[np.ndarray], layer_ids: list[int]
) -> None:
    """One sequence through MoE-Infinity: each forward (prefill, then each decode step) hands every MoE
    layer's expert_index [tokens, k] to `update_entry` at its `layer_id` (module index + the model's first
    dense layers: model_offload.py); the entry is then finished. forwards: [tokens, L_moe, k] per forward."""
    tracer.create_entry(seq_id)
    for ids in forwards:
        for moe, layer_id in enumerate(layer_ids):
            tracer.update_entry(seq_id, ids[:, moe], layer_id)
    tracer.finish_entry(seq_id)


def distinct_ids(rng: np.random.Generator, tokens: int, layers: int, k: int, experts: int) -> np.ndarray:
    """[tokens, layers, k] ids, k distinct per (token, layer)."""
    return np.argsort(rng.random((tokens, layers, experts)), axis=2)[..., :k].astype(np.int64)
