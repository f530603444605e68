"""Routes, the simulators' input: a store and the same batches captured in memory give the same routing."""

from __future__ import annotations

import numpy as np
import pytest

import moeviz
from moeviz.errors import InputError
from moeviz.store import TraceSettings, iter_batches, write_corpus
from moeviz.trace import Trace
from moeviz.whatif import routes_from_store, routes_from_trace

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SETTINGS = TraceSettings(batch_size=4, chunk_tokens=64, max_batches=2)


@pytest.fixture(scope="module")
def store_and_trace(sample_model, corpus, tmp_path_factory):
    store = tmp_path_factory.mktemp("whatif_store")
    write_corpus(sample_model, corpus, store, settings=SETTINGS, progress=False)
    tokenize = lambda text: sample_model.tokenizer(text)["input_ids"]  # noqa: E731
    batches = list(iter_batches(corpus, tokenize, SETTINGS.chunk_tokens, SETTINGS.batch_size))[:2]
    trace = Trace.concat([moeviz.capture(sample_model, token_ids=b.token_ids) for b in batches])
    return store, trace


def test_store_routes_equal_trace_routes(store_and_trace):
    store, trace = store_and_trace
    from_store, from_trace = routes_from_store(store), routes_from_trace(trace)
    assert from_store.source == "store" and from_trace.source == "trace"
    assert [r.layer for r in from_store.layers] == [r.layer for r in from_trace.layers]
    for a, b in zip(from_store.layers, from_trace.layers, strict=True):
        np.testing.assert_array_equal(a.experts, b.experts)
        np.testing.assert_allclose(a.weights, b.weights, rtol=1e-6)
        np.testing.assert_array_equal(a.seq, b.seq)
        np.testing.assert_array_equal(a.pos, b.pos)
        assert a.num_experts == b.num_experts == 8
        # sorted by (seq, pos), positions restart in each seq
        assert np.all(np.diff(a.seq) >= 0)
        same = np.diff(a.seq) == 0
        assert np.all(np.diff(a.pos)[same] == 1)


def test_split_never_shares_a_sequence(store_and_trace):
    _, trace = store_and_trace
    routes = routes_from_trace(trace)
    fit, rest, how = routes.split(0.5)
    assert fit.tokens + rest.tokens == routes.tokens
    assert not set(fit.layers[0].seq) & set(rest.layers[0].seq)
    assert "sequences" in how
    single = routes_from_trace(Trace(model=trace.model, tokens=trace.tokens, layers=trace.layers[:1]))
    assert single.layers[0].layer == trace.layers[0].layer


def test_split_of_one_sequence_is_by_position(sample_model):
    routes = routes_from_trace(moeviz.capture(sample_model, "one sequence of a few tokens to split"))
    fit, rest, how = routes.split(0.25, order="ordered")
    assert "tokens" in how and fit.tokens == round(routes.tokens * 0.25)
    assert fit.layers[0].pos.max() < rest.layers[0].pos.min()
    with pytest.raises(InputError, match="fit fraction"):
        routes.split(1.0)
