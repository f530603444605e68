"""The Lab page's runs: each session owns at most one `moeviz.lab.LabRunner` (a background training thread),
kept in `st.session_state`; trained models join that session's model picker; no model math here.

Sessions and threads. Streamlit has no session-end hook, so every runner is also registered here by the id
of the session that started it (`_REGISTRY`). A janitor thread (one per server process, alive only while
runners are registered) looks every SWEEP_S seconds and stops the runner of a session that has not been
connected for GRACE_S seconds (Streamlit keeps a disconnected session that long for a reconnect), then forgets
it; the same sweep runs when a session starts a run. A session starting a new run, or pressing Reset, stops
its previous runner first. The runner threads are daemon threads and end by themselves after their steps
(at most `moeviz.lab.config.MAX_STEPS`), so a runner never outlives the server process either.
"""

from __future__ import annotations

import atexit
import io
import shutil
import tempfile
import threading
import time
import weakref
import zipfile
from dataclasses import dataclass
from pathlib import Path

import streamlit as st
from streamlit.runtime import Runtime
from streamlit.runtime.scriptrunner import get_script_run_ctx

from components import access
from moeviz.lab import LabBusy, LabConfig, LabRunner

RUNNER = "lab_runner"  # st.session_state: the session's LabRunner (or absent)
MESSAGE = "lab_message"  # st.session_state: (kind, text) to show once above the run
LAB_MODELS = "lab_models"  # st.session_state: picker name -> saved model folder (this session's)
ACTIVE = ("idle", "running")  # the states in which the curves change (the page polls fast)
GRACE_S = 120.0
STOP_WAIT_S = 10.0  # longest wait for a stopped run's step in progress
SWEEP_S = 10.0


@dataclass
class _Entry:
    runner: LabRunner
    seen: float  # monotonic time the session was last seen connected


_REGISTRY: dict[str, _Entry] = {}  # session id -> its runner
_LOCK = threading.Lock()
_SAVE_LOCK = threading.Lock()
_janitor: threading.Thread | None = None
_FOLDERS = Path(tempfile.mkdtemp(prefix="moeviz-lab-"))  # this process's saved lab models
atexit.register(shutil.rmtree, _FOLDERS, ignore_errors=True)
_SAVED: weakref.WeakKeyDictionary[LabRunner, Path] = weakref.WeakKeyDictionary()  # runner -> its folder
_NAMES: weakref.WeakKeyDictionary[LabRunner, str] = weakref.WeakKeyDictionary()  # runner -> picker name


def _session_id() -> str:
    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else "no-session"


def _connected(session_id: str) -> bool:
    """Whether the session is connected (always, outside a server: AppTest, bare mode)."""
    return not Runtime.exists() or Runtime.instance().is_active_session(session_id)


def sweep(now: float | None = None) -> list[str]:
    """Stop and forget the runners of sessions gone for over GRACE_S seconds (→ their ids); a stopped or
    finished runner of a gone session is forgotten too (its memory goes with the session)."""
    now = time.monotonic() if now is None else now
    gone = []
    with _LOCK:
        for session_id, entry in list(_REGISTRY.items()):
            if _connected(session_id):
                entry.seen = now
            elif now - entry.seen > GRACE_S:
                gone.append((session_id, _REGISTRY.pop(session_id).runner))
    for _, runner in gone:
        runner.stop()
    return [session_id for session_id, _ in gone]


def _janitor_loop() -> None:
    global _janitor
    while True:
        time.sleep(SWEEP_S)
        sweep()
        with _LOCK:
            if not _REGISTRY:
                _janitor = None
                return


def _register(runner: LabRunner) -> None:
    global _janitor
    with _LOCK:
        _REGISTRY[_session_id()] = _Entry(runner, time.monotonic())
        if _janitor is None or not _janitor.is_alive():
            _janitor = threading.Thread(target=_janitor_loop, name="moeviz-lab-janitor", daemon=True)
            _janitor.start()


def _forget(runner: LabRunner) -> None:
    with _LOCK:
        for session_id, entry in list(_REGISTRY.items()):
            if entry.runner is runner:
                del _REGISTRY[session_id]


def runner() -> LabRunner | None:
    """The session's runner, if it started one."""
    return st.session_state.get(RUNNER)


def state() -> str | None:
    """The state of the session's runner (None without one)."""
    current = runner()
    return None if current is None else current.state


def _drop() -> None:
    """Stop and forget the session's runner; waits for its step in progress, so that its training slot is
    free for the next start."""
    current = st.session_state.pop(RUNNER, None)
    if current is not None:
        current.stop(wait=STOP_WAIT_S)
        _forget(current)


def start(config: LabConfig) -> None:
    """Button callback: stop the session's previous run and start a new one with `config`; on LabBusy (the
    server's limit of concurrent trainings) a message instead."""
    sweep()
    _drop()
    new = LabRunner(config)
    try:
        new.start()
    except LabBusy as exc:
        st.session_state[MESSAGE] = ("busy", str(exc))
        return
    st.session_state[RUNNER] = new
    _register(new)


def pause() -> None:
    if (current := runner()) is not None:
        current.pause()


def resume() -> None:
    if (current := runner()) is not None:
        try:
            current.resume()
        except LabBusy as exc:
            st.session_state[MESSAGE] = ("busy", str(exc))


def reset() -> None:
    """Button callback: stop and forget the session's run (the controls keep their values)."""
    _drop()


def pop_message() -> tuple[str, str] | None:
    """The message a callback left for this run ((kind, text)), shown once."""
    return st.session_state.pop(MESSAGE, None)


# ---- the trained model on the other pages ---------------------------------------------------------------
def _save(current: LabRunner) -> Path:
    """The runner's model saved as a Hugging Face folder (once per runner), allowed as a model source."""
    with _SAVE_LOCK:
        saved = _SAVED.get(current)
        if saved is None or not saved.is_dir():
            saved = Path(current.run.save(Path(tempfile.mkdtemp(prefix="run-", dir=_FOLDERS))))
            access.allow_lab_folder(saved)
            _SAVED[current] = saved
    return saved


def open_in_picker() -> None:
    """Button callback: save the finished model, add it to this session's model picker ("lab: <name>") and
    select it there, so every other page opens on it."""
    current = runner()
    if current is None:
        return
    models = st.session_state.setdefault(LAB_MODELS, {})
    name = _NAMES.get(current)
    if name is None:
        name = _NAMES[current] = f"run {len(models) + 1} · {current.config.label()}"
    models[name] = str(_save(current))
    st.session_state["model"] = access.LAB_PREFIX + name


def opened_name() -> str | None:
    """The picker name of the session's run, once opened on the other pages."""
    current = runner()
    return None if current is None else _NAMES.get(current)


def zip_bytes(current: LabRunner) -> bytes:
    """The runner's trained model as a .zip of its Hugging Face folder (built when the download is clicked:
    bound to the runner, since the click is served outside the session's script run)."""
    folder = _save(current)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                archive.write(path, Path("moeviz-lab-model") / path.relative_to(folder))
    return buffer.getvalue()
