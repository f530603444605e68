"""Hardening of the inputs in the app: non-finite router scores are warned about on the Routing
page, and the upload limit is the documented 1 MiB. The library's size check and
warning: tests/models/test_hardening_inputs.py; the CLI's: tests/system/test_hardening_inputs_cli.py."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.support.app import app_test_env, run_page
from tests.support.nan_router import save_nan_router_model


@pytest.fixture(scope="module")
def nan_folder(tmp_path_factory):
    return save_nan_router_model(tmp_path_factory.mktemp("nan_router"))


# ---- non-finite router scores ---------------------------------------------------------------------------
def test_routing_page_shows_the_warning(nan_folder, monkeypatch) -> None:
    app_test_env(monkeypatch)
    monkeypatch.setenv("MOEVIZ_DEFAULT_MODEL", str(nan_folder))  # opened as a local folder ...
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(nan_folder.parent))  # ... from an allowed root
    at = run_page("pages/routing.py", timeout_s=120)
    shown = [w.value for w in at.warning if "not finite" in w.value]
    assert len(shown) == 1 and "layer 1" in shown[0], [w.value for w in at.warning]


# ---- the upload limit -----------------------------------------------------------------------------------
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
