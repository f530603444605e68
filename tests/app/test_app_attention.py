"""The Attention page's KV-cache what-if (Streamlit AppTest): the cache sizes it shows, derived here by hand
from the sample model's config.json, on a prompt longer than the model's sliding window."""

from __future__ import annotations

import re

import pytest

from tests.support.app import app_test_env, expected_cache_bytes, run_page

MODEL = "sample:mixtral-healthy"
# ~14 copies of a 28-token sentence: longer than the sample's sliding window of 256 tokens
SENTENCE = (
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list)."
)
LONG_PROMPT = " ".join([SENTENCE] * 14)
_SIZES = re.compile(
    r"would hold (?P<kept>[\d.]+) MiB instead of (?P<full>[\d.]+) MiB at the longest sequence"
)
_SAVES = re.compile(r"\(saves (\d+)%\)")


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


def _shown_sizes(at) -> tuple[str, str, int | None]:
    (caption,) = [c.value for c in at.caption if _SIZES.search(c.value)]
    sizes, saves = _SIZES.search(caption), _SAVES.search(caption)
    return sizes["kept"], sizes["full"], None if saves is None else int(saves[1])


@pytest.mark.parametrize("window,global_tokens", [(100, 4), (1000, 4)])
def test_kv_whatif_shows_hand_derived_cache_sizes(window: int, global_tokens: int) -> None:
    at = run_page(
        "pages/attention.py",
        model=MODEL,
        prompt=LONG_PROMPT,
        whatif_window=window,
        whatif_global=global_tokens,
    )
    (caption,) = [c.value for c in at.caption if " tokens · " in c.value]
    tokens = int(re.search(r"· (\d+) tokens ·", caption)[1])
    assert tokens > 256  # the model's sliding window bites

    full = expected_cache_bytes(tokens)
    kept = expected_cache_bytes(tokens, window, global_tokens)
    assert kept <= full
    shown_kept, shown_full, saves = _shown_sizes(at)
    assert (shown_kept, shown_full) == (f"{kept / 2**20:.2f}", f"{full / 2**20:.2f}")
    assert float(shown_kept) <= float(shown_full)
    assert saves == round(100 * (1 - kept / full))  # what the window saves, not kept / full
    if window + global_tokens >= 256:
        assert saves == 0 and shown_kept == shown_full
    else:
        assert saves > 0
    # the cache metric counts the sliding windows too (it is the whole sequence: one sequence here)
    metric = next(m for m in at.metric if m.label == f"Cache at {tokens} tokens")
    assert metric.value == f"{full / 2**20:.2f} MiB"
