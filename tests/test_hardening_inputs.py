"""Hardening of the inputs (issue 15): a huge text is refused by its size before it is tokenised (item 8),
non-finite router scores are warned about in the library, the CLI and the app (item 10), and the app's
upload limit is the documented 1 MiB (item 12)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import warnings

import pytest
import torch
from streamlit.testing.v1 import AppTest

import moeviz
from moeviz.capture.forward import RoutingWarning
from moeviz.errors import PromptTooLongError
from tests.app_helpers import REPO, app_test_env, run_page

# A tokenizer for the tiny models: the sample's BPE (2,048 ids), so the model gets that vocabulary too.
TOKENIZER = REPO / "sample_models" / "mixtral-healthy"
CONTEXT = 512  # the tiny models' max_position_embeddings


def _with_tokenizer(folder):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def tiny_text_model(tiny_model_dir):
    return moeviz.load_model(str(_with_tokenizer(tiny_model_dir("mixtral", vocab_size=2048))))


# ---- item 8: too-long inputs ----------------------------------------------------------------------------
def test_a_huge_text_is_refused_by_size_before_tokenising(tiny_text_model) -> None:
    text = "the quick brown fox jumps over the lazy dog. " * 450_000  # ~20 MB
    assert len(text) > 20_000_000
    start = time.perf_counter()
    with pytest.raises(PromptTooLongError, match=f"exceeds the model's context length of {CONTEXT} tokens"):
        moeviz.capture(tiny_text_model, text)
    assert time.perf_counter() - start < 2.0


def test_a_short_text_too_long_has_the_same_error(tiny_text_model) -> None:
    text = "the quick brown fox jumps over the lazy dog. " * 100  # ~1,000 tokens, 4,500 characters
    with pytest.raises(PromptTooLongError, match=f"exceeds the model's context length of {CONTEXT} tokens"):
        moeviz.capture(tiny_text_model, text)


def test_a_text_just_under_the_context_is_captured(tiny_text_model) -> None:
    tokenizer = tiny_text_model.tokenizer
    ids = tokenizer("the quick brown fox jumps over the lazy dog. " * 100)["input_ids"]
    text = tokenizer.decode(ids[: CONTEXT - 4], skip_special_tokens=True)
    n = len(tokenizer(text)["input_ids"])
    assert CONTEXT - 10 < n <= CONTEXT
    trace = moeviz.capture(tiny_text_model, text)
    assert len(trace.tokens) == n


# ---- item 10: non-finite router scores ------------------------------------------------------------------
def _poison(model: torch.nn.Module) -> None:
    """One router weight of MoE layer 1 (the last) set to NaN."""
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight[0, 0] = float("nan")


@pytest.fixture(scope="module")
def nan_folder(tmp_path_factory):
    from moeviz.testing.tiny_models import build_tiny_model

    folder = tmp_path_factory.mktemp("nan_router")
    model = build_tiny_model("mixtral", vocab_size=2048)
    _poison(model)
    model.save_pretrained(folder)
    return _with_tokenizer(folder)


def test_library_warns_of_non_finite_router_scores(tiny_model_dir) -> None:
    loaded = moeviz.load_model(tiny_model_dir("mixtral"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RoutingWarning)
        moeviz.capture(loaded, token_ids=[[5, 6, 7]])  # finite: no warning
    _poison(loaded.model)
    with pytest.warns(RoutingWarning, match="not finite") as record:
        moeviz.capture(loaded, token_ids=[[5, 6, 7]])
    (message,) = [str(w.message) for w in record if w.category is RoutingWarning]
    assert "layer 1" in message and "layer 0" not in message


CLI_INPUT = ("--token-ids", "5,6,7", "--out")


def test_cli_capture_prints_the_warning(nan_folder, tmp_path) -> None:
    out = tmp_path / "t.parquet"
    result = subprocess.run(
        [sys.executable, "-m", "moeviz.cli", "capture", "--model", str(nan_folder), *CLI_INPUT, str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("moeviz: warning:")]
    assert len(lines) == 1 and "not finite" in lines[0] and "layer 1" in lines[0], result.stderr
    assert "not finite" not in result.stdout


def test_routing_page_shows_the_warning(nan_folder, monkeypatch) -> None:
    app_test_env(monkeypatch)
    monkeypatch.setenv("MOEVIZ_DEFAULT_MODEL", str(nan_folder))  # opened as a local folder ...
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(nan_folder.parent))  # ... from an allowed root
    at = run_page("pages/routing.py", timeout_s=120)
    shown = [w.value for w in at.warning if "not finite" in w.value]
    assert len(shown) == 1 and "layer 1" in shown[0], [w.value for w in at.warning]


# ---- item 12: the upload limit --------------------------------------------------------------------------
def test_server_upload_limit_is_above_one_mib() -> None:
    """`server.maxUploadSize` is in MB: the server multiplies it by 2**20, the browser by 10**6 (2**20 on
    Windows) and refuses a larger file itself, before the form could say why. So the limit must let a file
    of 1 MiB + 1 byte through, for the form to refuse it with its own message."""
    from moeviz.cli import APP_FLAGS

    flags = list(APP_FLAGS)
    megabytes = int(flags[flags.index("--server.maxUploadSize") + 1])
    assert min(megabytes * 10**6, megabytes * 2**20) > (1 << 20) + 1


def _form_page() -> None:
    import streamlit as st
    from components.prompt import prompt_form

    st.write(f"PROMPT LENGTH={len(prompt_form())}")


@pytest.mark.parametrize(("size", "accepted"), [(1 << 20, True), ((1 << 20) + 1, False)])
def test_the_form_takes_one_mib_and_refuses_more(monkeypatch, size, accepted) -> None:
    app_test_env(monkeypatch)
    at = AppTest.from_function(_form_page, default_timeout=30)
    at.session_state["prompt"] = "first prompt"
    at.run()
    at.file_uploader[0].set_value(("big.txt", b"a" * size, "text/plain"))
    at.button[0].click().run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    if accepted:
        assert errors == [] and at.session_state["prompt"] == "a" * size
    else:
        assert errors == [f"big.txt has {size:,} bytes; prompt files may have at most 1,048,576 (1 MiB)"]
        assert at.session_state["prompt"] == "first prompt"
