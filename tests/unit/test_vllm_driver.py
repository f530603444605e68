"""The vLLM driver (moeviz/engines/vllm.py) and its worker's checks, without vLLM: the environment missing or
broken, a worker that hangs, crashes or refuses, the protocol with a fake worker, the worker's own refusals
(no capture seam, a schedule it cannot map, a router bypassed, impossible ids), the capture file's checks, and
the GPU branch's decoding of `CompletionOutput.routed_experts` as vLLM 0.32 returns it. Real vLLM:
tests/system/test_vllm_capture.py."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import numpy as np
import pytest

from moeviz.engines import vllm_worker
from moeviz.engines.vllm import VllmError, VllmSession, read_capture, vllm_environment
from moeviz.errors import EngineFormatError, InputError
from tests.support.vllm_worker_fakes import WORKER, fake_layout, fake_worker, worker_meta


def session(tmp_path, **kwargs) -> VllmSession:
    kwargs.setdefault("python", sys.executable)
    return VllmSession("fake", layout=fake_layout(tmp_path), **kwargs)


# ---- the environment ------------------------------------------------------------------------------------
def test_missing_environment_names_the_install_command(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere" / "bin" / "python"
    monkeypatch.setenv("MOEVIZ_VLLM_PYTHON", str(missing))
    env = vllm_environment()
    assert env.python == missing and not env.present
    with pytest.raises(VllmError, match=r"vLLM environment is missing .*install it with `make vllm`"):
        session(tmp_path, python=None).start()


def test_broken_environment_without_vllm_is_refused_with_the_import_error(tmp_path):
    # moeviz's own venv never has vLLM (it pins another transformers): the real worker cannot import it
    assert importlib.util.find_spec("vllm") is None
    with pytest.raises(VllmError) as caught:
        session(tmp_path).start()
    message = str(caught.value)
    assert "is broken (import vllm failed: ModuleNotFoundError: No module named 'vllm')" in message
    assert "rebuild it with `make vllm`" in message and "\n" not in message


def test_environment_whose_python_cannot_run_is_refused(tmp_path):
    fake = tmp_path / "python"
    fake.write_bytes(b"\x7fELF not really")
    fake.chmod(0o755)
    with pytest.raises(VllmError, match=r"cannot run the worker .*rebuild it with `make vllm`"):
        session(tmp_path, python=fake).start()


# ---- a worker that fails ----------------------------------------------------------------------------------
def test_hanging_worker_is_stopped_at_the_timeout_with_its_stderr_tail(tmp_path):
    s = session(tmp_path, worker=fake_worker(tmp_path, "hang"), start_timeout=2)
    began = time.monotonic()
    with pytest.raises(VllmError) as caught:
        s.start()
    assert time.monotonic() - began < 20
    message = str(caught.value)
    assert "did not answer within 2 s while starting the engine: stopped it" in message
    assert "loading weights: shard 1 of 1" in message and "\n" not in message
    assert s._process is None


def test_crashing_worker_reports_its_exit_code_and_stderr_tail(tmp_path):
    with pytest.raises(VllmError) as caught:
        session(tmp_path, worker=fake_worker(tmp_path, "crash")).start()
    message = str(caught.value)
    assert "exited with code 3 while starting the engine" in message
    assert "RuntimeError: boom in the engine core" in message and "\n" not in message


def test_model_vllm_cannot_run_is_one_line_of_vllms_message(tmp_path):
    with pytest.raises(VllmError) as caught:
        session(tmp_path, worker=fake_worker(tmp_path, "refuse-model")).start()
    assert str(caught.value) == (
        f"vLLM 0.32.0 cannot run {tmp_path}: ValueError: Model architectures ['NopeForCausalLM'] are not "
        "supported for now."
    )


def test_worker_whose_layers_disagree_with_the_config_is_refused(tmp_path):
    layout = fake_layout(tmp_path)
    meta = worker_meta(layout, layers=[0])
    script = fake_worker(tmp_path, "ok", meta=meta, experts=[])
    with pytest.raises(
        VllmError, match=r"vLLM routes layers \[0\] of fake, its config's MoE layers are \[0, 1\]"
    ):
        VllmSession("fake", layout=layout, python=sys.executable, worker=script).start()


# ---- the protocol, with a fake worker --------------------------------------------------------------------
def test_capture_through_a_fake_worker_returns_the_ids_it_wrote(tmp_path):
    layout = fake_layout(tmp_path)
    rng = np.random.default_rng(0)
    # per sequence [R, M, k]: k distinct experts of 4 per token and layer
    encoded = [np.stack([rng.permutation(4)[:2] for _ in range(n * 2)]).reshape(n, 2, 2) for n in (5, 3)]
    script = fake_worker(tmp_path, "ok", meta=worker_meta(layout), experts=[e.tolist() for e in encoded])
    heard: list[str] = []
    with VllmSession("fake", layout=layout, python=sys.executable, worker=script, progress=heard.append) as s:
        trace = s.capture([[5, 6, 7, 8, 9], [10, 11, 12]])
        process = s._process
    assert process.poll() is not None  # stopped on leaving the block
    assert "starting the fake engine" in heard and "sequence 2/2" in heard
    assert any(message.startswith("vLLM 0.32.0 started in") for message in heard)
    assert trace.tokens["token_id"].tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    for m, layer in enumerate(trace.layers):
        assert layer.decision_source == "vllm" and not layer.ranked and layer.has_weights
        assert np.array_equal(layer.experts, np.concatenate([e[:, m] for e in encoded]))
    assert trace.model.dtype == "float32" and "vLLM 0.32.0" in trace.model.notes[0]


def test_token_ids_outside_the_vocabulary_are_refused_before_vllm_runs(tmp_path):
    with pytest.raises(InputError, match=r"sequence 0 holds token id 64, outside \[0, 64\)"):
        session(tmp_path, python=tmp_path / "absent").run([[1, 64]])


# ---- the worker's own refusals (its functions, in this venv: it imports vLLM only when it runs) ------------
class _Router:
    top_k, global_num_experts = 2, 4


class _Module:
    def __init__(self, router) -> None:
        self.router = router


class _Model:
    def __init__(self, modules: dict) -> None:
        self.modules = modules

    def named_modules(self):
        return iter(self.modules.items())


def test_worker_refuses_a_router_without_the_capture_seam_naming_the_version():
    class OldRouter(_Router):  # a router of a vLLM before set_capture_fn
        def _compute_routing(self, *args):
            raise AssertionError

    model = _Model({"model.layers.0.mlp.experts": _Module(OldRouter())})
    with pytest.raises(
        vllm_worker.Refusal,
        match=r"vLLM 0\.19\.0: the router of model\.layers\.0\.mlp\.experts "
        r"\(OldRouter\) has no set_capture_fn",
    ):
        vllm_worker._seam(model, "0.19.0")


def test_worker_refuses_a_model_without_fused_moe_layers():
    with pytest.raises(vllm_worker.Refusal, match=r"vLLM 0\.32\.0 found no fused-MoE layer .*dense model"):
        vllm_worker._seam(_Model({"model.layers.0.mlp": _Module(None)}), "0.32.0")


def _seam_with(forwards, rows, k=2, e=4):
    seam = vllm_worker.Seam([(0, "model.layers.0.mlp.experts", None)], e, k)
    seam.forwards = forwards
    seam.rows = [[(np.asarray(r, np.int32), None, None) for r in rows]]
    return seam


def test_worker_refuses_forwards_that_are_not_the_sequence_in_order():
    ids = np.array([7, 8, 9])
    ok = [[0, 1], [2, 3], [1, 3]]
    # the second forward re-ran position 1 (e.g. another request's tokens interleaved)
    seam = _seam_with([(ids[:2], np.array([0, 1])), (ids[2:], np.array([1]))], [ok[:2], ok[2:]])
    with pytest.raises(vllm_worker.Refusal, match=r"vLLM ran 3 tokens in 2 forwards .*positions 0…2"):
        vllm_worker._sequence_arrays(seam, 0, ids.tolist(), "0.32.0")
    good = _seam_with([(ids[:2], np.array([0, 1])), (ids[2:], np.array([2]))], [ok[:2], ok[2:]])
    arrays = vllm_worker._sequence_arrays(good, 0, ids.tolist(), "0.32.0")
    assert arrays["s0.experts"][:, 0].tolist() == ok


def test_worker_refuses_a_layer_whose_router_was_bypassed():
    ids = np.array([7, 8, 9])
    seam = _seam_with([(ids[:2], np.array([0, 1])), (ids[2:], np.array([2]))], [[[0, 1], [2, 3]]])
    with pytest.raises(vllm_worker.Refusal, match=r"called the router's capture 1 times in 2 forwards"):
        vllm_worker._sequence_arrays(seam, 0, ids.tolist(), "0.32.0")


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([[0, 0], [0, 0]], r"every captured id is 0 \(the router was bypassed\?\)"),
        ([[0, 1], [3, 3]], r"position 1: ids \[3, 3\] are not 2 distinct experts in \[0, 4\)"),
        ([[0, 4], [1, 2]], r"position 0: ids \[0, 4\] are not 2 distinct experts in \[0, 4\)"),
    ],
)
def test_worker_refuses_impossible_ids(rows, message):
    ids = np.array([7, 8])
    seam = _seam_with([(ids, np.array([0, 1]))], [rows])
    with pytest.raises(vllm_worker.Refusal, match=message):
        vllm_worker._sequence_arrays(seam, 0, ids.tolist(), "0.32.0")


# ---- the capture file -------------------------------------------------------------------------------------
def _write(tmp_path, meta, arrays):
    out = tmp_path / "capture.npz"
    vllm_worker.write_capture(str(out), meta, arrays)
    return out


def test_file_of_another_version_or_format_is_refused(tmp_path):
    layout = fake_layout(tmp_path)
    for change, message in (
        ({"version": 2}, "version 2; this moeviz reads version 1"),
        ({"format": "x"}, "'x'"),
    ):
        path = _write(tmp_path, {**worker_meta(layout), **change, "sequences": []}, {})
        with pytest.raises(EngineFormatError, match=message):
            read_capture(path, layout)
    (tmp_path / "pickled.npz").write_bytes(b"PK not a zip")
    with pytest.raises(EngineFormatError, match="not a vLLM capture file"):
        read_capture(tmp_path / "pickled.npz", layout)


def test_file_with_all_zero_ids_is_refused_by_the_driver_too(tmp_path):
    layout = fake_layout(tmp_path)
    meta = {**worker_meta(layout), "sequences": [{"prompt_len": 3, "generated": 0}]}
    arrays = {"s0.token_ids": np.array([1, 2, 3]), "s0.experts": np.zeros((3, 2, 2), np.int32)}
    with pytest.raises(EngineFormatError, match="all-zero"):
        read_capture(_write(tmp_path, meta, arrays), layout)


# ---- the GPU branch: CompletionOutput.routed_experts as vLLM 0.32 returns it -------------------------------
def _routed_experts(rng, rows: int, hidden: int, moe: tuple[int, ...], e: int, k: int, dtype) -> np.ndarray:
    """[rows, hidden, k] as vLLM 0.32's RoutedExpertsCapturer fills it: every hidden layer, dense layers 0
    (the zeroed buffer), `uint8` when E ≤ 256 (`output_dtype_name`)."""
    out = np.zeros((rows, hidden, k), dtype)
    for layer in moe:
        out[:, layer] = np.stack([rng.permutation(e)[:k] for _ in range(rows)])
    return out


def test_gpu_branch_decodes_routed_experts_with_the_importers_code(tmp_path):
    layout = fake_layout(
        tmp_path, hidden=4, moe=(1, 2, 3), experts=16, k=4
    )  # DeepSeek-V3-like: layer 0 dense
    rng = np.random.default_rng(1)
    prompt, generated = [3, 4, 5, 6, 7, 8], [9, 10, 11]
    routed = _routed_experts(rng, len(prompt) + len(generated) - 1, 4, (1, 2, 3), 16, 4, np.uint8)
    meta = {
        **worker_meta(layout, path="routed-experts", platform="gpu", dtype="bfloat16", layers=[]),
        "sequences": [{"prompt_len": 6, "generated": 3}],
    }
    arrays = {"s0.token_ids": np.array(prompt + generated), "s0.routed_experts": routed}
    trace = read_capture(_write(tmp_path, meta, arrays), layout)
    tokens = trace.tokens
    assert tokens["token_id"].tolist() == prompt + generated
    assert tokens["phase"].tolist() == ["prompt"] * 6 + ["generated"] * 3
    assert [layer.layer for layer in trace.layers] == [1, 2, 3]
    for layer in trace.layers:
        assert layer.decision_source == "vllm" and layer.ranked and not layer.has_weights
        assert np.array_equal(layer.experts, routed[:, layer.layer])  # the last token has no row
    assert trace.model.device == "cuda" and trace.model.dtype == "bfloat16"


def test_gpu_branch_refuses_the_all_zero_arrays_of_router_bypassing_kernels(tmp_path):
    layout = fake_layout(tmp_path, hidden=4, moe=(1, 2, 3), experts=16, k=4)
    meta = {**worker_meta(layout, path="routed-experts"), "sequences": [{"prompt_len": 5, "generated": 0}]}
    arrays = {"s0.token_ids": np.arange(5), "s0.routed_experts": np.zeros((5, 4, 4), np.uint8)}
    with pytest.raises(EngineFormatError, match="54730"):
        read_capture(_write(tmp_path, meta, arrays), layout)


def test_worker_file_holds_no_pickled_member(tmp_path):
    layout = fake_layout(tmp_path)
    meta = {**worker_meta(layout), "sequences": [{"prompt_len": 2, "generated": 0}]}
    path = _write(
        tmp_path, meta, {"s0.token_ids": np.array([1, 2]), "s0.experts": np.ones((2, 2, 2), np.int32)}
    )
    with np.load(path, allow_pickle=False) as archive:  # raises on an object member
        assert json.loads(bytes(archive["meta"]))["format"] == "moeviz.vllm-capture"
        assert {archive[name].dtype.kind for name in archive.files} <= set("iuf")


def test_worker_script_imports_nothing_of_moeviz():
    source = WORKER.read_text(encoding="utf-8")
    assert "import moeviz" not in source and "from moeviz" not in source
    assert os.access(WORKER, os.R_OK)
