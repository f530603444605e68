"""Checkpoint timelines of the routing store on a synthetic checkpoint series with known answers (no model),
and the corpus writers' shared run keywords. The store against real captures is tests/models/test_store.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from moeviz.analysis import saturation_timeline
from moeviz.store.checkpoints import adapter_series_base, checkpoint_timeline, plan_series, render_timeline
from moeviz.store.writer import write_trace
from moeviz.trace import Trace
from tests.support.traces import make_layer, make_trace

E, K, SEQS, LENGTH = 8, 2, 4, 100


def _synthetic(experts_by_layer: list[np.ndarray], seed: int) -> Trace:
    """SEQS sequences of LENGTH tokens (ids drawn once, the same in every checkpoint), random logits."""
    rng = np.random.default_rng(seed)
    layers = [
        make_layer(ex, E, rng.normal(size=(len(ex), E)), layer=i) for i, ex in enumerate(experts_by_layer)
    ]
    ids = np.random.default_rng(0).integers(0, 50, SEQS * LENGTH)
    return make_trace(layers, seq_lengths=[LENGTH] * SEQS, token_ids=ids)


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


def test_a_path_with_a_comma_in_its_name_is_one_folder_of_checkpoints(tmp_path):
    folder = tmp_path / "run,v2"
    for step in ("step-10", "step-2"):
        (folder / step).mkdir(parents=True)
        (folder / step / "config.json").write_text("{}")
    series = plan_series(Path(folder))
    # numbers in the names compare as numbers: step-2 before step-10
    assert series.checkpoints == [("step-2", folder / "step-2"), ("step-10", folder / "step-10")]
    assert series.base is None
    assert adapter_series_base(Path(folder)) is None  # full checkpoints, not adapters
