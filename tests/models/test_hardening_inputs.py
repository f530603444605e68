"""Hardening of the inputs in the library: a huge text is refused by its size before it is
tokenised, and non-finite router scores are warned about. The app's and the CLI's side:
tests/app/test_hardening_inputs.py, tests/system/test_hardening_inputs_cli.py."""

from __future__ import annotations

import warnings

import pytest

import moeviz
from moeviz.capture.forward import RoutingWarning
from moeviz.errors import PromptTooLongError
from tests.support.nan_router import poison
from tests.support.scale_models import with_tokenizer

CONTEXT = 512  # the tiny models' max_position_embeddings


@pytest.fixture(scope="module")
def tiny_text_model(tiny_model_dir):
    """A tiny mixtral with the sample's BPE (2,048 ids, so the model gets that vocabulary too)."""
    return moeviz.load_model(str(with_tokenizer(tiny_model_dir("mixtral", vocab_size=2048))))


# ---- too-long inputs ------------------------------------------------------------------------------------
def test_a_huge_text_is_refused_by_size_before_tokenising(tiny_text_model, monkeypatch) -> None:
    text = "the quick brown fox jumps over the lazy dog. " * 450_000  # ~20 MB
    assert len(text) > 20_000_000

    def never(*args, **kwargs):
        raise AssertionError("the huge text was tokenised")

    monkeypatch.setattr(type(tiny_text_model.tokenizer), "__call__", never)
    monkeypatch.setattr(type(tiny_text_model.tokenizer), "encode", never)
    with pytest.raises(
        PromptTooLongError, match=f"exceeds the model's context length of {CONTEXT} tokens"
    ) as info:
        moeviz.capture(tiny_text_model, text)
    assert f"{len(text):,} characters" in str(info.value)  # refused by its size: its length is the reason


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


# ---- non-finite router scores ---------------------------------------------------------------------------
def test_library_warns_of_non_finite_router_scores(tiny_model_dir) -> None:
    loaded = moeviz.load_model(tiny_model_dir("mixtral"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RoutingWarning)
        moeviz.capture(loaded, token_ids=[[5, 6, 7]])  # finite: no warning
    poison(loaded.model)
    with pytest.warns(RoutingWarning, match="not finite") as record:
        moeviz.capture(loaded, token_ids=[[5, 6, 7]])
    (message,) = [str(w.message) for w in record if w.category is RoutingWarning]
    assert "layer 1" in message and "layer 0" not in message
