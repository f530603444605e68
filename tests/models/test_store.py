"""The routing store of a sample model's corpus trace: queries equal the in-memory analysis, bad files are
refused. Checkpoint timelines on synthetic series: tests/unit/test_store_checkpoints.py."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import moeviz
from moeviz.analysis import (
    balance_frame,
    collapse_report,
    expert_balance_frame,
    expert_domain_specialisation,
    vocabulary_specialisation_frame,
    vocabulary_token_frame,
)
from moeviz.analysis.losses import z_loss
from moeviz.store import StoreError, StoreQuery, TraceSettings, iter_batches, validate_store, write_corpus
from moeviz.trace import Trace

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SETTINGS = TraceSettings(batch_size=4, chunk_tokens=96, max_batches=None)


@pytest.fixture(scope="module")
def traced(sample_model, corpus, tmp_path_factory):
    """(store, the same batches captured in memory and concatenated, seq_domains)."""
    store = tmp_path_factory.mktemp("store")
    write_corpus(sample_model, corpus, store, settings=SETTINGS, progress=False)
    tokenize = lambda text: sample_model.tokenizer(text)["input_ids"]  # noqa: E731
    batches = list(iter_batches(corpus, tokenize, SETTINGS.chunk_tokens, SETTINGS.batch_size))
    trace = Trace.concat([moeviz.capture(sample_model, token_ids=b.token_ids) for b in batches])
    domains = [d for b in batches for d in b.domains]
    return store, trace, domains


def test_store_holds_every_routing_row(traced):
    store, trace, _ = traced
    query = StoreQuery(store)
    stored = query.sql(
        "SELECT seq, pos, layer, rank, expert, weight FROM rows ORDER BY layer, seq, pos, rank"
    )
    frame = trace.routing_frame().sort_values(["layer", "seq", "pos", "rank"]).reset_index(drop=True)
    assert len(stored) == len(frame) > 0
    np.testing.assert_array_equal(stored["expert"], frame["expert"])
    np.testing.assert_array_equal(stored["pos"], frame["pos"])
    np.testing.assert_array_equal(stored["weight"], frame["weight"].astype(np.float32))


def test_load_and_balance_equal_in_memory(traced):
    store, trace, _ = traced
    query = StoreQuery(store)
    got = query.balance().drop(columns=["model", "checkpoint", "z_loss"])
    want = balance_frame(trace)
    pd.testing.assert_frame_equal(
        got.reset_index(drop=True),
        want.reset_index(drop=True),
        check_dtype=False,
        check_exact=False,
        rtol=1e-12,
    )
    load = query.expert_balance(devices=2).drop(columns=["model", "checkpoint"])
    pd.testing.assert_frame_equal(load, expert_balance_frame(trace, devices=2), check_dtype=False)
    z = query.balance()["z_loss"].to_numpy()
    np.testing.assert_allclose(z, [z_loss(r.logits) for r in trace.layers], rtol=1e-6)
    verdicts = query.collapse()["verdict"].tolist()
    assert verdicts == [str(lv.verdict) for lv in collapse_report(trace).layers]


def test_specialisation_equals_in_memory(traced):
    store, trace, domains = traced
    query = StoreQuery(store)
    want = expert_domain_specialisation(trace, domains, shuffles=0).experts
    got = query.domain_specialisation()
    keys = ["layer", "domain", "expert"]
    want = want.sort_values(keys).reset_index(drop=True)
    got = got.sort_values(keys).reset_index(drop=True)
    for column in ("tokens", "dispatched", "ds", "baseline", "lift"):
        np.testing.assert_allclose(got[column].to_numpy(float), want[column].to_numpy(float), err_msg=column)

    tokens_want = vocabulary_token_frame(trace, "input", min_count=5)
    tokens_got = query.token_specialisation(min_count=5)
    assert len(tokens_got) == len(tokens_want) > 0
    for column in ("layer", "token_id", "occurrences", "top_expert", "share"):
        np.testing.assert_allclose(tokens_got[column].to_numpy(float), tokens_want[column].to_numpy(float))
    vocab_want = vocabulary_specialisation_frame(trace, min_count=5, keys=("input",))
    vocab_got = query.vocabulary_specialisation(min_count=5)
    np.testing.assert_allclose(vocab_got["specialisation"], vocab_want["specialisation"])
    np.testing.assert_allclose(vocab_got["specialisation_weighted"], vocab_want["specialisation_weighted"])


def test_filters_by_domain_and_layer(traced):
    store, trace, domains = traced
    query = StoreQuery(store, domain="python", layer=[1])
    frame = query.balance()
    assert frame["layer"].tolist() == [1]
    python_tokens = sum(int((trace.tokens["seq"] == i).sum()) for i, d in enumerate(domains) if d == "python")
    assert frame["tokens"].iloc[0] == python_tokens
    with pytest.raises(StoreError, match="no run"):
        StoreQuery(store, model="nope")


def _copy_store(store, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(store, target)
    return target


def test_foreign_parquet_file_is_reported_not_mixed_in(traced, tmp_path):
    store = _copy_store(traced[0], tmp_path)
    run = next(store.glob("model=*/checkpoint=*"))
    pq.write_table(pa.table({"layer": [0], "expert": [3]}), run / "extra.parquet")
    assert any("extra.parquet" in p and "not part of any run" in p for p in validate_store(store))
    with pytest.raises(StoreError, match=r"extra\.parquet"):
        StoreQuery(store)


def test_corrupt_part_is_reported(traced, tmp_path):
    store = _copy_store(traced[0], tmp_path)
    part = sorted(store.glob("model=*/checkpoint=*/part-*.parquet"))[0]
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreError, match=f"{part.name}.*bytes"):
        StoreQuery(store)
    part.write_bytes(b"x" * len(data))  # same size, garbage footer
    problems = validate_store(store)
    assert any(part.name in p and "not a readable Parquet" in p for p in problems)


def test_tracing_twice_without_resume_is_refused(traced, sample_model, corpus):
    with pytest.raises(StoreError, match="--resume"):
        write_corpus(sample_model, corpus, traced[0], settings=SETTINGS, progress=False)
    with pytest.raises(StoreError, match="settings differ"):
        write_corpus(
            sample_model, corpus, traced[0], settings=TraceSettings(batch_size=2), resume=True, progress=False
        )
