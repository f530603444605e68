"""The Engines page's "run this model in vLLM" source (Streamlit AppTest) with real vLLM (the `.venv-vllm`
that `make vllm` builds; `make test` builds it, so these tests run, never skip): A = the sidebar model run
in vLLM at float32 against B = moeviz's transformers capture at float32 shows what `engine_diff` of
`capture_vllm` and `moeviz.capture` of the same token ids says — no expert set differs — with vLLM's
progress while it starts; a second prompt reuses the running engine; a model vLLM cannot run shows vLLM's
one-line message (no traceback) and can be run again; without the vLLM environment the option is listed and
the page says how to install it.

vLLM starts twice in this module: once for the reference (`capture_vllm`, apart from the app) and once in
the app's shared worker, which the page tests then share (~15 s each after the first import of vLLM)."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import ClassVar

import pytest
from streamlit.testing.v1 import AppTest

import moeviz
from moeviz.analysis.engine_diff import engine_diff
from moeviz.engines.vllm import capture_vllm, vllm_environment
from moeviz.samples import eval_dir
from tests.support.app import APP, app_test_env, run_page

PAGE = "pages/engines.py"
MODEL = "sample:mixtral-healthy"
REFUSED = (
    "sample:deepseek-v3-bias"  # vLLM 0.32.0 cannot load its checkpoint (tests/system/test_vllm_capture.py)
)
TIMEOUT_S = 600  # a cold import of vLLM takes a minute or more on a shared CI machine
VLLM_A = {"engines_a_kind": "vllm", "engines_a_dtype": "float32", "engines_b_dtype": "float32"}


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


@pytest.fixture(scope="module", autouse=True)
def _stop_the_apps_vllm():
    """The app's vLLM worker lives as long as the server (here: the test process); stop it after the
    module."""
    yield
    module = sys.modules.get("components.vllm_source")
    if module is not None:
        module.runner().close()


@pytest.fixture(scope="module")
def text() -> str:
    """About 200 tokens of English prose and Python code (the evaluation slices)."""
    return "".join(
        (eval_dir() / f"{name}.txt").read_text(encoding="utf-8")[:400] for name in ("english", "python")
    )


@pytest.fixture(scope="module")
def expected(text):
    """(token ids of `text` by the sample's tokenizer, engine_diff(vLLM at fp32, transformers at fp32) of
    those ids), apart from the app."""
    env = vllm_environment()
    if not env.present:  # CI builds it (`make test` → `make vllm`): a missing one fails, never skips
        pytest.fail(env.message)
    ids = moeviz.load_model(MODEL).tokenizer(text)["input_ids"]
    dispatched = capture_vllm(MODEL, token_ids=[ids], dtype="float32")
    computed = moeviz.capture(moeviz.load_model(MODEL, dtype="float32"), token_ids=[ids])
    return ids, engine_diff(dispatched, computed)


def texts_in_status(at) -> list[str]:
    return [t.value for status in at.status for t in status.text]


def test_vllm_against_transformers_at_fp32_is_the_librarys_diff(text, expected) -> None:
    ids, diff = expected
    assert diff.mismatched == 0 and diff.pairs == 4 * len(ids) > 600  # every MoE layer, every token
    at = run_page(PAGE, timeout_s=TIMEOUT_S, prompt=text, **VLLM_A)
    kinds = at.selectbox(key="engines_a_kind_widget")
    assert kinds.value == "vllm" and {"run this model in vLLM", "capture this model"} <= set(kinds.options)

    # vLLM's progress while it started, then the status collapsed
    (status,) = at.status
    assert status.state == "complete" and status.label.startswith("vLLM ran the prompt at float32")
    shown = texts_in_status(at)
    assert shown[0].startswith("starting vLLM") and "importing vLLM" in shown
    assert any(t.startswith("vLLM 0.32.0 started in") for t in shown) and shown[-1] == "sequence 1/1"

    # the verdict: the library's, on the same tokens
    verdict = " ".join(e.value for e in [*at.success, *at.info])
    assert f"**0 of {diff.pairs:,} (token, layer) differ**" in verdict
    if diff.identical:
        assert "identical routing" in verdict
    else:  # vLLM's router logits are not bitwise transformers': the sets agree, the logits do not
        assert not diff.layers["logits_equal"].any()
        assert "the expert sets agree everywhere" in verdict and "the router logits differ" in verdict
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Router mismatch"] == "0.00%" and metrics["Mean Jaccard"] == "1.0000"
    assert metrics["Top-1 mismatch"] == "–"  # vLLM's slots are in the order it dispatched, not ranked
    (layers,) = [d.value for d in at.dataframe if "router_mismatch" in d.value and "kl" in d.value]
    assert layers["layer"].tolist() == diff.layers["layer"].tolist()
    assert layers["pairs"].tolist() == [len(ids)] * 4 and layers["mismatched"].tolist() == [0] * 4
    for column in ("kl", "tv"):  # the logits of two runs of one vLLM engine on the same ids
        assert layers[column].to_numpy() == pytest.approx(diff.layers[column].to_numpy(), rel=1e-6, abs=1e-12)
    captions = " ".join(c.value for c in at.caption)
    assert "A: this model in vLLM at float32 (vllm · sample:mixtral-healthy · float32 · cpu)" in captions
    assert "B: this model at float32" in captions and "aligned by token ids" in captions
    assert "A lists each token's experts in the order vLLM dispatched them" in captions

    # the app's vLLM side tokenised the prompt as the reference did
    from components import vllm_source

    job = vllm_source.runner().request(MODEL, "float32", text)
    assert job.outcome.done() and job.outcome.result().tokens["token_id"].tolist() == ids

    # another prompt: the running engine captures it (no new start)
    at.session_state["prompt"] = text[:200]
    at.run(timeout=TIMEOUT_S)
    assert not at.exception and not at.error
    assert texts_in_status(at) == ["sequence 1/1"]
    assert "(token, layer) differ" in " ".join(e.value for e in [*at.success, *at.info])


def test_a_model_vllm_cannot_run_says_vllms_message_in_one_line() -> None:
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    for key, value in {**VLLM_A, "model": REFUSED}.items():
        at.session_state[key] = value
    at.switch_page(PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    (error,) = [e.value for e in at.error]
    assert error.startswith("vLLM 0.32.0 cannot run") and "e_score_correction_bias" in error
    assert "\n" not in error and "Traceback" not in error
    (status,) = at.status
    assert status.state == "error" and status.label == "vLLM could not run the prompt at float32"
    assert not at.metric  # the page stopped at A

    # the refusal is kept (a rerun does not start vLLM again) until "Try vLLM again"
    at.run()
    assert not at.status and [e.value for e in at.error] == [error]
    at.button(key="engines_a_vllm_retry").click().run()
    assert not at.exception
    (status,) = at.status
    assert status.state == "error" and [e.value for e in at.error] == [error]


def test_without_the_vllm_environment_the_page_says_how_to_install_it(tmp_path, monkeypatch) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    monkeypatch.setenv("MOEVIZ_VLLM_PYTHON", str(missing))
    at = run_page(PAGE, timeout_s=TIMEOUT_S, **VLLM_A)
    kinds = at.selectbox(key="engines_a_kind_widget")
    assert kinds.value == "vllm" and "run this model in vLLM" in kinds.options  # still listed
    (warning,) = [w.value for w in at.warning]
    assert f"A cannot run yet: the vLLM environment is missing ({missing} not found)" in warning
    assert "install it with `make vllm`" in warning and "MOEVIZ_VLLM_PYTHON" in warning
    assert not at.status and not at.metric  # nothing started, the page stopped at A


class CountingSession:
    """A stand-in for `VllmSession` that records its engine starts and how many captures ran at once."""

    lock = threading.Lock()
    running = peak = 0
    starts: ClassVar[list[tuple[str, str]]] = []
    captured: ClassVar[list[str]] = []

    def __init__(self, model: str, *, dtype: str, progress) -> None:
        self.progress = progress

    def switch(self, model: str, *, dtype: str) -> None:
        self.progress(f"starting {model} at {dtype}")
        type(self).starts.append((model, dtype))

    def capture(self, *, texts: str) -> str:
        cls = type(self)
        with cls.lock:
            cls.running += 1
            cls.peak = max(cls.peak, cls.running)
        time.sleep(0.05)
        with cls.lock:
            cls.running -= 1
            cls.captured.append(texts)
        return f"trace of {texts}"

    def close(self) -> None:
        pass


def test_the_shared_runner_captures_one_at_a_time_and_each_request_once() -> None:
    """Eight sessions at once: vLLM never runs two captures (or engines) together, a (model, dtype, text)
    asked for by several is captured once, and an engine starts only when the model or dtype changes."""
    from components.vllm_source import VllmRunner

    runner = VllmRunner(session=CountingSession)
    asks = [("m1", "float32", "x"), ("m1", "float32", "y"), ("m2", "float16", "x")] * 2 + [
        ("m1", "float32", "x")
    ] * 2
    with ThreadPoolExecutor(len(asks)) as sessions:
        jobs = list(sessions.map(lambda ask: runner.request(*ask), asks))
        traces = [job.outcome.result(timeout=30) for job in jobs]
    assert traces == [f"trace of {text}" for _, _, text in asks]
    assert CountingSession.peak == 1
    assert sorted(CountingSession.captured) == ["x", "x", "y"]  # three distinct requests, each captured once
    starts = CountingSession.starts  # an engine starts only for another model or dtype than the running one
    assert 2 <= len(starts) <= 3 and all(before != after for before, after in pairwise(starts))
    assert runner.request("m1", "float32", "y").outcome.result() == "trace of y"  # kept
    assert sorted(CountingSession.captured) == ["x", "x", "y"]
    runner.close()
