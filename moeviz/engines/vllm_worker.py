"""moeviz's vLLM worker: runs inside the vLLM environment (`make vllm`: `.venv-vllm`), never in moeviz's own.

vLLM pins another transformers than moeviz, so `moeviz.engines.vllm` starts this file as a subprocess with the
vLLM environment's python and talks to it in JSON lines (one request on stdin, one reply on stdout; vLLM's
own output goes to stderr). It imports only vLLM, torch (vLLM's), numpy and the standard library — never
moeviz — and hands the routing back in a versioned `.npz` file (no pickled member).

Requests (`op`):
- `start`: load the model once (`LLM(model=…, enforce_eager=True, dtype=…)` with
  `VLLM_ENABLE_V1_MULTIPROCESSING=0`, so the model runs in this process) and choose how routing is read:
  - "capture-fn" (CPU; any platform where the router runs in Python): `llm.apply_model` installs on every
    fused-MoE module's router `set_capture_fn(cb)`. vLLM 0.32's `BaseRouter._select_experts`
    (fused_moe/router/base_router.py) calls `cb(topk_ids)` with the logical ids [tokens, k] of each forward,
    in the order `_compute_routing` returned them, before its EPLB remap, and the kernel then dispatches
    that very tensor. The combination weights and the router logits are not passed to `cb`: they are read
    from the same call, by wrapping the router's `_compute_routing(hidden_states, router_logits, …)` →
    (topk_weights, topk_ids), and kept only when `cb` receives the very ids tensor that call returned.
  - "routed-experts" (GPU): `LLM(…, enable_return_routed_experts=True)`; each request's
    `CompletionOutput.routed_experts` ([T − 1, hidden layers, k] uint8/uint16) is written as vLLM returns
    it, and moeviz decodes it with its `vllm-routed` importer. Needs Model Runner V2 (Triton): not on CPU.
- `capture`: run prompts (token ids, as `prompt_token_ids`: vLLM sees exactly those ids), one sequence at a
  time, greedy, `generate` new tokens (none: one is sampled and dropped), and write the file.
- `stop`.

Forward calls map to tokens by construction and are checked: one sequence runs at a time with prefix caching
off, so the forwards of one `generate` call are its prefill chunks then one decode step per new token, in
order. A pre-hook on the model records each forward's `input_ids` and `positions`; the concatenation must be
positions 0 … R − 1 and the sequence's ids, and every MoE layer must have captured exactly R rows, each of k
distinct ids in [0, E) — otherwise the request is refused rather than written.

File (`np.savez`, every member a plain array): `meta` (UTF-8 JSON: format "moeviz.vllm-capture", version,
vLLM's version, dtype, settings, layers) and per sequence i: `s{i}.token_ids` [T] int64, then for
"capture-fn" `s{i}.experts` [R, M, k] int32, `s{i}.weights` [R, M, k] float32, `s{i}.logits` [R, M, E]
float32 (when asked), for "routed-experts" `s{i}.routed_experts` as vLLM returned it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

FORMAT = "moeviz.vllm-capture"
VERSION = 1
ALTERATIONS = ("rotate",)  # test-only: ids → (ids + 1) mod E in place, inside the capture callback


class Refusal(Exception):
    """A request this worker refuses with one line (`kind` tells the driver what failed)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def one_line(exc: BaseException) -> str:
    """`Type: message` on one line (vLLM's own words; long ones cut)."""
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= 600 else text[:597] + "..."


