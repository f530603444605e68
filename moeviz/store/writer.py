"""Stream a corpus through a model into a store, one atomic Parquet part per batch; resumable."""

from __future__ import annotations

import hashlib
import io
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moeviz.store.layout import (
    MANIFEST_FILE,
    RUN_FILE,
    RunInfo,
    StoreError,
    append_manifest,
    atomic_write_bytes,
    check_label,
    check_part,
    init_store,
    part_name,
    read_manifest,
    read_run,
    remove_stale_temps,
    run_dir,
    run_lock,
    slug,
    write_manifest,
)
from moeviz.store.plan import Batch, corpus_fingerprint, iter_batches, token_hash
from moeviz.store.run_file import read_run_file, run_file_bytes
from moeviz.store.schema import trace_table

# settings that must match for --resume to continue a run (anything else would mix two different runs)
RESUME_KEYS = ("source", "adapter", "corpus_id", "chunk_tokens", "batch_size", "max_batches", "confidence")


# Parquet dictionary encoding for the columns with few distinct values per part; the float columns (weight,
# score, lse, entropy, margin) are nearly all distinct: dictionary-encoding them costs a hash per value and
# makes the part larger (zstd does better on the plain floats; ~30% faster to write and ~30% smaller)
DICTIONARY_COLUMNS = (
    "model",
    "checkpoint",
    "batch",
    "doc",
    "domain",
    "seq",
    "pos",
    "token_id",
    "layer",
    "site",
    "rank",
    "expert",
)


@dataclass(frozen=True)
class TraceSettings:
    batch_size: int = 8
    chunk_tokens: int = 256
    max_batches: int | None = None
    confidence: bool = False


def write_part(folder: Path, batch: Batch, table: pa.Table) -> dict[str, Any]:
    """Write one batch's rows atomically; returns its manifest entry (not yet appended), with the size and
    sha256 of the file's bytes."""
    buffer = io.BytesIO()
    pq.write_table(
        table,
        buffer,
        compression="zstd",
        row_group_size=1 << 20,
        use_dictionary=[name for name in DICTIONARY_COLUMNS if name in table.column_names],
    )
    data = buffer.getvalue()
    name = part_name(batch.index)
    atomic_write_bytes(folder / name, data)
    return {
        "batch": batch.index,
        "file": name,
        "rows": table.num_rows,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "tokens": batch.num_tokens,
        "sequences": len(batch.token_ids),
        "token_hash": batch.token_hash,
    }


def check_run(
    store: Path, model: str, checkpoint: str, config: dict[str, Any], resume: bool
) -> dict[str, Any]:
    """Refuse (StoreError) what `prepare_run` would refuse, writing nothing; returns the config to record.

    Tracing into an existing run needs `resume` and the same RESUME_KEYS settings."""
    check_label(model, "model")
    check_label(checkpoint, "checkpoint")
    run_file = run_dir(store, model, checkpoint) / RUN_FILE
    if not run_file.is_file():
        return config
    if not resume:
        raise StoreError(
            f"store {store} already holds model {model!r} checkpoint {checkpoint!r}: pass --resume to "
            "continue it, or use another --out / --label"
        )
    old = read_run_file(run_file)
    changed = [key for key in RESUME_KEYS if old.get(key) != config.get(key)]
    if changed:
        diffs = ", ".join(f"{key}: {old.get(key)!r} → {config.get(key)!r}" for key in changed)
        raise StoreError(
            f"cannot resume model {model!r} checkpoint {checkpoint!r}: settings differ ({diffs})"
        )
    return {**old, **{k: v for k, v in config.items() if k != "total_batches"}}


def prepare_run(
    store: Path,
    model: str,
    checkpoint: str,
    config: dict[str, Any],
    resume: bool,
) -> tuple[Path, dict[int, dict[str, Any]]]:
    """Create (or, with `resume`, reopen and check) a run folder; returns it and its completed batches.

    Call it holding the run's writer lock (`writing_run` does). Removes the temp files of dead writers;
    with `resume`, a listed part that fails `check_part` (missing, resized, hash mismatch, symlink) is
    dropped from the manifest, so it is traced again."""
    check_label(model, "model")
    check_label(checkpoint, "checkpoint")
    init_store(store)
    config = check_run(store, model, checkpoint, config, resume)
    folder = run_dir(store, model, checkpoint)
    run_file = folder / RUN_FILE
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(folder)  # temp files of a killed run (never those of a live writer)
    atomic_write_bytes(run_file, run_file_bytes(config))
    manifest = folder / MANIFEST_FILE
    done = read_manifest(manifest)
    damaged = {b: problem for b, entry in done.items() if (problem := check_part(folder, entry))}
    if damaged:
        for batch, problem in damaged.items():
            print(f"moeviz: batch {batch} ({problem}): tracing it again", file=sys.stderr)
            del done[batch]
        write_manifest(manifest, list(done.values()))
    return folder, done


