"""A fine-tune's checkpoint series of PEFT adapters traced on Ray (`write_series_ray(..., base=)`,
`moeviz trace --model RUN --base MODEL --ray`): each worker merges the adapter into the base, and the store
is the one the single process writes (`write_series`): the same timeline, the same run.json (each adapter
recorded exactly as `write_corpus` records it, so either path resumes the other's run), the same routing.
Bad series are refused before Ray starts; a resume over another adapter is refused before a worker loads."""

from __future__ import annotations

import json
import logging
import shutil
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moeviz.cli import main
from moeviz.errors import CheckpointSeriesError
from moeviz.models.adapters import AdapterInfo
from moeviz.models.loading import sample_models_dir
from moeviz.store import StoreError, StoreQuery, TraceSettings, list_runs, validate_store
from moeviz.store.checkpoints import BASE_LABEL, checkpoint_timeline, write_series
from tests.support.adapters import adapter_run_fixtures

# CI installs moeviz[ray] (make setup), so this runs there; it skips only for an install without the extra
ray = pytest.importorskip("ray")

from moeviz.store import distributed  # noqa: E402  (after the skip: it is usable only with ray)
from moeviz.store.distributed import RayOptions, write_corpus_ray, write_series_ray  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
STEPS = [5, 20]
LABELS = [BASE_LABEL, "checkpoint-5", "checkpoint-20"]
SETTINGS = TraceSettings(batch_size=2, chunk_tokens=64, max_batches=2)
ONE = RayOptions(workers=1)  # one worker per checkpoint keeps the series short
FRAMES = ("saturation", "collapse", "drift", "specialisation", "crossings")
ATOL = 1e-6  # the worker merges and sums with one torch thread, this process with its own count
DECLARED = "/elsewhere/models/mixtral-healthy"  # the base the adapters name: not on this machine
ROWS = (
    "SELECT checkpoint, batch, seq, pos, token_id, layer, rank, expert, weight FROM rows "
    "ORDER BY checkpoint, seq, pos, layer, rank"
)


@pytest.fixture(scope="module")
def cluster():
    """One local two-CPU Ray for the module."""
    ray.init(
        num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, logging_level=logging.WARNING
    )
    yield
    ray.shutdown()


base, run = adapter_run_fixtures(STEPS, DECLARED)


@pytest.fixture(scope="module")
def single(run, base, corpus, tmp_path_factory) -> Path:
    """The reference: the series traced by one process."""
    store = tmp_path_factory.mktemp("single") / "store"
    write_series(run, corpus, store, base=base, settings=SETTINGS, progress=False)
    return store


def _configs(store: Path) -> dict[str, dict]:
    return {r.checkpoint: r.config for r in list_runs(store)}


@pytest.mark.slow
def test_adapter_series_on_ray_equals_the_single_process_series(cluster, run, base, corpus, single, tmp_path):
    store = tmp_path / "ray"
    name, labels = write_series_ray(
        run, corpus, store, base=base, settings=SETTINGS, progress=False, options=ONE
    )
    assert (name, labels) == ("run", LABELS)
    assert validate_store(store) == []
    got, want = checkpoint_timeline(store, model=name), checkpoint_timeline(single, model=name)
    assert got.checkpoints == want.checkpoints == LABELS
    for frame in FRAMES:
        pd.testing.assert_frame_equal(
            getattr(got, frame), getattr(want, frame), check_exact=False, rtol=0, atol=ATOL, obj=frame
        )
    # not vacuous: the adapters move the routing away from the base's
    assert got.saturation.groupby("order")["saturation_topk"].mean().iloc[0] < 0.95

    configs = _configs(store)
    assert configs == _configs(single)  # run.json, adapter record included, key for key
    assert "adapter" not in configs[BASE_LABEL] and configs[BASE_LABEL]["source"] == str(base)
    for label in LABELS[1:]:
        info = AdapterInfo.from_json(configs[label]["adapter"])
        assert Path(info.path) == run / label and info.base_model == DECLARED and info.rank == 4
        assert info.adapted  # the module paths the merge changed: known only on the worker
        assert configs[label]["source"] == str(base)
    rows_got, rows_want = StoreQuery(store).sql(ROWS), StoreQuery(single).sql(ROWS)
    assert len(rows_got) == len(rows_want) > 0
    np.testing.assert_array_equal(rows_got["expert"], rows_want["expert"])
    np.testing.assert_allclose(rows_got["weight"], rows_want["weight"], rtol=0, atol=ATOL)

    # the single process resumes the Ray run: every setting, the adapter's record included, is its own
    parts = {r.checkpoint: r.parts for r in list_runs(store)}
    write_series(run, corpus, store, base=base, settings=SETTINGS, progress=False, resume=True)
    assert {r.checkpoint: r.parts for r in list_runs(store)} == parts