class Seam:
    """The capture installed on the model's fused-MoE routers (`capture-fn` path)."""

    def __init__(self, modules: list[tuple[int, str, Any]], num_experts: int, top_k: int) -> None:
        self.modules = modules  # (layer index, module name, module), ascending layer
        self.num_experts = num_experts
        self.top_k = top_k
        self.recording = False
        self.logits = False
        self.alter: str | None = None
        self.rows: list[list[tuple]] = [[] for _ in modules]  # per module: (ids, weights, logits) per forward
        self.forwards: list[tuple] = []  # per forward: (input_ids, positions)
        self.pending: list[tuple | None] = [None] * len(modules)
        self.hook: Any = None  # the model's forward pre-hook handle while installed
        self.installed = False

    def reset(self) -> None:
        self.rows = [[] for _ in self.modules]
        self.forwards = []
        self.pending = [None] * len(self.modules)

    def install(self, model) -> None:
        for slot, (_, _, module) in enumerate(self.modules):
            router = module.router
            original = type(router)._compute_routing.__get__(router)

            def compute(*args, _original=original, _slot=slot, **kwargs):
                weights, ids = _original(*args, **kwargs)
                if self.recording:
                    logits = kwargs.get("router_logits", args[1] if len(args) > 1 else None)
                    self.pending[_slot] = (ids, weights, logits)
                return weights, ids

            router._compute_routing = compute
            router.set_capture_fn(lambda ids, _slot=slot: self._capture(_slot, ids))
        self.hook = model.register_forward_pre_hook(self._forward, with_kwargs=True)
        self.installed = True

    def uninstall(self, model) -> None:
        for _, _, module in self.modules:
            module.router.set_capture_fn(None)
            module.router.__dict__.pop("_compute_routing", None)
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        self.installed = False

    def _forward(self, module, args, kwargs) -> None:
        if not self.recording:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if positions is not None and positions.dim() > 1:  # M-RoPE: [3, tokens], row 0 is the position
            positions = positions[0]
        self.forwards.append(
            (
                None if ids is None else ids.detach().to("cpu").numpy().copy(),
                None if positions is None else positions.detach().to("cpu").numpy().copy(),
            )
        )

    def _capture(self, slot: int, ids) -> None:
        if not self.recording:
            return
        if self.alter == "rotate":
            ids.add_(1).remainder_(self.num_experts)  # in place: what the kernel then dispatches
        pending, self.pending[slot] = self.pending[slot], None
        weights = logits = None
        if pending is not None and pending[0] is ids:
            weights = pending[1].detach().float().cpu().numpy().copy()
            if self.logits and pending[2] is not None:
                logits = pending[2].detach().float().cpu().numpy().copy()
        self.rows[slot].append((ids.detach().to("cpu").numpy().astype("int32"), weights, logits))