@contextmanager
def writing_run(
    store: Path, model: str, checkpoint: str, config: dict[str, Any], resume: bool
) -> Iterator[tuple[Path, dict[int, dict[str, Any]]]]:
    """`prepare_run` under the run's writer lock, held for the block (write the parts and `finish_run`
    inside it); a second writer of the same run gets a StoreError naming the holder's pid."""
    check_label(model, "model")
    check_label(checkpoint, "checkpoint")
    init_store(store)
    check_run(store, model, checkpoint, config, resume)  # refuse before creating the run folder
    with run_lock(run_dir(store, model, checkpoint)):
        yield prepare_run(store, model, checkpoint, config, resume)


def finish_run(folder: Path, total_batches: int, layers: list[dict[str, Any]] | None = None) -> RunInfo:
    """Record the plan's length (the run is complete once every batch is in the manifest) and the layers;
    returns the run."""
    run_file = folder / RUN_FILE
    config = read_run_file(run_file)
    config["total_batches"] = total_batches
    if layers is not None:
        config["layers"] = layers
    atomic_write_bytes(run_file, run_file_bytes(config))
    return read_run(folder)


def layer_info(trace) -> list[dict[str, Any]]:
    """What the rows cannot say: experts per layer (an expert never picked has no row) and k."""
    return [
        {
            "layer": r.layer,
            "site": r.site,
            "num_experts": r.num_experts,
            "k": r.k,
            "score_fn": r.score_fn,
            "bias": None if r.bias is None else [float(b) for b in r.bias],
        }
        for r in trace.layers
    ]


def default_label(source: str | Path) -> str:
    """The store label of a model traced without --label: its folder (or sample) name."""
    return slug(Path(str(source)).name)


def run_config(
    source: str | Path,
    model_type: str,
    max_length: int | None,
    corpus: str | Path,
    settings: TraceSettings,
    checkpoint_index: int,
) -> dict[str, Any]:
    """What run.json records for a corpus trace (the same for the single-process and the Ray path)."""
    fingerprint = corpus_fingerprint(corpus)
    return {
        "source": str(source),
        "model_type": model_type,
        "corpus": fingerprint["path"],
        "corpus_id": fingerprint["id"],
        "chunk_tokens": min(settings.chunk_tokens, max_length or settings.chunk_tokens),
        "batch_size": settings.batch_size,
        "max_batches": settings.max_batches,
        "confidence": settings.confidence,
        "checkpoint_index": checkpoint_index,
        "total_batches": None,
    }


def plan_batches(corpus: str | Path, tokenizer, config: dict[str, Any], settings: TraceSettings):
    """The run's fixed batch plan (`iter_batches` with the chunk length recorded in `config`)."""
    return iter_batches(
        corpus, corpus_tokenizer(tokenizer), config["chunk_tokens"], settings.batch_size, settings.max_batches
    )


def corpus_tokenizer(tokenizer) -> Callable[[str], list[int]]:
    """text → `tokenizer(text)["input_ids"]`, the ids of every corpus trace.

    A fast tokenizer's backend is asked directly, without character offsets (`encode_batch_fast`: ~40% less
    work on a long document), while it neither truncates nor pads (what the call sets up) and once its ids
    equal the call's on the start of the first text; otherwise, and for any other tokenizer, the call
    itself."""
    call = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return call
    checked: list[bool] = []

    def tokenize(text: str) -> list[int]:
        if backend.truncation is not None or backend.padding is not None:
            return call(text)
        if not checked:  # a probe: the same ids as the call (special tokens, normalisation)?
            probe = text[:2000]
            checked.append(backend.encode_batch_fast([probe], add_special_tokens=True)[0].ids == call(probe))
        if not checked[0]:
            return call(text)
        return backend.encode_batch_fast([text], add_special_tokens=True)[0].ids

    return tokenize