def test_cli_trace_ray_takes_the_base_of_an_adapter_series(
    cluster, run, base, corpus, single, tmp_path, monkeypatch
):
    """`moeviz trace --model RUN --base sample:NAME --ray`, RUN given relative to here: the workers load
    the adapter from its absolute path (they run elsewhere), run.json records it as given, as
    `write_corpus` does."""
    shutil.copytree(run / "checkpoint-20", tmp_path / "short" / "checkpoint-20")
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "store"
    args = ["trace", "--model", "short", "--corpus", str(corpus), "--out", str(store), "--quiet",
            "--batch-size", "2", "--chunk-tokens", "64", "--max-batches", "2",
            "--ray", "--workers", "1"]  # fmt: skip
    assert main([*args, "--base", "sample:mixtral-healthy"]) == 0
    configs = _configs(store)
    assert sorted(configs) == sorted([BASE_LABEL, "checkpoint-20"])
    adapter = json.loads(configs["checkpoint-20"]["adapter"])
    assert adapter["path"] == str(Path("short") / "checkpoint-20")
    assert configs["checkpoint-20"]["source"] == str(base)
    # the same routing as the reference's checkpoint-20 (the same adapter over the same base)
    got, want = (StoreQuery(s, checkpoint=["checkpoint-20"]).sql(ROWS) for s in (store, single))
    assert len(got) == len(want) > 0
    np.testing.assert_array_equal(got["expert"], want["expert"])
    np.testing.assert_allclose(got["weight"], want["weight"], rtol=0, atol=ATOL)
    # one model with --adapter on Ray: the same adapter merged by the worker, recorded as given
    one = tmp_path / "one"
    adapter_args = ["--model", "sample:mixtral-healthy", "--adapter", str(Path("short") / "checkpoint-20")]
    assert main([*args[:1], *adapter_args, *args[3:5], "--out", str(one), *args[7:]]) == 0
    (config,) = _configs(one).values()
    assert json.loads(config["adapter"])["path"] == str(Path("short") / "checkpoint-20")
    got = StoreQuery(one).sql(ROWS)
    np.testing.assert_array_equal(got["expert"], want["expert"])
    np.testing.assert_allclose(got["weight"], want["weight"], rtol=0, atol=ATOL)


def _no_ray(monkeypatch) -> None:
    """Fail the test if Ray would start (or a worker load a model)."""

    def refuse(*args, **kwargs):
        raise AssertionError("Ray started: the refusal should come first")

    monkeypatch.setattr(distributed, "ray_session", refuse)
    monkeypatch.setattr(distributed, "_start_workers", refuse)


def test_bad_adapter_series_are_refused_before_ray_starts(run, base, corpus, tmp_path, monkeypatch):
    _no_ray(monkeypatch)
    write = lambda spec, given=None: write_series_ray(  # noqa: E731
        spec, corpus, tmp_path / "store", base=given, settings=SETTINGS, progress=False, options=ONE
    )
    with pytest.raises(CheckpointSeriesError, match="not a model folder here: give the base"):
        write(run)  # the base the adapters name is not here, and none is given
    mixed = tmp_path / "mixed"
    shutil.copytree(run / "checkpoint-5", mixed / "checkpoint-5")
    shutil.copytree(sample_models_dir() / "mixtral-healthy-series" / "step-00010", mixed / "step-00010")
    with pytest.raises(CheckpointSeriesError, match=r"holds full checkpoints .* and adapters"):
        write(mixed, base)
    other = tmp_path / "other"
    shutil.copytree(run, other)
    config = other / "checkpoint-20" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": "org/other"}))
    with pytest.raises(CheckpointSeriesError, match="different bases"):
        write(other, base)
    with pytest.raises(CheckpointSeriesError, match="only to a series of adapters"):
        write(sample_models_dir() / "mixtral-healthy-series", base)
    assert not (tmp_path / "store").exists()


def test_a_resume_over_another_adapter_is_refused_before_a_worker_loads(
    run, base, corpus, single, monkeypatch
):
    """The recorded adapter is compared by its folder before the workers start; the same folder passes."""
    one = {"model": "run", "settings": SETTINGS, "progress": False, "options": ONE}
    at = {"checkpoint": "checkpoint-5", "checkpoint_index": 1}
    _no_ray(monkeypatch)
    with pytest.raises(StoreError, match="--resume"):
        write_corpus_ray(base, corpus, single, adapter=run / "checkpoint-5", **at, **one)
    with pytest.raises(StoreError, match=r"settings differ \(adapter: .*checkpoint-5.* → .*checkpoint-20"):
        write_corpus_ray(base, corpus, single, adapter=run / "checkpoint-20", resume=True, **at, **one)
    with pytest.raises(StoreError, match=r"settings differ \(adapter: .* → None"):
        write_corpus_ray(base, corpus, single, resume=True, **at, **one)  # the base alone
    # the same adapter passes the early check and goes on to start the workers
    monkeypatch.setattr(distributed, "ray_session", lambda options: nullcontext())
    with pytest.raises(AssertionError, match="Ray started"):
        write_corpus_ray(base, corpus, single, adapter=run / "checkpoint-5", resume=True, **at, **one)
