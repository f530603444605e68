"""`moeviz trace --ray`: the corpus store written by many Ray workers (one machine, or a cluster).

Each worker is a Ray actor that loads the model once (`moeviz.load_model`, optionally split over devices
with a `device_map`), and turns batches into store rows with the same `batch_table` the single-process
writer uses, writing its own Parquet parts straight into the run folder. The driver walks the same fixed
batch plan (`iter_batches`), hands each batch not yet in the manifest to a free worker (at most `DEPTH`
per worker in flight, so memory stays bounded), and appends each finished part to the manifest and
finishes the run as `write_corpus` does: the store is the one a single process writes, and `--resume`
continues a run started with or without Ray. Manifest lines are in completion order (readers key them by
batch). Every worker must see the store folder at the same path (a shared filesystem on a cluster).

A PEFT adapter (`adapter=`, each checkpoint of an adapter series) is merged into the base on every worker;
the driver records what the first worker merged (`ModelInfo.adapter`) in run.json, as `write_corpus` does.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeviz.errors import InputError, MoevizError
from moeviz.store.layout import (
    MANIFEST_FILE,
    RUN_FILE,
    RunInfo,
    StoreError,
    append_manifest,
    check_label,
    run_dir,
)
from moeviz.store.plan import Batch
from moeviz.store.run_file import read_run_file
from moeviz.store.writer import (
    TraceSettings,
    batch_table,
    check_run,
    default_label,
    finish_run,
    is_done,
    plan_batches,
    progress_bar,
    run_config,
    write_part,
    writing_run,
)

DEPTH = 2  # batches queued per worker: one running, one waiting, so a worker never idles on the driver
DRAIN_S = 30.0  # on an error or Ctrl-C, how long to wait for batches already running to be recorded


@dataclass(frozen=True)
class RayOptions:
    """Where the workers run. `address`: None starts a local Ray sized for the workers; "auto" or
    "ray://host:10001" joins a running cluster. Each worker reserves `cpus_per_worker` CPUs (and as many
    torch threads) and `gpus_per_worker` GPUs."""

    address: str | None = None
    workers: int = 2
    cpus_per_worker: int = 1
    gpus_per_worker: float = 0.0


def require_ray():
    """The `ray` module, or an InputError (exit 2) that says how to install it."""
    try:
        import ray
    except ImportError:
        raise InputError(
            "--ray needs the ray package, which is not installed: pip install 'moeviz[ray]'"
        ) from None
    return ray


@contextmanager
def ray_session(options: RayOptions) -> Iterator[None]:
    """Connect to Ray for the duration (or reuse a session already open; then it is left open)."""
    ray = require_ray()
    if options.workers < 1 or options.cpus_per_worker < 1 or options.gpus_per_worker < 0:
        raise InputError("--workers and --cpus-per-worker must be >= 1, --gpus-per-worker >= 0")
    if ray.is_initialized():
        yield
        return
    quiet = {"include_dashboard": False, "logging_level": logging.WARNING}
    if options.address in (None, "local"):
        ray.init(address="local", num_cpus=options.workers * options.cpus_per_worker, **quiet)
    else:
        ray.init(address=options.address, logging_level=logging.WARNING)
    try:
        yield
    finally:
        ray.shutdown()


class TraceWorker:
    """A Ray actor body: one loaded model that turns batches into Parquet parts of a run folder."""

    def __init__(self, source: str, threads: int, load_kwargs: dict[str, Any]) -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from moeviz.models import load_model

        torch.set_num_threads(threads)  # the actor's CPU reservation, not every core of the node
        hf_logging.disable_progress_bar()
        # a bad model is reported by ready(): an error raised here would reach the driver as a bare
        # ActorDiedError, without the MoevizError that says what is wrong
        self.error: MoevizError | None = None
        try:
            self.loaded = load_model(source, **load_kwargs)
        except MoevizError as exc:
            self.error = exc

    def ready(self) -> str:
        """Returns once the model is loaded: the adapter merged into it (`ModelInfo.adapter`, "" for none);
        raises the MoevizError that stopped it loading."""
        if self.error is not None:
            raise self.error
        return self.loaded.info.adapter

    def trace(
        self, folder: str, batch: Batch, model: str, checkpoint: str, confidence: bool
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Capture `batch`, write its part into `folder`; returns (manifest entry, layer_info)."""
        table, layers = batch_table(
            self.loaded, batch, model=model, checkpoint=checkpoint, confidence=confidence
        )
        return write_part(Path(folder), batch, table), layers


