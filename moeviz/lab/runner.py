"""Run a `LabRun` in a background thread of the server, with pause / resume / stop and a server-wide limit.

At most `max_runs()` runners hold a training slot at once (env `MOEVIZ_LAB_MAX_RUNS`, default 2): a slot is
taken by `start()` and given back when the thread ends (done, stopped or failed); a paused run keeps its
slot (it holds its model and can resume at once). Starting beyond the limit raises `LabBusy`. Threads are
daemons, so a server that exits does not wait for them; `stop()` ends one after its current step.

Memory is bounded: `start()` estimates the run's memory (`moeviz.lab.budget`) and refuses it when the runs
holding a slot and this one would exceed the server's lab budget; a run paused longer than `pause_limit`
seconds (default PAUSE_LIMIT) is stopped; a run that ends (done, stopped, failed) drops its gradients and
optimiser state and keeps only the weights the other pages open. A run's history has at most `MAX_STEPS`
rows and its load history at most MAX_STEPS × layers × experts float32 values.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Iterator

import pandas as pd

from moeviz.errors import LabBusy, LabTooLarge
from moeviz.lab.budget import LabMemory, gib, memory_budget, memory_estimate
from moeviz.lab.config import LabConfig
from moeviz.lab.data import lab_corpus
from moeviz.lab.train import HISTORY_COLUMNS, LOAD_COLUMNS, LabRun, lab_threads
from moeviz.models.loading import LoadedModel
from moeviz.settings import current_settings

DEFAULT_MAX_RUNS = 2
PAUSE_LIMIT = 600.0  # seconds a run may stay paused before it is stopped and its training state released
MAX_RUNS = DEFAULT_MAX_RUNS  # the default limit; max_runs() reads MOEVIZ_LAB_MAX_RUNS at each start
STATES = ("idle", "running", "paused", "done", "stopped", "error")

_SLOTS_LOCK = threading.Lock()
_ACTIVE: dict[int, int] = {}  # id() of the runners holding a slot -> their estimated bytes


def max_runs() -> int:
    """The server-wide limit: env MOEVIZ_LAB_MAX_RUNS (0 disables the Lab), else DEFAULT_MAX_RUNS."""
    limit = current_settings().lab_max_runs
    return DEFAULT_MAX_RUNS if limit is None else limit


def active_runs() -> int:
    """How many runners hold a training slot now."""
    with _SLOTS_LOCK:
        return len(_ACTIVE)


class LabRunner:
    """Trains `LabRun(config)` in a daemon thread: `start()`, `pause()`, `resume()`, `stop()`; `state` is one
    of STATES, `error` the failure's message; `snapshot()` copies the histories under the run's lock."""

    def __init__(self, config: LabConfig, pause_limit: float = PAUSE_LIMIT):
        self.config = config
        self.pause_limit = pause_limit
        self.memory = self._estimate()
        self.note: str | None = None  # why the run ended early without an error (a pause that timed out)
        self.run: LabRun | None = None
        self.error: str | None = None
        self.traceback: str | None = None  # the failure's traceback, for a log
        self._state = "idle"
        self._lock = threading.Lock()
        self._go = threading.Event()  # set = may train; cleared by pause()
        self._parked = threading.Event()  # set while the thread waits in a pause
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> str:
        return self._state

    @property
    def steps_done(self) -> int:
        return 0 if self.run is None else self.run.steps_done

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start training in the background; LabBusy when the server's limit is reached. A runner starts
        once (make a new one to train again)."""
        with self._lock:
            if self._state != "idle":
                raise RuntimeError(f"this lab run was already started (state {self._state})")
            with _SLOTS_LOCK:
                if max_runs() == 0:
                    raise LabBusy("the Lab is disabled on this server (MOEVIZ_LAB_MAX_RUNS=0)")
                if len(_ACTIVE) >= max_runs():
                    raise LabBusy(
                        f"busy: {len(_ACTIVE)} trainings are running on this server; try again in a moment"
                    )
                budget, held = memory_budget(), sum(_ACTIVE.values())
                if self.memory.total > budget:
                    raise LabTooLarge(
                        f"this run needs {self.memory.describe()}; the server allows {gib(budget)} for lab "
                        "runs (MOEVIZ_LAB_MEMORY_GIB): fewer or narrower experts, fewer layers, a smaller "
                        "batch or shorter sequences"
                    )
                if held + self.memory.total > budget:
                    raise LabBusy(
                        f"busy: the trainings running on this server hold ≈ {gib(held)} of the {gib(budget)} "
                        f"allowed and this one needs ≈ {gib(self.memory.total)}; try again when one ends"
                    )
                _ACTIVE[id(self)] = self.memory.total
            self._go.set()
            self._state = "running"
            self._thread = threading.Thread(target=self._work, name="moeviz-lab", daemon=True)
            try:
                self._thread.start()
            except BaseException:
                self._release()
                self._state = "idle"
                raise

    def pause(self, wait: float = 5.0) -> None:
        """Pause after the current step; waits up to `wait` seconds for it to finish."""
        with self._lock:
            if self._state != "running":
                return
            self._go.clear()
            self._state = "paused"
        if self.alive:  # the step in progress finishes first; then the thread parks
            self._parked.wait(wait)

    def resume(self) -> None:
        with self._lock:
            if self._state == "paused":
                self._state = "running"
                self._go.set()

    def stop(self, wait: float | None = None) -> None:
        """Ask the thread to end after its current step; `wait`: seconds to wait for it (None: don't)."""
        with self._lock:
            if self._state in ("idle", "running", "paused"):
                self._stop.set()
                self._go.set()
                if self._state == "idle":
                    self._state = "stopped"
        if wait is not None and self._thread is not None:
            self._thread.join(wait)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def snapshot(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(history, load history) copies (empty frames with the columns before the first step)."""
        run = self.run
        if run is None:
            return pd.DataFrame(columns=HISTORY_COLUMNS), pd.DataFrame(columns=LOAD_COLUMNS)
        return run.history(), run.load_history()

    def loaded_model(self) -> LoadedModel:
        """The model as trained so far (a copy), for the other pages."""
        if self.run is None:
            raise RuntimeError("the lab run has not built its model yet")
        return self.run.loaded_model()

    # -- the thread ------------------------------------------------------------------------------------
    def _work(self) -> None:
        final = "error"
        try:
            with lab_threads():  # this thread trains on LAB_THREADS torch threads for its whole life
                final = self._train()
        except Exception as exc:  # reported through state/error: the page shows it
            self.error = f"{type(exc).__name__}: {exc}"
            self.traceback = traceback.format_exc()
        finally:
            self._parked.clear()
            if self.run is not None:
                self.run.release_training_state()
            with self._lock:
                self._state = final
            self._release()

    def _estimate(self) -> LabMemory:
        """The bytes the runner's training holds (a subclass training other runs counts its own)."""
        return memory_estimate(self.config, lab_corpus().vocab_size)

    def _make_runs(self) -> Iterator:
        """The runs this runner trains, one after another (a LabRun of its config)."""
        yield LabRun(self.config)

    def _train(self) -> str:
        """Build each run and step it until done or stopped; the final state."""
        for run in self._make_runs():
            self.run = run
            while not self.run.done:
                if not self._go.is_set():
                    self._parked.set()
                    resumed = self._go.wait(self.pause_limit)
                    self._parked.clear()
                    if not resumed:
                        self.note = (
                            f"stopped after {self.pause_limit / 60:g} min paused: its memory was released"
                        )
                        return "stopped"
                if self._stop.is_set():
                    return "stopped"
                self.run.step()
        return "done"

    def _release(self) -> None:
        with _SLOTS_LOCK:
            _ACTIVE.pop(id(self), None)