def is_done(done: dict[int, dict[str, Any]], batch: Batch) -> bool:
    """Whether `batch` is already in the manifest (checking that it still holds the same tokens)."""
    entry = done.get(batch.index)
    if entry is None:
        return False
    if entry["token_hash"] != batch.token_hash:
        raise StoreError(
            f"cannot resume: batch {batch.index} holds other tokens than when it was traced "
            "(the corpus or tokenizer changed)"
        )
    return True


def capture_batch(loaded, batch: Batch):
    """The routing `loaded` used on one batch (a Trace)."""
    from moeviz.capture import capture

    return capture(loaded, token_ids=batch.token_ids)


def batch_rows(trace, batch: Batch, *, model: str, checkpoint: str, confidence: bool) -> pa.Table:
    """The store rows (token × layer × rank) of one captured batch."""
    return trace_table(
        trace,
        model=model,
        checkpoint=checkpoint,
        batch=batch.index,
        seq_offset=batch.seq_offset,
        seq_docs=batch.docs,
        seq_domains=batch.domains,
        confidence=confidence,
        token_ids=batch.token_ids,
    )


def batch_table(
    loaded, batch: Batch, *, model: str, checkpoint: str, confidence: bool
) -> tuple[pa.Table, list[dict[str, Any]]]:
    """Capture one batch and build its store rows: (table of token × layer × rank rows, layer_info).

    The one "batch → rows" step of every writer (single process, Ray workers; the single process builds
    the rows of `capture_batch`'s trace with `batch_rows` in its writer thread)."""
    trace = capture_batch(loaded, batch)
    table = batch_rows(trace, batch, model=model, checkpoint=checkpoint, confidence=confidence)
    return table, layer_info(trace)


def progress_bar(model: str, checkpoint: str, progress: bool):
    """A tokens/s bar on stderr (disabled when `progress` is false)."""
    from tqdm import tqdm

    return tqdm(
        desc=f"tracing {model}/{checkpoint}",
        unit="tok",
        unit_scale=True,
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )


class _Prefetch:
    """Iterate `items` (the batch plan: reading, tokenising, chunking, hashing) in a background thread, at
    most `depth` items ahead, so the next batch is ready when the forward of this one ends.

    The tokenizer releases the GIL while it encodes. An exception of the plan is raised here, in plan
    order (after the batches before it); `close` stops the thread (a run interrupted mid-plan)."""

    _END = object()

    def __init__(self, items, depth: int = 2) -> None:
        self.items = items
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="moeviz-store-plan", daemon=True)
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self.items:
                if isinstance(item, Batch):
                    _ = item.token_hash, item.num_tokens  # computed here, off the forward's thread
                if not self._put(("item", item)):
                    return
        except BaseException as exc:
            self._put(("error", exc))
            return
        self._put(("end", self._END))

    def __iter__(self):
        while True:
            kind, value = self.queue.get()
            if kind == "error":
                raise value
            if kind == "end":
                return
            yield value

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


class _PartWriter:
    """A background thread that builds each batch's rows from its trace, writes the part and appends the
    manifest, so the next forward overlaps all of it (Parquet encoding, zstd, hashing and fsync release the
    GIL). Nothing written is read back: the part's size and sha256 come from the bytes in memory.

    The queue holds at most `depth` batches: memory stays bounded."""

    def __init__(self, folder: Path, rows: Callable[[Any, Batch], pa.Table], depth: int = 2) -> None:
        self.folder = folder
        self.rows = rows
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="moeviz-store-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        manifest = self.folder / MANIFEST_FILE
        first = True
        while True:
            item = self.queue.get()
            if item is None:
                return
            if self.error is not None:
                continue
            batch, trace = item
            try:
                entry = write_part(self.folder, batch, self.rows(trace, batch))
                # after our own first complete line the manifest ends with a newline: no need to look
                append_manifest(manifest, entry, check_tail=first)
                first = False
            except BaseException as exc:
                self.error = exc

    def put(self, batch: Batch, trace) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put((batch, trace))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


# The keywords every writer of a corpus run takes, first and in this order (`write_corpus`, `write_series`
# and their Ray versions; tests/unit/test_store_checkpoints.py checks the signatures): the model label
# (default: from the source), TraceSettings, resume a run, show progress. A single run also takes its
# checkpoint label and index.
RUN_KEYWORDS = ("model", "settings", "resume", "progress")


