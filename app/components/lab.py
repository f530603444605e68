"""The Lab page's runs: each session owns at most one `moeviz.lab.LabRunner` (a background training thread),
kept in `st.session_state`; trained models join that session's model picker; no model math here.

Runs view. Every run a session starts gets a short name ("run 3", or "run 3 · healthy" for an unchanged
preset): the Lab's runs table, its overlaid curves and the model picker all name it so. When a new run
starts, the previous one is kept as its settings and history (`KeptRun`, at most MAX_KEPT_RUNS, the oldest
forgotten first; not its model, nor its per-expert loads), so the page can overlay the runs' curves.

Sessions and threads. Streamlit has no session-end hook, so every runner is also registered here by the id
of the session that started it and its kind (`_REGISTRY`: the session's Lab run and its fine-tune,
`components.finetune`, one of each). A janitor thread (one per server process, alive only while runners are
registered) looks every SWEEP_S seconds and stops the runners of a session that has not been connected for
GRACE_S seconds (Streamlit keeps a disconnected session that long for a reconnect), then forgets them; the
same sweep runs when a session starts a run or a fine-tune. A session starting a new run, or pressing Reset,
stops its previous runner of that kind first. The runner threads are daemon threads and end by themselves
after their steps (at most `moeviz.lab.config.MAX_STEPS`), so a runner never outlives the server process
either.
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
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import streamlit as st
from streamlit.runtime import Runtime
from streamlit.runtime.scriptrunner import get_script_run_ctx

from components import access
from moeviz.lab import PRESETS, LabBusy, LabConfig, LabRunner, LabTooLarge

RUNNER = "lab_runner"  # st.session_state: the session's LabRunner (or absent)
MESSAGE = "lab_message"  # st.session_state: (kind, text) to show once above the run
LAB_MODELS = "lab_models"  # st.session_state: picker name -> saved model folder (this session's)
KEPT_RUNS = "lab_kept_runs"  # st.session_state: this session's earlier runs, [KeptRun], oldest first
RUN_COUNT = "lab_run_count"  # st.session_state: runs this session started (numbers their names)
MAX_KEPT_RUNS = 8  # earlier runs kept for the runs view (a history is at most MAX_STEPS small rows)
ACTIVE = ("idle", "running")  # the states in which the curves change (the page polls fast)
GRACE_S = 120.0
STOP_WAIT_S = 10.0  # longest wait for a stopped run's step in progress
SWEEP_S = 10.0


@dataclass
class _Entry:
    runner: LabRunner
    seen: float  # monotonic time the session was last seen connected


_REGISTRY: dict[tuple[str, str], _Entry] = {}  # (session id, kind: "lab" or "finetune") -> its runner
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
    """Stop and forget the runners of sessions gone for over GRACE_S seconds (→ those sessions' ids); a
    stopped or finished runner of a gone session is forgotten too (its memory goes with the session)."""
    now = time.monotonic() if now is None else now
    gone = []
    with _LOCK:
        for key, entry in list(_REGISTRY.items()):
            if _connected(key[0]):
                entry.seen = now
            elif now - entry.seen > GRACE_S:
                gone.append((key[0], _REGISTRY.pop(key).runner))
    for _, runner in gone:
        runner.stop()
    return list(dict.fromkeys(session_id for session_id, _ in gone))


def _janitor_loop() -> None:
    global _janitor
    while True:
        time.sleep(SWEEP_S)
        sweep()
        with _LOCK:
            if not _REGISTRY:
                _janitor = None
                return


def register(runner: LabRunner, kind: str = "lab") -> None:
    """Put the session's runner of `kind` ("lab", "finetune") in the janitor's care, in place of the
    session's previous one of that kind."""
    global _janitor
    with _LOCK:
        _REGISTRY[(_session_id(), kind)] = _Entry(runner, time.monotonic())
        if _janitor is None or not _janitor.is_alive():
            _janitor = threading.Thread(target=_janitor_loop, name="moeviz-lab-janitor", daemon=True)
            _janitor.start()


def forget(runner: LabRunner) -> None:
    """Take the runner out of the janitor's care (it was stopped)."""
    with _LOCK:
        for key, entry in list(_REGISTRY.items()):
            if entry.runner is runner:
                del _REGISTRY[key]


@dataclass(frozen=True)
class KeptRun:
    """A run as the runs view shows it: its name, settings, state and per-step history (`LabRun.history()`),
    and the step its collapse verdict first tripped (None: never)."""

    name: str
    config: LabConfig
    state: str
    history: pd.DataFrame
    collapse_step: int | None


def run_name(number: int, config: LabConfig) -> str:
    """The short name of the session's `number`-th run: "run 3", "run 3 · healthy" when it is a preset
    unchanged. Short, so that the sidebar's model picker shows it whole ("lab: run 3 · hub experts"); the
    runs table gives its settings."""
    preset = next((name for name, values in PRESETS.items() if values == config), None)
    return f"run {number}" + (f" · {preset}" if preset else "")


def name_of(current: LabRunner) -> str:
    """The name the runner got when it started (a runner made elsewhere gets the next number)."""
    name = _NAMES.get(current)
    if name is None:
        number = st.session_state[RUN_COUNT] = st.session_state.get(RUN_COUNT, 0) + 1
        name = _NAMES[current] = run_name(number, current.config)
    return name


def _as_kept(current: LabRunner, history: pd.DataFrame) -> KeptRun:
    run = current.run
    return KeptRun(
        name_of(current),
        current.config,
        current.state,
        history,
        None if run is None else run.collapse_step,
    )


def session_runs(history: pd.DataFrame | None = None) -> list[KeptRun]:
    """This session's runs, oldest first: the kept earlier runs, then the current one (its `history` when
    the caller has just taken a snapshot, else a new one)."""
    runs = list(st.session_state.get(KEPT_RUNS, []))
    current = runner()
    if current is not None:
        if history is None:
            history = current.run.history() if current.run is not None else current.snapshot()[0]
        runs.append(_as_kept(current, history))
    return runs


def _keep(current: LabRunner) -> None:
    """Keep the runner's settings and history for the runs view (a run with no step done is not kept)."""
    if current.run is None or current.steps_done == 0:
        return
    kept = [*st.session_state.get(KEPT_RUNS, []), _as_kept(current, current.run.history())]
    st.session_state[KEPT_RUNS] = kept[-MAX_KEPT_RUNS:]


def forget_kept_runs() -> None:
    """Button callback: forget the session's earlier runs (the current one stays)."""
    st.session_state[KEPT_RUNS] = []


# `LabConfig` field -> the runs table's column (short: the table sits in the page's narrower column)
SETTING_COLUMNS = {
    "experts": "experts",
    "k": "k",
    "aux_coef": "aux",
    "z_coef": "z-loss",
    "bias_rate": "bias γ",
    "capacity_factor": "capacity",
    "router_noise": "noise",
    "lr": "lr",
    "steps": "steps",
    "seed": "seed",
    "d_model": "width",
    "layers": "layers",
    "batch": "batch",
    "seq": "seq",
    "eval_every": "eval every",
    "expert_ffn": "expert FFN",
}


def runs_table(runs: list[KeptRun]) -> pd.DataFrame:
    """One row per run: its name, state, steps done, the last train and held-out losses, the step its
    collapse verdict first tripped (None: never), then every `LabConfig` setting (SETTING_COLUMNS)."""
    rows = []
    for kept in runs:
        history = kept.history
        heldout = history["heldout_loss"].dropna()
        settings = asdict(kept.config)
        rows.append(
            {
                "run": kept.name,
                "state": kept.state,
                "steps done": int(history["step"].max()) if len(history) else 0,
                "train loss": float(history["train_loss"].iloc[-1]) if len(history) else None,
                "held-out loss": float(heldout.iloc[-1]) if len(heldout) else None,
                "collapse at step": kept.collapse_step,
                **{column: settings[field] for field, column in SETTING_COLUMNS.items()},
            }
        )
    return pd.DataFrame(rows)


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
        forget(current)


def start(config: LabConfig) -> None:
    """Button callback: stop the session's previous run (kept for the runs view) and start a new one with
    `config`; on LabBusy (the server's limit of concurrent trainings or of their memory) or LabTooLarge a
    message instead."""
    sweep()
    previous = runner()
    _drop()
    if previous is not None:
        _keep(previous)
    new = LabRunner(config)
    try:
        new.start()
    except (LabBusy, LabTooLarge) as exc:
        st.session_state[MESSAGE] = ("busy", str(exc))
        return
    st.session_state[RUNNER] = new
    name_of(new)
    register(new)


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
    name = name_of(current)  # short: the picker cuts a long name ("run 1 · E=8 k=2 aux=0.01 z=…")
    models[name] = str(_save(current))
    st.session_state["model"] = access.LAB_PREFIX + name


def opened_name() -> str | None:
    """The picker name of the session's run, once opened on the other pages."""
    current = runner()
    if current is None:
        return None
    name = _NAMES.get(current)
    return name if name in st.session_state.get(LAB_MODELS, {}) else None


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
