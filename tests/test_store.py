"""The routing store: queries equal the in-memory analysis, bad files are refused, checkpoint timelines."""

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
    saturation_timeline,
    vocabulary_specialisation_frame,
    vocabulary_token_frame,
)
from moeviz.analysis.losses import z_loss
from moeviz.store import StoreError, StoreQuery, TraceSettings, iter_batches, validate_store, write_corpus
from moeviz.store.checkpoints import checkpoint_timeline, render_timeline
from moeviz.store.writer import write_trace
from moeviz.trace import LayerRouting, ModelInfo, Trace

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


# ---- synthetic checkpoint series with known answers ---------------------------------------------------
E, K, SEQS, LENGTH = 8, 2, 4, 100


def _routing(layer: int, experts: np.ndarray, rng: np.random.Generator) -> LayerRouting:
    n = len(experts)
    logits = rng.normal(size=(n, E)).astype(np.float32)
    return LayerRouting(
        layer=layer,
        site="mlp",
        token_rows=np.arange(n),
        logits=logits,
        experts=experts,
        weights=np.full(experts.shape, 0.5, np.float32),
        score_fn="softmax",
    )


def _synthetic(experts_by_layer: list[np.ndarray], seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    n = SEQS * LENGTH
    tokens = pd.DataFrame(
        {
            "seq": np.repeat(np.arange(SEQS), LENGTH),
            "pos": np.tile(np.arange(LENGTH), SEQS),
            "stream": "input",
            "token_id": np.random.default_rng(0).integers(0, 50, n),
            "token": "",
            "phase": "prompt",
            "step": 0,
            "predicted_id": -1,
        }
    )
    info = ModelInfo(source="synthetic", model_type="mixtral", architecture="x", num_layers=2)
    return Trace(info, tokens, [_routing(i, ex, rng) for i, ex in enumerate(experts_by_layer)])


def _pairs(rng: np.random.Generator, n: int, allowed: np.ndarray | None = None) -> np.ndarray:
    pool = np.arange(E) if allowed is None else allowed
    return np.stack([rng.choice(pool, K, replace=False) for _ in range(n)])


def test_checkpoint_saturation_and_first_crossing_known_answers(tmp_path):
    rng = np.random.default_rng(1)
    n = SEQS * LENGTH
    final0, final1 = _pairs(rng, n), _pairs(rng, n)
    fractions = [0.0, 0.25, 0.5, 1.0]
    traces = []
    for c, p in enumerate(fractions):
        same = int(p * n)
        layer0 = final0.copy()
        for t in range(same, n):  # a disjoint pair: no overlap with the final checkpoint
            layer0[t] = rng.choice(np.setdiff1d(np.arange(E), final0[t]), K, replace=False)
        # layer 1 collapses onto experts {0, 1} at checkpoint 2 only
        layer1 = np.tile([0, 1], (n, 1)) if c == 2 else (final1 if c == 3 else _pairs(rng, n))
        traces.append(_synthetic([layer0, layer1], seed=c))
    names = [f"step-{c}" for c in range(4)]
    for c, trace in enumerate(traces):
        write_trace(
            trace,
            tmp_path,
            model="synth",
            checkpoint=names[c],
            checkpoint_index=c,
            seq_domains=["a", "b"] * (SEQS // 2),
        )
    timeline = checkpoint_timeline(tmp_path, model="synth")
    assert timeline.checkpoints == names
    layer0 = timeline.saturation[timeline.saturation["layer"] == 0]
    np.testing.assert_allclose(layer0["saturation_topk"], fractions)
    np.testing.assert_allclose(layer0["saturation_top1"], fractions)
    # and the in-memory reference agrees on every layer
    want = saturation_timeline(traces, names=names)
    np.testing.assert_allclose(
        timeline.saturation.sort_values(["order", "layer"])["saturation_topk"], want["saturation_topk"]
    )
    np.testing.assert_allclose(
        timeline.saturation.sort_values(["order", "layer"])["saturation_top1"], want["saturation_top1"]
    )
    crossings = timeline.crossings.set_index(["layer", "indicator", "level"])["first_checkpoint"]
    assert crossings[(1, "dead_fraction", "collapsed")] == "step-2"
    assert crossings[(1, "verdict", "collapsed")] == "step-2"
    assert pd.isna(crossings[(0, "verdict", "warning")])
    # drift at the collapsed checkpoint: experts 2..7 lost every token
    drift = timeline.drift[(timeline.drift["checkpoint"] == "step-2") & (timeline.drift["layer"] == 1)]
    assert len(drift) == E
    assert (drift[drift["expert"] >= 2]["drift"] == 1.0).all()
    assert (drift[drift["expert"] >= 2]["load"] == 0).all()
    assert (drift[drift["expert"] < 2]["load"] == n).all()
    text = render_timeline(timeline)
    assert "layer 1 dead_fraction collapsed: step-2" in text


def test_every_corpus_writer_takes_the_run_keywords_first():
    """`write_corpus`, `write_series` and their Ray versions share one keyword set for the run they write
    (RUN_KEYWORDS, same order and defaults), so one dict of them serves every path of `moeviz trace`."""
    import inspect

    from moeviz.store import RUN_KEYWORDS, write_corpus, write_series
    from moeviz.store.distributed import write_corpus_ray, write_series_ray

    defaults = None
    for writer in (write_corpus, write_series, write_corpus_ray, write_series_ray):
        keywords = [p for p in inspect.signature(writer).parameters.values() if p.kind is p.KEYWORD_ONLY]
        assert tuple(p.name for p in keywords[: len(RUN_KEYWORDS)]) == RUN_KEYWORDS, writer.__name__
        mine = [p.default for p in keywords[: len(RUN_KEYWORDS)]]
        assert defaults is None or mine == defaults, writer.__name__
        defaults = mine
