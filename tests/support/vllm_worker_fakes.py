"""Stand-ins for moeviz's vLLM worker (moeviz/engines/vllm_worker.py), for the driver's unit tests: scripts
that speak the worker's JSON-lines protocol but hang, crash, refuse, or answer with routing the test chose,
and a RoutingLayout built by hand (no config, no transformers). The real worker runs in tests/system."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from moeviz.engines.layout import RoutingLayout

WORKER = Path(__file__).resolve().parents[2] / "moeviz" / "engines" / "vllm_worker.py"

# "ok" (`fake_worker`): starts, then answers every capture with the routing of a JSON plan, written by the
# real worker's `write_capture`.

# A fake's common part: the protocol loop; `answer(request)` is the behaviour.
_HEAD = """
import json, os, sys, time
"""
_LOOP = """
protocol = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
def send(reply):
    protocol.write(json.dumps(reply) + "\\n")
    protocol.flush()
for line in sys.stdin:
    request = json.loads(line)
    if request["op"] == "stop":
        send({"ok": True})
        break
    send(answer(request))
"""

BEHAVIOURS = {
    # alive, silent: vLLM stuck loading (the driver's timeout must stop it)
    "hang": """
def answer(request):
    print("loading weights: shard 1 of 1", file=sys.stderr, flush=True)
    time.sleep(600)
""",
    # dies mid-start with a traceback on stderr
    "crash": """
def answer(request):
    print("Traceback (most recent call last):", file=sys.stderr)
    print("RuntimeError: boom in the engine core", file=sys.stderr, flush=True)
    os._exit(3)
""",
    # vLLM's refusal of a model, over several lines (the driver must fold it into one)
    "refuse-model": """
def answer(request):
    return {"ok": False, "kind": "model", "error": "vLLM 0.32.0 cannot run " + request["model"]
            + ": ValueError: Model architectures ['NopeForCausalLM'] are not supported\\nfor now."}
""",
}

_OK = """
import importlib.util
import numpy as np
spec = importlib.util.spec_from_file_location("real_worker", {worker!r})
real = importlib.util.module_from_spec(spec)
spec.loader.exec_module(real)
PLAN = json.loads({plan!r})
def answer(request):
    if request["op"] == "start":
        send({{"stage": "starting the fake engine"}})
        return {{"ok": True, "meta": PLAN["meta"], "import_s": 0.1, "engine_start_s": 0.2}}
    arrays, sequences = {{}}, []
    for i, prompt in enumerate(request["prompts"]):
        experts = np.asarray(PLAN["experts"][i], np.int32)
        arrays[f"s{{i}}.token_ids"] = np.asarray(prompt, np.int64)
        arrays[f"s{{i}}.experts"] = experts
        arrays[f"s{{i}}.weights"] = np.full(experts.shape, 0.5, np.float32)
        sequences.append({{"prompt_len": len(prompt), "generated": 0}})
        send({{"stage": f"sequence {{i + 1}}/{{len(request['prompts'])}}"}})
    real.write_capture(request["out"], {{**PLAN["meta"], "sequences": sequences}}, arrays)
    return {{"ok": True, "out": request["out"], "cpu_s": 0.0, "wall_s": 0.0, "sequences": sequences}}
"""


def fake_layout(
    folder: Path, *, hidden: int = 2, moe: tuple[int, ...] = (0, 1), experts: int = 4, k: int = 2
):
    """A RoutingLayout by hand (no config.json): `hidden` layers, MoE at `moe`, `experts` experts, top-`k`;
    no tokenizer."""
    layout = RoutingLayout(
        source="fake",
        folder=folder,
        model_type="mixtral",
        architecture="MixtralForCausalLM",
        num_hidden_layers=hidden,
        moe_layers=moe,
        num_experts=experts,
        top_k=k,
        score_fn="softmax",
        vocab_size=64,
    )
    layout._tokenizer.append(None)  # no tokenizer, known without loading one
    return layout


def worker_meta(layout: RoutingLayout, **changes) -> dict:
    """The `meta` the real worker sends for `layout` on the capture-fn path (vLLM 0.32.0, CPU, float32)."""
    meta = {
        "format": "moeviz.vllm-capture",
        "version": 1,
        "vllm": "0.32.0",
        "torch": "2.13.0+cpu",
        "path": "capture-fn",
        "dtype": "float32",
        "platform": "cpu",
        "layers": list(layout.moe_layers),
        "modules": [f"model.layers.{i}.block_sparse_moe.experts" for i in layout.moe_layers],
        "num_experts": layout.num_experts,
        "top_k": layout.top_k,
        "settings": {"dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False},
    }
    return {**meta, **changes}


def fake_worker(folder: Path, behaviour: str, *, meta: dict | None = None, experts=None) -> Path:
    """A fake worker script in `folder`. "ok" needs `meta` (what the start reply says) and `experts`
    (per sequence, the [R, M, k] ids every capture answers with)."""
    if behaviour == "ok":
        plan = json.dumps({"meta": meta, "experts": experts})
        body = _OK.format(worker=str(WORKER), plan=plan)
    else:
        body = BEHAVIOURS[behaviour]
    script = folder / f"fake_worker_{behaviour}.py"
    script.write_text(_HEAD + textwrap.dedent(body) + _LOOP, encoding="utf-8")
    return script
