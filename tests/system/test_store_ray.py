"""`moeviz trace --ray`: a store written by two Ray workers equals, row for row, the one a single process
writes; an interrupted run resumes (on Ray or off it) to the same rows; a model split by a device map with
layers offloaded to disk records exactly the routing of a normally loaded one."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from moeviz.cli import main
from moeviz.store import StoreError, StoreQuery, TraceSettings, list_runs, validate_store, write_corpus
from moeviz.store.checkpoints import write_series

# CI installs moeviz[ray] (make setup), so this runs there; it skips only for an install without the extra
ray = pytest.importorskip("ray")

from moeviz.store import distributed  # noqa: E402  (after the skip: it is usable only with ray)
from moeviz.store.distributed import RayOptions, write_corpus_ray, write_series_ray  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
REPO = Path(__file__).resolve().parents[2]
SAMPLE = "sample:mixtral-healthy"
SETTINGS = TraceSettings(batch_size=4, chunk_tokens=96)
TWO = RayOptions(workers=2)
ROWS = (
    "SELECT model, checkpoint, batch, doc, domain, seq, pos, token_id, layer, site, rank, expert, weight, "
    "score, lse FROM rows ORDER BY model, checkpoint, seq, pos, layer, rank"
)


@pytest.fixture(scope="module")
def cluster():
    """One local two-CPU Ray for the module (the workers run one torch thread each)."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=100 * 2**20,
        logging_level=logging.WARNING,
    )
    yield
    ray.shutdown()


@contextmanager
def one_thread() -> Iterator[None]:
    """Trace in this process with one torch thread, as each worker does: BLAS sums in another order with
    another thread count (last-bit differences), so equality is defined at equal threads per process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single(sample_model, corpus, tmp_path_factory):
    """The reference: the same corpus traced by one process."""
    store = tmp_path_factory.mktemp("single") / "store"
    with one_thread():
        write_corpus(sample_model, corpus, store, settings=SETTINGS, progress=False)
    return store


def _assert_same_store(got: Path, want: Path) -> None:
    """Same runs, run.json, manifest entries (batch set, rows, bytes, token hashes) and every row."""
    assert validate_store(got) == []
    runs_got, runs_want = list_runs(got), list_runs(want)
    assert [(r.model, r.checkpoint) for r in runs_got] == [(r.model, r.checkpoint) for r in runs_want]
    for a, b in zip(runs_got, runs_want, strict=True):
        assert a.complete and b.complete
        assert a.config == b.config  # run.json: source, corpus, plan, layers, total_batches
        assert a.parts == b.parts  # same batches, each with the same rows, bytes and token hash
    rows_got, rows_want = StoreQuery(got).sql(ROWS), StoreQuery(want).sql(ROWS)
    assert len(rows_got) == len(rows_want) > 0
    pd.testing.assert_frame_equal(rows_got, rows_want, check_exact=True)


def _interrupt_at(monkeypatch, index: int) -> None:
    """Make the Ray driver's batch plan raise Ctrl-C when it reaches batch `index`."""
    plan = distributed.plan_batches

    def interrupted(*args, **kwargs):
        for batch in plan(*args, **kwargs):
            if batch.index == index:
                raise KeyboardInterrupt
            yield batch

    monkeypatch.setattr(distributed, "plan_batches", interrupted)


def test_cli_ray_trace_equals_the_single_process_store(cluster, corpus, single, tmp_path):
    store = tmp_path / "store"
    args = ["--batch-size", "4", "--chunk-tokens", "96", "--ray", "--workers", "2", "--quiet"]
    code = main(["trace", "--model", SAMPLE, "--corpus", str(corpus), "--out", str(store), *args])
    assert code == 0
    assert len(list_runs(store)[0].parts) == 10
    _assert_same_store(store, single)