class Worker:
    def __init__(self) -> None:
        self.llm: Any = None  # vllm.LLM once started
        self.seam: Seam | None = None
        self.meta: dict = {}
        self.path = ""
        self.send: Callable[[dict], None] | None = None

    # ---- start ------------------------------------------------------------------------------------------
    def start(self, request: dict) -> dict:
        self.stage("importing vLLM")
        began = time.perf_counter()
        try:
            import vllm
            from vllm import LLM
        except Exception as exc:
            raise Refusal("environment", f"import vllm failed: {one_line(exc)}") from exc
        imported = time.perf_counter()

        version = getattr(vllm, "__version__", "unknown")
        path = request.get("routing", "auto")
        on_cpu = _on_cpu()
        if path == "auto":
            path = "capture-fn" if on_cpu else "routed-experts"
        if path == "routed-experts" and on_cpu:
            raise Refusal(
                "settings",
                f"vLLM {version} on CPU cannot return routed experts (enable_return_routed_experts needs "
                "Model Runner V2, which needs Triton): use the capture-fn path",
            )
        kwargs = {
            "model": request["model"],
            "dtype": request.get("dtype", "auto"),
            # the seam is a Python callback: a CUDA graph would not replay it, a compiler could fold it away
            "enforce_eager": path == "capture-fn",
            "enable_prefix_caching": False,  # every prompt position is computed, so every one has routing
            "seed": int(request.get("seed", 0)),
            "trust_remote_code": False,
        }
        for key in (
            "max_model_len",
            "kv_cache_memory_bytes",
            "gpu_memory_utilization",
            "skip_tokenizer_init",
        ):
            if request.get(key) is not None:
                kwargs[key] = request[key]
        if on_cpu and "kv_cache_memory_bytes" not in kwargs:
            kwargs["kv_cache_memory_bytes"] = 1 << 30  # else vLLM reserves 92% of the RAM for its cache
        if path == "routed-experts":
            kwargs["enable_return_routed_experts"] = True
        self.shutdown()
        self.stage(f"starting the vLLM {version} engine")
        try:
            self.llm = LLM(**kwargs)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            raise Refusal("model", f"vLLM {version} cannot run {request['model']}: {one_line(exc)}") from exc
        started = time.perf_counter()
        config = self.llm.llm_engine.model_config
        self.path = path
        layers: list[int] = []
        if path == "capture-fn":
            self.seam = self.llm.apply_model(lambda model: _seam(model, version))[0]
            self.llm.apply_model(self.seam.install)
            layers = [layer for layer, _, _ in self.seam.modules]
        self.meta = {
            "format": FORMAT,
            "version": VERSION,
            "vllm": version,
            "torch": _torch_version(),
            "path": path,
            "dtype": str(config.dtype).removeprefix("torch."),
            "platform": "cpu" if on_cpu else "gpu",
            "layers": layers,
            "modules": [name for _, name, _ in self.seam.modules] if self.seam else [],
            "num_experts": self.seam.num_experts if self.seam else None,
            "top_k": self.seam.top_k if self.seam else None,
            "settings": {
                **{k: v for k, v in kwargs.items() if k != "model"},
                "max_model_len": config.max_model_len,
                "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
            },
        }
        return {
            "ok": True,
            "meta": self.meta,
            "import_s": imported - began,
            "engine_start_s": started - imported,
        }

    # ---- capture ----------------------------------------------------------------------------------------
    def capture(self, request: dict) -> dict:
        import numpy as np
        from vllm import SamplingParams

        if self.llm is None:
            raise Refusal("protocol", "capture before start")
        prompts = request["prompts"]
        generate = int(request.get("generate", 0))
        record = bool(request.get("record", True))
        alter = request.get("alter")
        if alter is not None and alter not in ALTERATIONS:
            raise Refusal("settings", f"unknown alteration {alter!r}")
        params = SamplingParams(temperature=0.0, max_tokens=max(generate, 1), detokenize=False)
        seam = self.seam
        if seam is not None:
            seam.logits = bool(request.get("logits", True))
            seam.alter = alter
            if record != seam.installed:  # without capture: vLLM as it runs with no callback at all
                self.llm.apply_model(seam.install if record else seam.uninstall)
        arrays: dict[str, np.ndarray] = {}
        sequences = []
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for index, prompt in enumerate(prompts):
            prompt = [int(t) for t in prompt]
            if seam is not None and record:
                seam.reset()
                seam.recording = True
            try:
                outputs = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            except Exception as exc:
                traceback.print_exc(file=sys.stderr)
                raise Refusal("model", f"vLLM failed on sequence {index}: {one_line(exc)}") from exc
            finally:
                if seam is not None:
                    seam.recording = False
            completion = outputs[0].outputs[0]
            generated = [int(t) for t in completion.token_ids][:generate]
            sequence = prompt + generated
            arrays[f"s{index}.token_ids"] = np.asarray(sequence, np.int64)
            sequences.append({"prompt_len": len(prompt), "generated": len(generated)})
            if request.get("stage"):
                self.stage(f"sequence {index + 1}/{len(prompts)}")
            if not record:
                continue
            if self.path == "routed-experts":
                if completion.routed_experts is None:
                    raise Refusal("seam", f"vLLM returned no routed experts for sequence {index}")
                arrays[f"s{index}.routed_experts"] = np.asarray(completion.routed_experts)
                continue
            assert seam is not None  # the capture-fn path: `start` installed it
            rows = len(sequence) - 1 if generated else len(prompt)
            arrays.update(_sequence_arrays(seam, index, sequence[:rows], self.meta["vllm"]))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        out = request["out"]
        meta = {**self.meta, "sequences": sequences, "generate": generate, "altered": alter, "record": record}
        write_capture(out, meta, arrays)
        return {"ok": True, "out": out, "cpu_s": cpu, "wall_s": wall, "sequences": sequences}

    def shutdown(self) -> None:
        """Drop the running engine (a `start` for another model or dtype: vLLM stays imported)."""
        if self.llm is None:
            return
        import gc

        if self.seam is not None and self.seam.installed:
            self.llm.apply_model(self.seam.uninstall)
        engine = getattr(self.llm.llm_engine, "engine_core", None)
        if engine is not None and callable(getattr(engine, "shutdown", None)):
            engine.shutdown()
        self.llm = self.seam = None
        self.meta = {}
        gc.collect()

    def stage(self, message: str) -> None:
        if self.send is not None:
            self.send({"stage": message})


