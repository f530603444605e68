"""Set-up shared by the in-process page tests (Streamlit AppTest), and what the app's pages must show computed
apart from the app (the sample's KV cache by hand, the evaluation corpus routed as the pages route it), for
those tests and the browser's; test code, so `moeviz` stays free of Streamlit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parents[2]
APP_DIR = REPO / "app"
APP = APP_DIR / "streamlit_app.py"


def app_test_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment of an in-process page test: offline, no folder limits and no default model set,
    and `app/` importable as under `streamlit run` (see `app_importable`)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("MOEVIZ_MODEL_DIRS", "MOEVIZ_DEFAULT_MODEL", "MOEVIZ_STORE_DIRS"):
        monkeypatch.delenv(name, raising=False)
    app_importable(monkeypatch)


def captured_as(monkeypatch: pytest.MonkeyPatch, prompt: str, trace) -> None:
    """In an in-process page test (`app_test_env` first): the app's capture of `prompt` is `trace` (a
    synthetic trace at scale: no forward), for every model; any other prompt is captured as usual. A prompt
    of its own keeps the app's caches, keyed by (model, text), apart from every other test's."""
    from components import caches

    real = caches.captured

    def captured(source: str, text: str, progress=None):
        return trace if text == prompt else real(source, text, progress)

    monkeypatch.setattr(caches, "captured", captured)


def app_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put `app/` on `sys.path` as `streamlit run app/streamlit_app.py` does, so that the app's building
    blocks import as the pages import them (`from components import caches`)."""
    monkeypatch.syspath_prepend(str(APP_DIR))


def sample_page_fixtures(model: str):
    """The fixtures of a page test on one model, bound by name in the module (`_app_env, loaded =
    sample_page_fixtures(MODEL)`): `_app_env` (autouse: `app_test_env`) and `loaded` (`moeviz.load_model(
    model)`, once for the module: what the test computes apart from the app)."""

    @pytest.fixture(autouse=True)
    def _app_env(monkeypatch):
        app_test_env(monkeypatch)

    @pytest.fixture(scope="module")
    def loaded():
        import moeviz

        return moeviz.load_model(model)

    return _app_env, loaded


def local_switch_model(tiny_model_dir, monkeypatch: pytest.MonkeyPatch, capacity: int) -> Path:
    """A tiny Switch-style model whose expert capacity (`capacity` tokens per expert and sequence) drops
    slots, set up as the app's default model (`local_tiny_model`)."""
    return local_tiny_model(tiny_model_dir, monkeypatch, "switch_transformers", expert_capacity=capacity)


def local_tiny_model(tiny_model_dir, monkeypatch: pytest.MonkeyPatch, family: str, **overrides) -> Path:
    """A tiny model of `family` with the mixtral sample's BPE tokenizer (so the model gets its 2,048-id
    vocabulary too), set up as the app's default model: a local folder in an allowed root, in the environment
    of `app_test_env`."""
    import shutil

    folder = tiny_model_dir(family, vocab_size=2048, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "sample_models" / "mixtral-healthy" / name, folder / name)
    app_test_env(monkeypatch)
    monkeypatch.setenv("MOEVIZ_DEFAULT_MODEL", str(folder))  # opened as a local folder ...
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(folder.parent))  # ... from an allowed root
    return folder


def run_page(page: str, timeout_s: float = 60, **state) -> AppTest:
    """Run the app's `page` (Streamlit AppTest) with `state` set in its session first; asserts that it
    raised no exception and showed no error."""
    at = AppTest.from_file(str(APP), default_timeout=timeout_s)
    for key, value in state.items():
        at.session_state[key] = value
    at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert not errors, errors
    return at


def open_snippets(at: AppTest) -> AppTest:
    """`at` rerun with its page's "Reproduce in Python" expanders open (their code is built only while
    open, `share.reproduce`); there must be one, closed, with no code on the page."""
    keys = [key for key in at.session_state if key.startswith("reproduce_")]
    assert keys and not at.code, (keys, len(at.code))
    for key in keys:
        at.session_state[key] = True
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def expected_cache_bytes(tokens: int, window: int | None = None, global_tokens: int = 0) -> int:
    """Bytes of the mixtral sample's KV cache at `tokens` tokens, by hand (the Attention page's what-if):
    Σ over layers of 2 (K and V) · kv heads · head dim · kept tokens · bytes per element, from config.json.

    Every layer of the sample slides (config `sliding_window`, no `layer_types`): it keeps min(window, T)
    tokens; the what-if keeps at most W + G of those. Bytes per element: the loaded model's dtype (a
    float16 checkpoint loads as float32 on a CPU, so its cache there holds float32)."""
    import torch

    import moeviz

    config = json.loads((REPO / "sample_models" / "mixtral-healthy" / "config.json").read_text())
    assert "layer_types" not in config and config["sliding_window"] == 256
    kv_heads = config["num_key_value_heads"]
    head_dim = config["head_dim"] or config["hidden_size"] // config["num_attention_heads"]
    dtype = moeviz.load_model("sample:mixtral-healthy").info.dtype
    element = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    kept = min(config["sliding_window"], tokens)
    if window is not None:
        kept = min(kept, window + global_tokens)
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * kept * element


def corpus_trace(model: str):
    """The evaluation corpus routed through `model`, as the page's corpus toggle builds it."""
    import moeviz
    from moeviz.samples import DOMAINS, eval_batch

    loaded = moeviz.load_model(model)
    batch = eval_batch(loaded)
    parts = [
        moeviz.capture(
            loaded,
            token_ids=[ids for ids, d in zip(batch.token_ids, batch.domains, strict=True) if d == domain],
        )
        for domain in DOMAINS
    ]
    return moeviz.Trace.concat(parts)