def _unwrap(exc: BaseException) -> BaseException:
    """A worker's MoevizError (bad model, bad device map…) as itself, so the CLI exits 2 with its text;
    anything else as Ray raised it (its message holds the worker's traceback)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, MoevizError) else exc


def _start_workers(ray, source: str, options: RayOptions, load_kwargs: dict[str, Any]) -> tuple[list, str]:
    """`options.workers` actors, each loading the model; waits until all have loaded it. Returns them and
    the adapter they merged ("" for none)."""
    actor = ray.remote(TraceWorker).options(
        num_cpus=options.cpus_per_worker, num_gpus=options.gpus_per_worker
    )
    workers = [
        actor.remote(str(source), options.cpus_per_worker, load_kwargs) for _ in range(options.workers)
    ]
    try:
        adapters = ray.get([w.ready.remote() for w in workers])
    except Exception as exc:
        for worker in workers:
            ray.kill(worker)
        raise _unwrap(exc) from None
    return workers, adapters[0]


def _adapter_as_given(merged: str, adapter: str) -> str:
    """The merged adapter's record (`AdapterInfo` JSON) with its folder as given, not the absolute path the
    workers loaded it from: what `write_corpus` records, so either path can resume the other's run."""
    import dataclasses

    from moeviz.models.adapters import AdapterInfo

    info = AdapterInfo.from_json(merged)
    return "" if info is None else dataclasses.replace(info, path=adapter).to_json()


def _check_before_loading(
    store: Path, model: str, checkpoint: str, config: dict[str, Any], resume: bool, adapter: str | None
) -> None:
    """`check_run` before any worker loads the model. An adapter's record names the modules the merge
    changed, known only once merged: here a recorded adapter is compared by its folder, after the merge
    (`writing_run`) in full."""
    expected = config
    if adapter is not None:
        check_label(model, "model")
        check_label(checkpoint, "checkpoint")
        run_file = run_dir(store, model, checkpoint) / RUN_FILE
        recorded = read_run_file(run_file).get("adapter") if run_file.is_file() else None
        expected = {**config, "adapter": recorded if _adapter_folder(recorded) == adapter else adapter}
    check_run(store, model, checkpoint, expected, resume)


def _adapter_folder(recorded: Any) -> str | None:
    """The folder of a recorded adapter (None when there is none, or it is unreadable)."""
    from moeviz.models.adapters import AdapterInfo

    try:
        info = AdapterInfo.from_json(recorded) if isinstance(recorded, str) else None
    except MoevizError:
        return None
    return None if info is None else info.path


def write_corpus_ray(
    source: str | Path,
    corpus: str | Path,
    store: str | Path,
    *,
    model: str | None = None,
    settings: TraceSettings | None = None,
    resume: bool = False,
    progress: bool = True,
    checkpoint: str = "final",
    checkpoint_index: int = 0,
    options: RayOptions | None = None,
    device_map: str | int | dict[str, Any] | None = None,
    offload_folder: str | Path | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    trust_remote_code: bool = False,
    dtype: str = "auto",
    device: str = "auto",
    adapter: str | Path | None = None,
) -> RunInfo:
    """`write_corpus` with the model loaded and run on `options.workers` Ray actors (see the module doc).

    `source` is what `moeviz.load_model` takes (a folder every worker can read, or `sample:NAME`);
    `device_map` / `offload_folder` / `max_memory` / `dtype` / `device` / `adapter` (a PEFT adapter folder
    merged into `source`, recorded in run.json) go to it (GPU workers default to `device_map="auto"`, except
    with an adapter, which merges on the worker's own device). Returns the run, row for row the one
    `write_corpus` writes on the same device type."""
    from moeviz.models.loading import SAMPLE_PREFIX, read_source

    ray = require_ray()
    options = options or RayOptions()
    settings = settings or TraceSettings()
    store = Path(store).resolve()  # workers may run in another working directory
    model = model or default_label(source)
    # the driver reads what run.json records (and the tokenizer for the plan) as load_model does, so a
    # refused resume fails here, before every worker has loaded the model
    info = read_source(source, trust_remote_code=trust_remote_code)
    if info.tokenizer is None:
        raise StoreError("tracing a corpus needs a model with a tokenizer")
    config = run_config(source, info.model_type, info.max_length, corpus, settings, checkpoint_index)
    given = None if adapter is None else str(Path(adapter).expanduser())  # as load_model records it
    _check_before_loading(store, model, checkpoint, config, resume, given)
    if device_map is None and options.gpus_per_worker > 0 and adapter is None:
        device_map = "auto"  # Ray hands each actor its GPUs; without a map the model would stay on CPU
    load_kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "dtype": dtype, "device": device}
    if device_map is not None:
        offload = None if offload_folder is None else str(Path(offload_folder).resolve())
        load_kwargs.update(device_map=device_map, offload_folder=offload, max_memory=max_memory)
    if given is not None:
        load_kwargs["adapter"] = str(Path(given).resolve())
    # workers may run in another working directory: they get an absolute path, run.json the source as given
    # (as the single-process path records it, so either path can --resume the other's run)
    text = str(source)
    load_source = text if text.startswith(SAMPLE_PREFIX) else str(Path(text).resolve())

    with ray_session(options):
        workers, merged = _start_workers(ray, load_source, options, load_kwargs)
        try:
            if given is not None and merged:
                config["adapter"] = _adapter_as_given(merged, given)
            with writing_run(store, model, checkpoint, config, resume) as (folder, done):
                batches = plan_batches(corpus, info.tokenizer, config, settings)
                total, layers = _dispatch(
                    ray,
                    workers,
                    batches,
                    done,
                    folder,
                    model=model,
                    checkpoint=checkpoint,
                    settings=settings,
                    progress=progress,
                )
                return finish_run(folder, total, layers)
        finally:
            for worker in workers:  # frees the model on every node before the next checkpoint loads
                ray.kill(worker)