def write_capture(out: str, meta: dict, arrays: dict) -> None:
    """The capture file: `arrays` and `meta` (JSON, UTF-8 bytes as uint8) in one `.npz`, renamed into place
    once complete."""
    import numpy as np

    members = {**arrays, "meta": np.frombuffer(json.dumps(meta).encode("utf-8"), np.uint8)}
    with open(out + ".partial", "wb") as handle:
        np.savez(handle, **members)
    os.replace(out + ".partial", out)


def _sequence_arrays(seam: Seam, index: int, ran: list[int], version: str) -> dict:
    """The checked arrays of one sequence: the forwards' tokens must be the sequence's first R tokens at
    positions 0 … R − 1, and every layer must hold R rows of k distinct ids in [0, E)."""
    import numpy as np

    r, k, e = len(ran), seam.top_k, seam.num_experts
    where = f"sequence {index}"
    fed = [ids for ids, _ in seam.forwards]
    positions = [pos for _, pos in seam.forwards]
    if not seam.forwards or any(ids is None for ids in fed) or any(p is None for p in positions):
        raise Refusal("schedule", f"{where}: the model's forward was not seen with input_ids and positions")
    fed_ids, fed_pos = np.concatenate(fed), np.concatenate(positions)
    if len(fed_ids) != r or not np.array_equal(fed_pos, np.arange(r)) or not np.array_equal(fed_ids, ran):
        raise Refusal(
            "schedule",
            f"{where}: vLLM ran {len(fed_ids)} tokens in {len(fed)} forwards (positions "
            f"{fed_pos[:3].tolist()}…), expected the sequence's {r} tokens at positions 0…{r - 1}",
        )
    experts, weights, logits = [], [], []
    for slot, (layer, name, _) in enumerate(seam.modules):
        calls = seam.rows[slot]
        if len(calls) != len(fed):
            raise Refusal(
                "seam",
                f"vLLM {version}: layer {layer} ({name}) called the router's capture {len(calls)} times in "
                f"{len(fed)} forwards of {where} (a kernel that routes without the router?)",
            )
        ids = np.concatenate([c[0] for c in calls])
        if ids.shape != (r, k):
            raise Refusal(
                "seam",
                f"{where}, layer {layer}: captured ids of shape {list(ids.shape)}, expected [{r}, {k}]",
            )
        _check_ids(ids, e, f"{where}, layer {layer}", version)
        experts.append(ids)
        weights.append(
            np.concatenate([c[1] for c in calls]) if all(c[1] is not None for c in calls) else None
        )
        logits.append(np.concatenate([c[2] for c in calls]) if all(c[2] is not None for c in calls) else None)
    out = {f"s{index}.experts": np.stack(experts, axis=1)}
    whole_weights = [w for w in weights if w is not None and w.shape == (r, k)]
    if len(whole_weights) == len(weights):
        out[f"s{index}.weights"] = np.stack(whole_weights, axis=1).astype(np.float32)
    whole_logits = [lg for lg in logits if lg is not None and lg.shape == (r, e)]
    if len(whole_logits) == len(logits):
        out[f"s{index}.logits"] = np.stack(whole_logits, axis=1).astype(np.float32)
    return out


