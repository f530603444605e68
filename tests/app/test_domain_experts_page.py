"""The Corpus page's "Top experts per domain" table is `moeviz.analysis.domain_top_experts` of the store it
shows. The function against counts by hand: tests/unit/test_domain_experts.py."""

from __future__ import annotations

import pandas as pd

from moeviz.analysis import domain_top_experts
from tests.support.app import app_test_env, run_page


def test_corpus_page_shows_the_library_table(monkeypatch) -> None:
    app_test_env(monkeypatch)
    at = run_page("pages/corpus.py", timeout_s=300)
    assert any(h.value == "Top experts per domain" for h in at.subheader)
    (shown,) = [d.value for d in at.dataframe if "null_share" in d.value.columns]
    from components.access import default_model
    from components.corpus_store import built_stores

    from moeviz.store import StoreQuery

    store = built_stores()[0][default_model()]  # other tests of this process may have built others
    query = StoreQuery(store)
    run = query.runs[-1]
    scope = StoreQuery(store, model=run.model, checkpoint=run.checkpoint, validate=False)
    expected = domain_top_experts(scope.domain_specialisation(), top_n=3, level=0.95)
    assert set(shown["domain"]) == set(expected["domain"])
    pd.testing.assert_frame_equal(
        shown.reset_index(drop=True),
        expected[shown.columns].reset_index(drop=True),
        check_dtype=False,
    )
