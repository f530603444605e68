"""Engine-import benchmark: a Qwen3-30B-A3B-shaped RL rollout (1,048,576 routed tokens × 48 MoE layers ×
k = 8, E = 128: 402 M expert ids) as vLLM ≥ 0.27 writes it — a JSONL of 1,024 OpenAI completion responses
whose choice carries `routed_experts`, base64 of `.npy` bytes (uint8, E ≤ 256), and the token ids.

Target (issue 27): import + validate in < 10 s and < 2× the bytes of the ids in memory. Peer: what an RL
framework does instead, decoding each response's array (`json.loads`, base64, `np.load`) without any check or
alignment. CPU time (`time.process_time`, one thread), interleaved, 3 repeats: median and spread. Memory: the
peak of Python's and numpy's allocations during the import (`tracemalloc`, a separate run), against the ids'
bytes at int32 and as written (uint8).

Run: .venv/bin/python benchmarks/bench_engine_import.py [--responses 1024] [--rows 1024]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
from record import Figure, flags, record

LAYERS, K, EXPERTS, PROMPT = 48, 8, 128, 256
# Qwen3-30B-A3B's routing facts, narrow widths (the importer builds the model on the meta device only)
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_hidden_layers": LAYERS,
    "num_experts": EXPERTS,
    "num_experts_per_tok": K,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 151936,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
}


def write_rollouts(folder: Path, responses: int, rows: int) -> Path:
    """The JSONL: each response a prompt of PROMPT tokens and rows + 1 − PROMPT generated ones (the last never
    run), its routing rows distinct ids per (token, layer)."""
    rng = np.random.default_rng(0)
    path = folder / "rollouts.jsonl"
    with path.open("w") as out:
        for i in range(responses):
            offsets = rng.choice(EXPERTS, size=K, replace=False)
            start = rng.integers(0, EXPERTS, size=(rows, LAYERS, 1))
            ids = ((start + offsets) % EXPERTS).astype(np.uint8)  # k distinct ids per (token, layer)
            buffer = io.BytesIO()
            np.save(buffer, ids)
            tokens = rng.integers(0, CONFIG["vocab_size"], size=rows + 1).tolist()
            choice = {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_token_ids": tokens[:PROMPT],
                "token_ids": tokens[PROMPT:],
                "routed_experts": base64.b64encode(buffer.getvalue()).decode(),
            }
            usage = {
                "prompt_tokens": PROMPT,
                "completion_tokens": rows + 1 - PROMPT,
                "total_tokens": rows + 1,
            }
            response = {"id": f"cmpl-{i}", "object": "text_completion", "choices": [choice], "usage": usage}
            out.write(json.dumps(response) + "\n")
    return path


def plain_decode(path: Path) -> list[np.ndarray]:
    """The peer: each response's routed experts as an array, unchecked."""
    arrays = []
    with path.open() as lines:
        for line in lines:
            payload = json.loads(line)["choices"][0]["routed_experts"]
            arrays.append(np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False))
    return arrays


def moeviz_import(path: Path, model: Path):
    from moeviz.engines import import_routing

    return import_routing("vllm-routed", [path], model)


def cpu_seconds(fn) -> float:
    start = time.process_time()
    result = fn()
    elapsed = time.process_time() - start
    del result
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=1024, help="routed tokens per response")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    from moeviz.engines.layout import routing_layout

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = folder / "qwen3-30b-a3b-shape"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(CONFIG))
        routing_layout(model)  # the config is read once per process (cached), outside the timing
        path = write_rollouts(folder, args.responses, args.rows)
        ids = args.responses * args.rows * LAYERS * K
        print(
            f"{args.responses} responses × {args.rows} routed tokens × {LAYERS} layers × k={K}: {ids:,} ids"
        )
        print(f"JSONL {path.stat().st_size / 2**20:,.0f} MiB")
        ours, peer = [], []
        for _ in range(args.repeats):  # interleaved
            peer.append(cpu_seconds(lambda: plain_decode(path)))
            ours.append(cpu_seconds(lambda: moeviz_import(path, model)))
        ratios = [a / b for a, b in zip(ours, peer, strict=True)]
        spread = f"{min(ours):.2f}–{max(ours):.2f}"
        print(f"moeviz import + validate: {statistics.median(ours):.2f} s CPU ({spread}); target < 10 s")
        print(
            f"plain decode (peer):      {statistics.median(peer):.2f} s CPU ({min(peer):.2f}–{max(peer):.2f})"
        )
        print(f"ratio: {statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})")
        tracemalloc.start()
        trace = moeviz_import(path, model)
        _, peak = tracemalloc.get_traced_memory()
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del trace
        print(
            f"memory: peak {peak / 2**20:,.0f} MiB during the import, "
            f"{held / 2**20:,.0f} MiB held by the Trace; "
            f"ids {ids * 4 / 2**20:,.0f} MiB at int32 (peak {peak / (ids * 4):.2f}×), "
            f"{ids / 2**20:,.0f} MiB as written, uint8 (peak {peak / ids:.2f}×); target < 2×"
        )
    size = (
        f"{args.responses:,} responses × {args.rows:,} routed tokens × {LAYERS} layers × k = {K} "
        f"({ids:,} ids)"
    )
    command = f"python benchmarks/bench_engine_import.py{flags(parser, args)}"
    median = statistics.median(ours)
    record(
        "engine_import",
        [
            Figure(
                "Engine import and diff",
                f"vLLM `routed_experts` JSONL import + validate, {size}; peer: a plain decode, no checks",
                f"{median:.2f} s CPU ({spread}); plain decode {statistics.median(peer):.2f} s "
                f"({min(peer):.2f}–{max(peer):.2f}); ratio {statistics.median(ratios):.2f}× "
                f"({min(ratios):.2f}–{max(ratios):.2f})",
                command,
                "< 10 s",
                median < 10,
            ),
            Figure(
                "Engine import and diff",
                f"peak memory of that import (tracemalloc), {size}",
                f"{peak / 2**20:,.0f} MiB: {peak / (ids * 4):.2f}× the ids at int32, {peak / ids:.2f}× as "
                f"written (uint8); {held / 2**20:,.0f} MiB held by the Trace",
                command,
                "< 2× the ids (int32)",
                peak / (ids * 4) < 2,
            ),
        ],
    )


if __name__ == "__main__":
    main()