def _check_ids(ids, num_experts: int, where: str, version: str) -> None:
    import numpy as np

    if len(ids) and not ids.any():
        raise Refusal("seam", f"vLLM {version}: {where}: every captured id is 0 (the router was bypassed?)")
    bad = (ids < 0) | (ids >= num_experts)
    ordered = np.sort(ids, axis=1)
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    rows = np.flatnonzero(bad.any(axis=1) | repeated)
    if len(rows):
        row = int(rows[0])
        raise Refusal(
            "seam",
            f"vLLM {version}: {where}, position {row}: ids {ids[row].tolist()} are not "
            f"{ids.shape[1]} distinct experts in [0, {num_experts})",
        )


def _seam(model, version: str) -> Seam:
    """The fused-MoE modules of `model` (layer index, name, module), checked for a usable capture seam."""
    modules = []
    for name, module in model.named_modules():
        router = getattr(module, "router", None)
        if router is None or not _is_moe_router(router):
            continue
        if not callable(getattr(router, "set_capture_fn", None)) or not hasattr(
            type(router), "_compute_routing"
        ):
            raise Refusal(
                "version",
                f"vLLM {version}: the router of {name} ({type(router).__name__}) has no set_capture_fn "
                "capture seam; moeviz captures through vLLM's BaseRouter.set_capture_fn (vLLM 0.32.0 has it)",
            )
        method = getattr(module, "_quant_method", None)
        if method is not None and getattr(method, "is_monolithic", False):
            raise Refusal(
                "seam",
                f"vLLM {version}: {name} runs a monolithic MoE kernel that routes without its router, so "
                "the capture seam never sees its ids",
            )
        layer = getattr(module, "layer_id", None)
        if not isinstance(layer, int):
            found = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", name)
            if found is None:
                raise Refusal("seam", f"vLLM {version}: cannot tell the layer of fused-MoE module {name}")
            layer = int(found.group(1))
        modules.append((layer, name, module))
    if not modules:
        raise Refusal("model", f"vLLM {version} found no fused-MoE layer in the model (a dense model?)")
    modules.sort(key=lambda m: m[0])
    if len({m[0] for m in modules}) != len(modules):
        raise Refusal("seam", f"vLLM {version}: several fused-MoE modules in one layer ({modules[0][1]}, …)")
    routers = [m[2].router for m in modules]
    tops = {getattr(r, "top_k", None) for r in routers}
    counts = {getattr(r, "global_num_experts", None) for r in routers}
    top, count = (tops.pop(), counts.pop()) if len(tops) == len(counts) == 1 else (None, None)
    if top is None or count is None:
        raise Refusal("seam", f"vLLM {version}: the MoE layers' routers differ in k or expert count")
    return Seam(modules, int(count), int(top))


def _is_moe_router(router) -> bool:
    try:
        from vllm.model_executor.layers.fused_moe import FusedMoERouter
    except ImportError:  # another layout of vLLM: go by name
        return "Router" in type(router).__name__
    return isinstance(router, FusedMoERouter)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _torch_version() -> str:
    import torch

    return torch.__version__


def main() -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process: apply_model reaches it
    protocol = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # anything vLLM prints goes to stderr; stdout carries only the replies
    worker = Worker()

    def send(reply: dict) -> None:
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()

    worker.send = send
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            op = request.get("op")
            if op == "stop":
                send({"ok": True})
                return 0
            if op == "start":
                reply = worker.start(request)
            elif op == "capture":
                reply = worker.capture(request)
            else:
                raise Refusal("protocol", f"unknown op {op!r}")
        except Refusal as exc:
            reply = {"ok": False, "kind": exc.kind, "error": str(exc)}
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            reply = {"ok": False, "kind": "crash", "error": one_line(exc)}
        send(reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
