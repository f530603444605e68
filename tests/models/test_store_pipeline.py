"""The corpus-trace pipeline: the plan is tokenised in a background thread and the rows are built and written
in another; errors and interruptions keep their order and semantics, and nothing written is read back."""

from __future__ import annotations

import dataclasses
import threading

import pyarrow.parquet as pq
import pytest

import moeviz
from moeviz.errors import InputError
from moeviz.store import StoreQuery, TraceSettings, iter_batches, layout, write_corpus
from moeviz.store.layout import MANIFEST_FILE, read_manifest, run_dir
from moeviz.store.schema import input_token_columns, trace_table
from moeviz.store.writer import batch_rows, capture_batch, corpus_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SETTINGS = TraceSettings(batch_size=4, chunk_tokens=96, max_batches=None)
THREADS = ("moeviz-store-plan", "moeviz-store-writer")


def _pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in THREADS and t.is_alive()]


def _batches(sample_model, corpus, settings=SETTINGS):
    tokenize = lambda text: sample_model.tokenizer(text)["input_ids"]  # noqa: E731
    return list(
        iter_batches(corpus, tokenize, settings.chunk_tokens, settings.batch_size, settings.max_batches)
    )


def test_parts_hold_the_rows_of_each_batch_and_the_manifest_is_not_reread(
    sample_model, corpus, tmp_path, monkeypatch
):
    looks = []
    real = layout._ends_with_newline
    monkeypatch.setattr(layout, "_ends_with_newline", lambda path: looks.append(path) or real(path))
    run = write_corpus(sample_model, corpus, tmp_path / "store", settings=SETTINGS, progress=False)
    batches = _batches(sample_model, corpus)
    assert run.complete and len(run.parts) == len(batches) > 2
    assert len(looks) <= 1  # only before the writer's own first line
    for batch in batches:
        want = batch_rows(
            capture_batch(sample_model, batch), batch, model=run.model, checkpoint="final", confidence=False
        )
        got = pq.read_table(run.path / run.parts[batch.index]["file"])
        assert got.schema.equals(want.schema, check_metadata=True)
        assert got.to_pandas().equals(want.to_pandas())
        assert run.parts[batch.index]["token_hash"] == batch.token_hash
    assert not _pipeline_threads()


def test_a_plan_error_comes_after_the_batches_before_it(sample_model, corpus, tmp_path):
    bad = tmp_path / "corpus"
    bad.mkdir()
    for file in sorted(corpus.rglob("*.txt")):
        (bad / f"a_{file.parent.name}_{file.stem}.txt").write_bytes(file.read_bytes())
    (bad / "z.txt").write_bytes(b"\xff\xfe not utf-8")
    good = _batches(sample_model, corpus)
    store = tmp_path / "store"
    with pytest.raises(InputError, match="not UTF-8"):
        write_corpus(sample_model, bad, store, model="m", settings=SETTINGS, progress=False)
    done = read_manifest(run_dir(store, "m", "final") / MANIFEST_FILE)
    # every full batch planned before the bad file was traced and written; the run is not finished
    full = [b for b in good if len(b.token_ids) == SETTINGS.batch_size]
    assert sorted(done) == [b.index for b in full]
    assert not _pipeline_threads()


def test_interrupted_run_stops_its_threads_and_resumes_to_the_same_rows(sample_model, corpus, tmp_path):
    whole = write_corpus(
        sample_model, corpus, tmp_path / "whole", model="m", settings=SETTINGS, progress=False
    )

    def interrupt(batch):
        if batch.index == 1:
            raise KeyboardInterrupt

    store = tmp_path / "store"
    with pytest.raises(KeyboardInterrupt):
        write_corpus(
            sample_model, corpus, store, model="m", settings=SETTINGS, progress=False, on_batch=interrupt
        )
    assert not _pipeline_threads()
    done = read_manifest(run_dir(store, "m", "final") / MANIFEST_FILE)
    assert sorted(done) == [0, 1]  # both queued batches were drained to disk
    resumed = write_corpus(
        sample_model, corpus, store, model="m", settings=SETTINGS, resume=True, progress=False
    )
    assert resumed.complete and resumed.rows == whole.rows
    order = "ORDER BY batch, layer, seq, pos, rank"
    got = StoreQuery(store).sql(f"SELECT * EXCLUDE (checkpoint) FROM rows {order}")
    want = StoreQuery(tmp_path / "whole").sql(f"SELECT * EXCLUDE (checkpoint) FROM rows {order}")
    assert got.equals(want)


def test_rows_from_the_token_ids_equal_rows_from_the_token_table(sample_model):
    """The writer takes seq, pos and token_id from the batch's ids (no token strings decoded): the same rows
    as from the trace's token table, for sequences of different lengths (right padding)."""
    ids = [[(7 * i + 3) % 500 + 3 for i in range(n)] for n in (50, 7, 30, 1)]
    trace = moeviz.capture(sample_model, token_ids=ids)
    kwargs = dict(model="m", checkpoint="c", batch=2, seq_offset=5, seq_docs=[0, 0, 1, 2])
    kwargs |= dict(seq_domains=["b", "b", "a", ""], confidence=True)
    assert input_token_columns(ids, trace.layers) is not None
    fast = trace_table(trace, token_ids=ids, **kwargs)
    reference = trace_table(trace, **kwargs)
    assert fast.num_rows == sum(map(len, ids)) * len(trace.layers) * 2
    assert fast.schema.equals(reference.schema, check_metadata=True)
    assert fast.to_pandas().equals(reference.to_pandas())
    # anything but the input stream: the token table is the reference
    decoder = dataclasses.replace(trace.layers[0], site="decoder")
    assert input_token_columns(ids, [decoder]) is None


def test_corpus_tokenizer_gives_the_calls_ids(sample_model, corpus):
    tokenizer = sample_model.tokenizer
    tokenize = corpus_tokenizer(tokenizer)
    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus.rglob("*.txt"))] + ["héllo  wörld\n\t😀 ᚠ"]
    for text in texts:
        assert tokenize(text) == tokenizer(text)["input_ids"]