def write_corpus(
    loaded,
    corpus: str | Path,
    store: str | Path,
    *,
    model: str | None = None,
    settings: TraceSettings | None = None,
    resume: bool = False,
    progress: bool = True,
    checkpoint: str = "final",
    checkpoint_index: int = 0,
    on_batch: Callable[[Batch], None] | None = None,
    capture: Callable[[Batch], Any] | None = None,
) -> RunInfo:
    """Route every token of `corpus` through `loaded` (a `moeviz.LoadedModel`) into `store`.

    Writes one Parquet part per batch into `store/model=<model>/checkpoint=<checkpoint>/` (see
    `moeviz.store.layout`); with `resume`, batches already in the manifest are skipped after checking
    that their token ids are unchanged. Returns the finished run. `on_batch` is called after each batch
    is queued for writing (tests use it to interrupt a run at a known point).

    `capture(batch) -> Trace` captures each batch instead of moeviz's own capture of `loaded` (default
    `capture_batch(loaded, batch)`): a live engine, e.g. `moeviz.engines.vllm.VllmSession.capture_batch`,
    whose session then stands in for `loaded` (it has the `tokenizer`, `info.source`, `info.model_type` and
    `max_length` a run reads)."""
    settings = settings or TraceSettings()
    if loaded.tokenizer is None:
        raise StoreError("tracing a corpus needs a model with a tokenizer")
    store = Path(store)
    model = model or default_label(loaded.info.source)
    config = run_config(
        loaded.info.source, loaded.info.model_type, loaded.max_length, corpus, settings, checkpoint_index
    )
    if getattr(loaded.info, "adapter", ""):  # the PEFT adapter merged over the source (AdapterInfo JSON)
        config["adapter"] = loaded.info.adapter
    with writing_run(store, model, checkpoint, config, resume) as (folder, done):

        def rows(trace, batch: Batch) -> pa.Table:
            return batch_rows(
                trace, batch, model=model, checkpoint=checkpoint, confidence=settings.confidence
            )

        writer = _PartWriter(folder, rows)
        plan = _Prefetch(plan_batches(corpus, loaded.tokenizer, config, settings))
        total = 0
        layers: list[dict[str, Any]] | None = None
        bar = progress_bar(model, checkpoint, progress)
        started = time.perf_counter()
        try:
            for batch in plan:
                total = batch.index + 1
                if is_done(done, batch):
                    continue
                trace = capture_batch(loaded, batch) if capture is None else capture(batch)
                if layers is None:
                    layers = layer_info(trace)
                writer.put(batch, trace)
                bar.update(batch.num_tokens)
                if on_batch is not None:
                    on_batch(batch)
        finally:
            plan.close()
            bar.close()
            writer.close()  # drains: every queued batch is complete, so writing it is correct
        run = finish_run(folder, total, layers)
    if progress:
        elapsed = time.perf_counter() - started
        print(f"traced {model}/{checkpoint}: {total} batches in {elapsed:.1f}s", file=sys.stderr)
    return run


def write_trace(
    trace,
    store: str | Path,
    *,
    model: str,
    checkpoint: str = "final",
    checkpoint_index: int = 0,
    seq_domains: list[str] | None = None,
    source: str = "trace",
) -> RunInfo:
    """Write an in-memory `Trace` as a complete one-batch run (synthetic series, tests, the app).

    `seq_domains[i]`: domain of trace sequence i (default ""); documents are numbered by sequence."""
    num_seqs = int(trace.tokens["seq"].max()) + 1 if len(trace.tokens) else 0
    domains = list(seq_domains) if seq_domains is not None else [""] * num_seqs
    ids = [
        group.sort_values("pos")["token_id"].astype(int).tolist()
        for _, group in trace.tokens[trace.tokens["stream"] == "input"].groupby("seq", sort=True)
    ]
    config = {
        "source": source,
        "model_type": trace.model.model_type,
        "corpus": None,
        "corpus_id": token_hash(ids),
        "chunk_tokens": None,
        "batch_size": num_seqs,
        "max_batches": None,
        "confidence": False,
        "checkpoint_index": checkpoint_index,
        "total_batches": None,
    }
    batch = Batch(0, 0, ids, list(range(num_seqs)), domains)
    table = trace_table(
        trace,
        model=model,
        checkpoint=checkpoint,
        batch=0,
        seq_offset=0,
        seq_docs=batch.docs,
        seq_domains=domains,
    )
    with writing_run(Path(store), model, checkpoint, config, resume=False) as (folder, _):
        append_manifest(folder / MANIFEST_FILE, write_part(folder, batch, table))
        return finish_run(folder, 1, layer_info(trace))
