"""The Engines page's vLLM side: the sidebar model run in vLLM (`moeviz.engines.vllm`) on the prompt at a
dtype — the routing vLLM itself dispatched — shared by every session of the server.

`VllmRunner` (no Streamlit in it) owns the server's one vLLM worker and runs every capture on one thread of
its own, so two sessions never start two engines at once (an engine start takes ~12 s and a few hundred MB
besides the import of vLLM): a second request waits in line, and the same (model source, dtype, text) asked
for by several sessions is captured once. The engine stays up for the next prompt (a capture then takes
well under a second; another model or dtype restarts only the engine, vLLM stays imported) and is stopped
after `IDLE_S` without use. The latest `SIZE` outcomes are kept per (model source, dtype, text): the trace,
or the library's error (a model vLLM cannot run fails the same way on every rerun of the page; "Try again"
forgets it). The page polls its request from the script thread and shows the worker's progress in an
`st.status`; a rerun of the page while vLLM runs only stops the polling, never the capture.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import streamlit as st

import moeviz
from moeviz.engines.vllm import VllmSession, vllm_environment

SIZE = 8  # outcomes kept, as the app's capture cache (`caches.captures`)
IDLE_S = 600.0  # the warm engine is stopped after this long without a capture
POLL_S = 0.25  # how often the page looks for new progress messages

Key = tuple[str, str, str]  # (model source, dtype, text)


@dataclass
class VllmJob:
    """One request: `outcome` resolves to the trace (or raises the library's error); `messages` is the
    worker's progress so far, appended on the vLLM thread and read by the page."""

    key: Key
    outcome: Future = field(default_factory=Future)
    messages: list[str] = field(default_factory=list)


class VllmRunner:
    """The server's vLLM worker and its captures (module docstring). `session` builds a `VllmSession`
    (tests may give another)."""

    def __init__(
        self, size: int = SIZE, idle_s: float = IDLE_S, session: Callable[..., VllmSession] = VllmSession
    ) -> None:
        self._size, self._idle_s, self._new_session = size, idle_s, session
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeviz-vllm")
        self._lock = threading.Lock()
        self._done: OrderedDict[Key, VllmJob] = OrderedDict()
        self._queued: dict[Key, VllmJob] = {}
        # touched only on the vLLM thread:
        self._session: VllmSession | None = None
        self._running: tuple[str, str] | None = None  # (model source, dtype) of the engine up now
        self._uses = 0  # captures started; the idle timer stops the engine only if none came since

    def request(self, model: str, dtype: str, text: str) -> VllmJob:
        """The job of (model, dtype, text): kept, in line, or queued now."""
        key = (model, dtype, text)
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                return self._done[key]
            job = self._queued.get(key)
            if job is None:
                job = self._queued[key] = VllmJob(key)
                if len(self._queued) > 1:
                    job.messages.append("waiting for the vLLM capture another session asked for first")
                self._thread.submit(self._run, job)
            return job

    def forget(self, model: str, dtype: str, text: str) -> None:
        """Drop the kept outcome of (model, dtype, text): the next request runs vLLM again."""
        with self._lock:
            self._done.pop((model, dtype, text), None)

    def cached_keys(self) -> list[Key]:
        """The kept (model, dtype, text), least recently used first."""
        with self._lock:
            return list(self._done)

    def close(self) -> None:
        """Stop the engine and its worker now (after the captures in line)."""
        self._thread.submit(self._stop).result()

    # ---- on the vLLM thread -----------------------------------------------------------------------------
    def _run(self, job: VllmJob) -> None:
        self._uses += 1
        try:
            trace = self._capture(job)
        except moeviz.MoevizError as exc:  # kept: the same request fails the same way
            self._finish(job, keep=True)
            job.outcome.set_exception(exc)
        except BaseException as exc:  # not kept: a fault of this server, not of the request
            self._finish(job, keep=False)
            job.outcome.set_exception(exc)
        else:
            self._finish(job, keep=True)
            job.outcome.set_result(trace)
        finally:
            uses = self._uses
            timer = threading.Timer(self._idle_s, self._submit, args=(self._stop_if_idle, uses))
            timer.daemon = True
            timer.start()

    def _capture(self, job: VllmJob) -> moeviz.Trace:
        model, dtype, text = job.key
        say = job.messages.append
        if self._session is None:
            self._running = None
            self._session = self._new_session(model, dtype=dtype, progress=say)
        session = self._session
        session.progress = say  # this job's messages
        if self._running != (model, dtype):
            self._running = None
            session.switch(model, dtype=dtype)  # the first start, or another engine in the same worker
            self._running = (model, dtype)
        return session.capture(texts=text)

    def _finish(self, job: VllmJob, keep: bool) -> None:
        with self._lock:
            self._queued.pop(job.key, None)
            if keep:
                self._done[job.key] = job
                while len(self._done) > self._size:
                    self._done.popitem(last=False)

    def _submit(self, work: Callable, *args) -> None:
        with contextlib.suppress(RuntimeError):  # the server is exiting: its worker exits with it
            self._thread.submit(work, *args)

    def _stop_if_idle(self, uses: int) -> None:
        if uses == self._uses:
            self._stop()

    def _stop(self) -> None:
        session, self._session, self._running = self._session, None, None
        if session is not None:
            session.close()


@st.cache_resource
def runner() -> VllmRunner:
    """The server's vLLM runner (one worker for every session)."""
    return VllmRunner()


def environment_hint() -> str | None:
    """What to do when the vLLM environment is absent (with the command that installs it); None when it is
    there. A cheap check: nothing is started."""
    env = vllm_environment()
    return None if env.present else env.message


def trace(model: str, dtype: str, text: str, retry_key: str) -> moeviz.Trace:
    """The routing vLLM dispatched for `text` with `model` (a checked model source) at `dtype`, from the
    server's runner; while vLLM runs, its progress in an `st.status`. The library's error stops the page as
    one line, with a button (keyed `retry_key`) that runs it again."""
    job = runner().request(model, dtype, text)
    if not job.outcome.done():
        _show_progress(job, dtype)
    try:
        return job.outcome.result()
    except moeviz.MoevizError as exc:
        st.error(str(exc), icon=":material/error:")
        st.button(
            "Try vLLM again", key=retry_key, icon=":material/refresh:", on_click=runner().forget, args=job.key
        )
        st.stop()


def _show_progress(job: VllmJob, dtype: str) -> None:
    """The worker's messages as they come, and the time so far in the label (updated each second: it also
    lets a rerun of the page stop the polling during vLLM's long silent import)."""
    title = f"Running the prompt in vLLM at {dtype}"
    started = time.monotonic()
    with st.status(f"{title}…", expanded=True) as status:
        shown, latest, labelled = 0, "", -1
        while True:
            try:
                job.outcome.exception(timeout=POLL_S)
                done = True
            except TimeoutError:
                done = False
            for message in job.messages[shown:]:
                st.text(message)
                shown, latest = shown + 1, message
            if done:
                break
            elapsed = int(time.monotonic() - started)
            if elapsed != labelled:
                # expanded each time: an update without it folds the box in the browser
                status.update(label=f"{title}: {latest or 'waiting'}… ({elapsed} s)", expanded=True)
                labelled = elapsed
        failed = job.outcome.exception() is not None
        took = time.monotonic() - started
        status.update(
            label=f"vLLM could not run the prompt at {dtype}"
            if failed
            else f"vLLM ran the prompt at {dtype} ({took:.0f} s)",
            state="error" if failed else "complete",
            expanded=False,
        )
