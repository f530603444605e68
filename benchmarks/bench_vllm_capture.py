"""Live vLLM capture benchmark: vLLM generating with moeviz's capture installed (the router's capture seam
recording ids, weights and router logits per forward, plus the per-forward token check) against vLLM
generating with no callback at all, same prompts, same greedy tokens.

Target (issue 28): ≤ 1.05× the CPU time of the plain run (vLLM documents ~2% for its own GPU capture).
CPU time is the worker process's own (`time.process_time` inside the worker, around the `generate` calls
only: neither the engine start, the capture's install nor the file count), interleaved (plain, capture, then
capture, plain: drift cancels), 3 repeats: median and spread. Also the engine start: vLLM's import and
`LLM(...)`, as the worker measured them, and the session's start as the caller sees it.

Run: .venv/bin/python benchmarks/bench_vllm_capture.py [--model sample:mixtral-healthy] [--prompts 8]
     [--prompt-tokens 128] [--generate 32] [--dtype float32]   (needs `make vllm`)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from record import Figure, flags
from record import record as record_figures


def prompts_of(model: str, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` token ids cut from the sample evaluation slices (all domains)."""
    from moeviz.engines.layout import routing_layout
    from moeviz.samples import eval_dir

    tokenizer = routing_layout(model).tokenizer()
    text = " ".join(path.read_text(encoding="utf-8") for path in sorted(eval_dir().glob("*.txt")))
    ids = tokenizer(text[: count * length * 8])["input_ids"]
    if len(ids) < count * length:
        raise SystemExit(f"the evaluation slices give {len(ids)} tokens, {count * length} needed")
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sample:mixtral-healthy")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--generate", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from moeviz.engines.vllm import VllmSession

    prompts = prompts_of(args.model, args.prompts, args.prompt_tokens)
    began = time.perf_counter()
    session = VllmSession(args.model, dtype=args.dtype, kv_cache_bytes=256 << 20).start()
    started = time.perf_counter() - began
    with session:
        print(
            f"engine start: {started:.1f} s as the caller sees it (vLLM import {session.import_s:.1f} s, "
            f"LLM(...) {session.engine_start_s:.1f} s); vLLM {session.meta['vllm']}, {session.meta['dtype']}"
        )
        tokens = args.prompts * (args.prompt_tokens + args.generate)
        print(
            f"{args.prompts} prompts × ({args.prompt_tokens} + {args.generate} generated) = {tokens} tokens"
        )

        def timed(record: bool) -> tuple[float, float, list]:
            run = session.run(prompts, generate=args.generate, record=record)
            run.path.unlink(missing_ok=True)
            return run.cpu_s, run.wall_s, run.meta["sequences"]

        for _ in range(2):  # warm-up: first-call allocations and thread pools on both paths
            timed(True), timed(False)
        plain_cpu, capture_cpu, plain_wall, capture_wall, ratios = [], [], [], [], []
        for repeat in range(args.repeats):
            order = (False, True) if repeat % 2 == 0 else (True, False)
            measured = {record: timed(record) for record in order}
            (p_cpu, p_wall, p_seq), (c_cpu, c_wall, c_seq) = measured[False], measured[True]
            assert p_seq == c_seq, "the capture changed what vLLM generated"
            plain_cpu.append(p_cpu)
            capture_cpu.append(c_cpu)
            plain_wall.append(p_wall)
            capture_wall.append(c_wall)
            ratios.append(c_cpu / p_cpu)
            print(
                f"repeat {repeat}: plain {p_cpu:.3f} s CPU, capture {c_cpu:.3f} s CPU: {c_cpu / p_cpu:.3f}×"
            )
        median = statistics.median(ratios)
        print(
            f"capture / plain CPU time: median {median:.3f}× (spread {min(ratios):.3f}–{max(ratios):.3f}; "
            f"plain {statistics.median(plain_cpu):.2f} s, capture {statistics.median(capture_cpu):.2f} s; "
            f"wall {statistics.median(plain_wall):.2f} s vs {statistics.median(capture_wall):.2f} s); "
            f"target ≤ 1.05×: {'met' if median <= 1.05 else 'NOT met'}"
        )
    command = f"python benchmarks/bench_vllm_capture.py{flags(parser, args)}"  # needs `make vllm`
    size = (
        f"{args.model}, {args.dtype}, {args.prompts} prompts × ({args.prompt_tokens} + {args.generate} "
        "generated)"
    )
    record_figures(
        "vllm_capture",
        [
            Figure(
                "Capture",
                f"live vLLM capture vs vLLM with no callback (needs `make vllm`), worker CPU time, {size}",
                f"{median:.3f}× ({min(ratios):.3f}–{max(ratios):.3f}); "
                f"plain {statistics.median(plain_cpu):.2f} s, capture {statistics.median(capture_cpu):.2f} s",
                command,
                "≤ 1.05×",
                median <= 1.05,
            ),
            Figure(
                "Capture",
                f"vLLM engine start as the caller sees it, {args.model}, {args.dtype} (one start)",
                f"{started:.1f} s (vLLM import {session.import_s:.1f} s, "
                f"LLM(...) {session.engine_start_s:.1f} s)",
                command,
            ),
        ],
    )


if __name__ == "__main__":
    main()