def _dispatch(
    ray,
    workers: list,
    batches: Iterator[Batch],
    done: dict[int, dict[str, Any]],
    folder: Path,
    *,
    model: str,
    checkpoint: str,
    settings: TraceSettings,
    progress: bool,
) -> tuple[int, list[dict[str, Any]] | None]:
    """Hand out the plan's batches to free workers and record each finished part in the manifest.

    Returns (plan length, layer_info of the first traced batch or None when every batch was done)."""
    manifest = folder / MANIFEST_FILE
    # free slots, worker-interleaved so the first batches go to different workers
    free = deque(worker for _ in range(DEPTH) for worker in workers)
    pending: dict[Any, Any] = {}  # object ref → worker
    total = 0
    layers: list[dict[str, Any]] | None = None
    bar = progress_bar(model, checkpoint, progress)
    started = time.perf_counter()

    def record(ref) -> None:
        nonlocal layers
        free.append(pending.pop(ref))
        try:
            entry, batch_layers = ray.get(ref)
        except Exception as exc:
            raise _unwrap(exc) from None
        append_manifest(manifest, entry)  # only the driver appends: one writer, lines never interleave
        layers = layers or batch_layers
        bar.update(entry["tokens"])

    try:
        for batch in batches:
            total = batch.index + 1
            if is_done(done, batch):
                continue
            while not free:
                ready, _ = ray.wait(list(pending), num_returns=1)
                record(ready[0])
            worker = free.popleft()
            ref = worker.trace.remote(str(folder), batch, model, checkpoint, settings.confidence)
            pending[ref] = worker
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            record(ready[0])
    except BaseException:
        # keep what already finished (an interrupted single-process run keeps its queued parts too);
        # anything else is re-traced on --resume
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=DRAIN_S) if pending else ([], [])
        for ref in ready:
            with suppress(Exception):  # a failed batch is not recorded: it is retraced on resume
                record(ref)
        raise
    finally:
        bar.close()
    if progress:
        elapsed = time.perf_counter() - started
        print(
            f"traced {model}/{checkpoint}: {total} batches on {len(workers)} Ray workers in {elapsed:.1f}s",
            file=sys.stderr,
        )
    return total, layers


def write_series_ray(
    spec: str | Path | Sequence[str | Path],
    corpus: str | Path,
    store: str | Path,
    *,
    model: str | None = None,
    settings: TraceSettings | None = None,
    resume: bool = False,
    progress: bool = True,
    options: RayOptions | None = None,
    base: str | Path | None = None,
    **load_options: Any,
) -> tuple[str, list[str]]:
    """`write_series` on Ray: each checkpoint in turn on all workers (one Ray session for the series).
    `base`: the base model of a series of adapters (`moeviz.store.checkpoints.plan_series`); each adapter
    is merged into it on the workers and recorded in its run. `load_options` (device_map, offload_folder,
    max_memory, dtype, device, trust_remote_code) go to `write_corpus_ray`.

    Returns (model label, checkpoint labels in order)."""
    from moeviz.store.checkpoints import plan_series

    options = options or RayOptions()
    series = plan_series(spec, base)  # a series that is not one fine-tune is refused before Ray starts
    name = model or series.name
    with ray_session(options):
        for index, (label, folder) in enumerate(series.checkpoints):
            write_corpus_ray(
                corpus=corpus,
                store=store,
                **series.load_args(folder),
                model=name,
                checkpoint=label,
                checkpoint_index=index,
                settings=settings,
                resume=resume,
                progress=progress,
                options=options,
                **load_options,
            )
    return name, [label for label, _ in series.checkpoints]
