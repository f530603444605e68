"""The prompt form (app/components/prompt.py) after a refused file: the message stays up and an Analyse
press analyses nothing until the input changes. Driven in-process (Streamlit AppTest,
whose file uploader takes files as the server receives them); tests/browser/test_app_browser_inputs.py
covers a file the browser itself uploads."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.support.app import app_test_env

EXAMPLE_BOX = "first prompt"


def _form_page() -> None:
    import streamlit as st
    from components.prompt import prompt_form

    prompt = prompt_form()
    st.session_state["submitted"] = [*st.session_state.get("submitted", []), prompt]
    st.write(f"PROMPT={prompt!r}")


@pytest.fixture
def form(monkeypatch) -> AppTest:
    app_test_env(monkeypatch)
    at = AppTest.from_function(_form_page, default_timeout=30)
    at.session_state["prompt"] = EXAMPLE_BOX
    at.run()
    assert not at.exception
    return at


def _analyse(at: AppTest) -> None:
    at.button[0].click().run()
    assert not at.exception, [e.value for e in at.exception]


def _errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def _upload(at: AppTest, name: str, data: bytes) -> None:
    at.file_uploader[0].set_value((name, data, "application/octet-stream"))


@pytest.mark.parametrize(
    ("name", "data", "says"),
    [
        ("picture.png", b"\x89PNG\r\n\x1a\n" + bytes(100), "picture.png is not a text file"),
        ("big.txt", b"a" * ((1 << 20) + 1), "big.txt has 1,048,577 bytes"),
        ("latin1.txt", "caf\xe9".encode("latin-1"), "latin1.txt is not UTF-8"),
    ],
)
def test_a_refused_file_keeps_its_message_until_the_input_changes(form: AppTest, name, data, says) -> None:
    at = form
    at.text_area(key="routing_prompt").input("typed, meant to be replaced by the file")
    _upload(at, name, data)
    _analyse(at)
    assert len(_errors(at)) == 1 and says in _errors(at)[0]
    assert at.session_state["prompt"] == EXAMPLE_BOX  # nothing was analysed ...
    assert (
        at.text_area(key="routing_prompt").value == "typed, meant to be replaced by the file"
    )  # ... nor lost

    # Analyse again, input unchanged (the refused file is gone from the uploader): still nothing analysed
    _analyse(at)
    assert len(_errors(at)) == 1 and says in _errors(at)[0]
    assert at.session_state["prompt"] == EXAMPLE_BOX
    _analyse(at)
    assert at.session_state["prompt"] == EXAMPLE_BOX and says in _errors(at)[0]

    # an edit of the box is a new input: it is analysed and the message goes
    at.text_area(key="routing_prompt").input("an edited prompt")
    _analyse(at)
    assert _errors(at) == []
    assert at.session_state["prompt"] == "an edited prompt"


def test_a_new_file_after_a_refused_one_is_taken(form: AppTest) -> None:
    at = form
    _upload(at, "picture.png", b"\x89PNG" + bytes(10))
    _analyse(at)
    assert _errors(at) and at.session_state["prompt"] == EXAMPLE_BOX
    _upload(at, "prompt.txt", b"the text of the file")
    _analyse(at)
    assert _errors(at) == []
    assert at.session_state["prompt"] == "the text of the file"
    assert at.text_area(key="routing_prompt").value == "the text of the file"


def test_the_form_decision(monkeypatch) -> None:
    app_test_env(monkeypatch)
    from components.prompt import submitted_prompt

    assert submitted_prompt("box", None, None) == "box"
    assert submitted_prompt("box", ("a.txt", b"file"), None) == "file"
    assert submitted_prompt("box", None, "box") is None  # the refusal stands: nothing to analyse
    assert submitted_prompt("edited", None, "box") == "edited"
    assert submitted_prompt("box", ("a.txt", b"file"), "box") == "file"
    with pytest.raises(ValueError, match=r"a\.png is not a text file"):
        submitted_prompt("box", ("a.png", b"x"), None)
