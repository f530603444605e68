"""Run a `LabRun` in a background thread of the server, with pause / resume / stop and a server-wide limit.

At most `max_runs()` runners hold a training slot at once (env `MOEVIZ_LAB_MAX_RUNS`, default 2): a slot is
taken by `start()` and given back when the thread ends (done, stopped or failed); a paused run keeps its
slot (it holds its model and can resume at once). Starting beyond the limit raises `LabBusy`. Threads are
daemons, so a server that exits does not wait for them; `stop()` ends one after its current step.

Memory is bounded: a run's history has at most `MAX_STEPS` rows and its load history at most
MAX_STEPS × layers × experts float32 values (10 MB at the largest config); the model is small.
"""

from __future__ import annotations

import threading
import traceback

import pandas as pd

from moeviz.errors import MoevizError
from moeviz.lab.config import LabConfig
from moeviz.lab.train import HISTORY_COLUMNS, LOAD_COLUMNS, LabRun, lab_threads
from moeviz.models.loading import LoadedModel
from moeviz.settings import current_settings

DEFAULT_MAX_RUNS = 2
MAX_RUNS = DEFAULT_MAX_RUNS  # the default limit; max_runs() reads MOEVIZ_LAB_MAX_RUNS at each start
STATES = ("idle", "running", "paused", "done", "stopped", "error")

_SLOTS_LOCK = threading.Lock()
_ACTIVE: set[int] = set()  # id() of the runners holding a slot


class LabBusy(MoevizError):
    """The server already runs as many lab trainings as it allows."""


def max_runs() -> int:
    """The server-wide limit: env MOEVIZ_LAB_MAX_RUNS (a positive integer), else DEFAULT_MAX_RUNS."""
    return current_settings().lab_max_runs or DEFAULT_MAX_RUNS


def active_runs() -> int:
    """How many runners hold a training slot now."""
    with _SLOTS_LOCK:
        return len(_ACTIVE)


class LabRunner:
    """Trains `LabRun(config)` in a daemon thread: `start()`, `pause()`, `resume()`, `stop()`; `state` is one
    of STATES, `error` the failure's message; `snapshot()` copies the histories under the run's lock."""

    def __init__(self, config: LabConfig):
        self.config = config
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
                if len(_ACTIVE) >= max_runs():
                    raise LabBusy(
                        f"busy: {len(_ACTIVE)} trainings are running on this server; try again in a moment"
                    )
                _ACTIVE.add(id(self))
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
            with self._lock:
                self._state = final
            self._release()

    def _train(self) -> str:
        """Build the run and step it until done or stopped; the final state."""
        self.run = LabRun(self.config)
        while not self.run.done:
            if not self._go.is_set():
                self._parked.set()
                self._go.wait()
                self._parked.clear()
            if self._stop.is_set():
                return "stopped"
            self.run.step()
        return "done"

    def _release(self) -> None:
        with _SLOTS_LOCK:
            _ACTIVE.discard(id(self))
