"""Which experts a per-expert view lists is said one way on every page (Routing, Structure, Playground,
Corpus): `expert_axis.caption_shown`, from `ExpertAxis.shown_sentence`. Nothing up to 20 experts (every
expert is listed by id); above, the top-N of the axis and its order. The pages at scale:
tests/app/test_app_scale.py."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.support.app import app_importable

SCALE = dict(order=list(range(256)), shown=[0, 5, 9], expert=5, by="coactivation", num_experts=256)
SAID = "The 3 busiest of 256 experts at this layer (top-N, and the chosen one), sorted by co-activation PC1"


@pytest.fixture
def expert_axis(monkeypatch):
    app_importable(monkeypatch)
    from components import expert_axis

    return expert_axis


def test_the_sentence_is_said_only_above_20_experts(expert_axis) -> None:
    assert expert_axis.ExpertAxis.by_id(20).shown_sentence(" at this layer", "; more") == ""
    at_scale = expert_axis.ExpertAxis(**SCALE)
    assert at_scale.shown_sentence(" at this layer") == f"{SAID}. "
    assert at_scale.shown_sentence(" at this layer", "; the download has all of them") == (
        f"{SAID}; the download has all of them. "
    )


def _page(num_experts: int) -> None:
    from components import expert_axis

    if num_experts > 20:
        axis = expert_axis.ExpertAxis(
            order=list(range(256)), shown=[0, 5, 9], expert=5, by="coactivation", num_experts=256
        )
    else:
        axis = expert_axis.ExpertAxis.by_id(num_experts)
    expert_axis.caption_shown(axis, " at this layer", "; the download has all of them")


@pytest.mark.parametrize("num_experts", [8, 256])
def test_caption_shown_draws_the_sentence(expert_axis, num_experts: int) -> None:
    at = AppTest.from_function(_page, args=(num_experts,)).run()
    assert not at.exception, [e.value for e in at.exception]
    captions = [c.value for c in at.caption]
    assert captions == ([] if num_experts <= 20 else [f"{SAID}; the download has all of them."])