def test_interrupted_runs_resume_across_paths_to_the_same_store(
    cluster, sample_model, corpus, single, tmp_path, monkeypatch
):
    """One process stops after 4 batches; Ray resumes it and is stopped (Ctrl-C) after handing out 3
    more; Ray resumes again and ends with exactly the single-process store."""
    store = tmp_path / "store"

    def stop(batch):
        if batch.index == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), one_thread():
        write_corpus(sample_model, corpus, store, settings=SETTINGS, progress=False, on_batch=stop)
    assert sorted(list_runs(store)[0].parts) == [0, 1, 2, 3]
    with pytest.raises(StoreError, match="--resume"):  # refused before any worker loads the model
        write_corpus_ray(SAMPLE, corpus, store, settings=SETTINGS, progress=False, options=TWO)
    _interrupt_at(monkeypatch, 7)
    with pytest.raises(KeyboardInterrupt):
        write_corpus_ray(SAMPLE, corpus, store, settings=SETTINGS, progress=False, options=TWO, resume=True)
    run = list_runs(store)[0]
    # the batches handed out before Ctrl-C finished and were recorded; the run is not complete
    assert not run.complete and sorted(run.parts) == [0, 1, 2, 3, 4, 5, 6]
    monkeypatch.undo()
    # resumed with the model placed by a device map: the load keywords reach the workers
    write_corpus_ray(
        SAMPLE, corpus, store, settings=SETTINGS, progress=False, options=TWO, resume=True,
        device_map={"": "cpu"},
    )  # fmt: skip
    _assert_same_store(store, single)


def test_series_on_ray_equals_single_process(cluster, corpus, tmp_path):
    series = REPO / "sample_models" / "mixtral-healthy-series"
    spec = [series / "step-00000", series / "step-01000"]
    settings = TraceSettings(batch_size=4, chunk_tokens=96, max_batches=4)
    with one_thread():
        write_series(spec, corpus, tmp_path / "single", settings=settings, progress=False)
    one = RayOptions(workers=1)  # one worker per checkpoint keeps this test short
    _, labels = write_series_ray(
        spec, corpus, tmp_path / "ray", settings=settings, progress=False, options=one
    )
    assert labels == ["step-00000", "step-01000"]
    _assert_same_store(tmp_path / "ray", tmp_path / "single")


OFFLOAD_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.layers.3": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


def test_device_map_with_disk_offload_records_the_same_routing(corpus, tmp_path):
    """Two layers live on disk and are loaded by accelerate's hooks at each forward.

    MKL picks kernels by memory alignment, and offloaded weights are re-read at other addresses, so
    float sums may differ in the last bit; MKL_CBWR=COMPATIBLE makes MKL alignment-independent, so both
    traces (each a fresh process with it set) must agree bit for bit."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MKL_CBWR": "COMPATIBLE"}
    offload = tmp_path / "offload"
    base = ["trace", "--model", SAMPLE, "--corpus", str(corpus), "--batch-size", "4", "--chunk-tokens", "96",
            "--max-batches", "6", "--quiet"]  # fmt: skip
    plain = [*base, "--out", str(tmp_path / "plain")]
    split = [*base, "--out", str(tmp_path / "split"), "--device-map", json.dumps(OFFLOAD_MAP),
             "--offload-folder", str(offload)]  # fmt: skip
    # one process started with MKL_CBWR set (MKL reads it once), both CLI runs in it
    script = (
        "import json, sys\n"
        "from moeviz.cli import main\n"
        "sys.exit(max(main(json.loads(arg)) for arg in sys.argv[1:]))\n"
    )
    command = [sys.executable, "-c", script, json.dumps(plain), json.dumps(split)]
    proc = subprocess.run(command, env=env, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert {p.name for p in offload.glob("*.safetensors")} >= {  # the layers really were on disk
        "model.layers.1.mlp.experts.gate_up_proj.safetensors",
        "model.layers.3.mlp.experts.down_proj.safetensors",
    }
    got, want = StoreQuery(tmp_path / "split").sql(ROWS), StoreQuery(tmp_path / "plain").sql(ROWS)
    assert len(got) == len(want) > 0
    np.testing.assert_array_equal(got["expert"], want["expert"])
    if torch.backends.mkl.is_available():
        pd.testing.assert_frame_equal(got, want, check_exact=True)
    else:  # another BLAS: same experts, weights equal to float rounding
        np.testing.assert_allclose(got["weight"], want["weight"], rtol=1e-5)
