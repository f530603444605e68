"""The Lab page's fine-tune section: pick a start model (a bundled Mixtral sample, or the model this session's
Lab run trained), a new domain (a domain of the sample corpus, or pasted text) and the modes, run them one
after another in a `moeviz.lab.finetune.FinetuneRunner`, watch the curves of every mode on shared axes,
compare the modes side by side at the end, and open each fine-tuned model on the other pages. Each session
owns at most one fine-tune runner (`st.session_state`); no model math here.

A fine-tune is under the Lab's limits, as a Lab run is: it takes one of the server's training slots
(`MOEVIZ_LAB_MAX_RUNS`, counted with the Lab runs) and its share of the memory budget; Pause / Resume hold
its slot, and a pause longer than the runner's pause limit stops it; an ended run drops its gradients and
optimiser state; and the Lab's janitor (`components.lab.register`) stops it once its session is gone.
"""

from __future__ import annotations

import atexit
import functools
import io
import shutil
import tempfile
import threading
import zipfile
from dataclasses import fields
from pathlib import Path

import streamlit as st

import moeviz
from components import access, exports
from components import lab as lab_runs
from components.widgets import keep
from moeviz.charts.lab import lab_finetune_chart
from moeviz.errors import InputError, LabBusy, LabTooLarge
from moeviz.lab.budget import gib, memory_budget
from moeviz.lab.curves import runs_curves
from moeviz.lab.finetune import (
    CURVE_METRICS,
    LORA_TARGETS,
    MODE_LABELS,
    MODES,
    FinetuneConfig,
    FinetuneRun,
    FinetuneRunner,
    finetune_summary,
    memory_needed,
    start_config,
)
from moeviz.samples import DOMAINS

RUNNER = "ft_runner"  # st.session_state: the session's FinetuneRunner (or absent)
MESSAGE = "ft_message"  # st.session_state: a refusal to show once
COUNT = "ft_count"  # st.session_state: fine-tunes this session started (numbers their names)
NUMBER = "ft_number"  # st.session_state: the number of the current runner's fine-tune
UNDER_WAY = ("idle", "running", "paused")  # a runner's states while it holds its training slot
TEXT_DOMAIN = "your text"
LAB_START = "the Lab's model"
DEFAULTS = FinetuneConfig()
CONTROL_WIDTH = 128
# field -> (label, lowest, highest, step, format, help): the bounds are FinetuneConfig's own
NUMBERS = {
    "steps": ("Steps", 1, 5000, 10, None, "Training steps of each mode."),
    "lr": ("Learning rate", 1e-5, 0.1, 1e-4, "%.5f", "AdamW learning rate (warm-up, then cosine)."),
    "seed": ("Seed", 0, 2**32 - 1, 1, None, "Same seed, same batches for every mode."),
    "lora_rank": ("LoRA rank", 1, 512, 1, None, "r of each LoRA pair; at most the smallest targeted matrix."),
    "lora_alpha": ("LoRA alpha", 1e-3, 1e4, 1.0, "%.1f", "The update is alpha / r · B·A."),
}
TRAIN_FIELDS, LORA_FIELDS = ("steps", "lr", "seed"), ("lora_rank", "lora_alpha")
_FOLDERS = Path(tempfile.mkdtemp(prefix="moeviz-finetune-"))  # this process's saved fine-tuned models
atexit.register(shutil.rmtree, _FOLDERS, ignore_errors=True)
_SAVE_LOCK = threading.Lock()


def _key(field: str) -> str:
    return f"ft_{field}"


def _kept(field: str, widget, *args, **kwargs):
    """A widget whose value survives page switches: kept under `ft_<field>`, drawn as `ft_<field>_widget`."""
    store = _key(field)
    st.session_state[f"{store}_widget"] = st.session_state[store]
    return widget(*args, key=f"{store}_widget", on_change=keep, args=(f"{store}_widget", store), **kwargs)


def _defaults(starts: list[str]) -> None:
    for f in fields(FinetuneConfig):
        if f.name in NUMBERS:
            st.session_state.setdefault(_key(f.name), getattr(DEFAULTS, f.name))
    st.session_state.setdefault(_key("modes"), list(MODES))
    st.session_state.setdefault(_key("targets"), list(DEFAULTS.lora_targets))
    st.session_state.setdefault(_key("domain"), DEFAULTS.domain)
    st.session_state.setdefault(_key("text"), "")
    if st.session_state.get(_key("start")) not in starts:
        st.session_state[_key("start")] = DEFAULTS.start if DEFAULTS.start in starts else starts[0]


def start_choices() -> list[str]:
    """The bundled Mixtral samples, then the Lab's model once this session's Lab run is done."""
    samples = [f"sample:{n}" for n in moeviz.list_samples() if n.startswith("mixtral") and "/" not in n]
    lab = lab_runs.runner()
    ready = lab is not None and lab.state == "done" and not lab.config.dense
    return samples + ([LAB_START] if ready else [])


def controls(locked: bool) -> tuple[list[FinetuneConfig], str | None]:
    """The start model, the new domain, the modes and the training settings → (one config per mode, None)
    or ([], what is wrong)."""
    starts = start_choices()
    _defaults(starts)
    top = st.container(horizontal=True, gap="small")
    with top:
        _kept("start", st.selectbox, "Start from", starts, disabled=locked, width=260)
        _kept(
            "domain",
            st.selectbox,
            "New domain",
            [*DOMAINS, TEXT_DOMAIN],
            disabled=locked,
            width=160,
            help="A domain of the sample corpus (its training text; the other domains are the old ones), or "
            "your own text (every corpus domain is then old).",
        )
        _kept(
            "modes",
            st.multiselect,
            "Modes",
            list(MODES),
            format_func=MODE_LABELS.get,
            disabled=locked,
            width=420,
            help="Router only: the routers' gate weights train, all else frozen. Experts only: the experts "
            "train, routers and attention frozen. LoRA: peft adapters on the targets below. Full: all.",
        )
    if st.session_state[_key("domain")] == TEXT_DOMAIN:
        _kept("text", st.text_area, "Text to fine-tune on", disabled=locked, height=120)
    lora_off = locked or "lora" not in st.session_state[_key("modes")]
    for names, disabled in ((TRAIN_FIELDS, locked), (LORA_FIELDS, lora_off)):
        row = st.container(horizontal=True, gap="small")
        for field in names:
            label, low, high, step, fmt, help_text = NUMBERS[field]
            with row:
                _kept(
                    field,
                    st.number_input,
                    label,
                    low,
                    high,
                    step=step,
                    format=fmt,
                    help=help_text,
                    disabled=disabled,
                    width=CONTROL_WIDTH,
                )
    with row:
        _kept(
            "targets",
            st.multiselect,
            "LoRA targets",
            list(LORA_TARGETS),
            disabled=lora_off,
            width=360,
            help="attention: q/k/v/o; router: each MoE layer's gate; experts: the fused expert tensors "
            "(one rank-r pair per expert, through peft's target_parameters; slower per step than full "
            "fine-tuning of the sample).",
        )
    return read_configs()


def _value(field: str):
    return st.session_state.get(f"{_key(field)}_widget", st.session_state[_key(field)])


def read_configs() -> tuple[list[FinetuneConfig], str | None]:
    """The controls' configs (one per mode, in MODES' order) → (them, None), or ([], what is wrong)."""
    modes = [m for m in MODES if m in (_value("modes") or [])]
    if not modes:
        return [], "fine-tune: pick at least one mode"
    domain = _value("domain")
    start = _value("start")
    try:
        configs = [
            FinetuneConfig(
                start=lab_runs.name_of(lab_runs.runner()) if start == LAB_START else start,
                mode=mode,
                domain=None if domain == TEXT_DOMAIN else domain,
                text=_value("text") if domain == TEXT_DOMAIN else None,
                steps=int(_value("steps")),
                lr=float(_value("lr")),
                seed=int(_value("seed")),
                lora_rank=int(_value("lora_rank")),
                lora_alpha=float(_value("lora_alpha")),
                lora_targets=tuple(t for t in LORA_TARGETS if t in (_value("targets") or [])),
            )
            for mode in modes
        ]
    except InputError as exc:
        return [], str(exc)
    return configs, None


def _start_model():
    """The Lab's trained model when it is the start (a copy), else None (the sample loads in the thread)."""
    if _value("start") != LAB_START:
        return None
    lab = lab_runs.runner()
    return None if lab is None else lab.loaded_model()


def start() -> None:
    """Start callback: stop the session's previous fine-tune and start the controls' modes one after
    another; a refusal (bad rank or text, the server busy or the run too large) becomes the message."""
    configs, problem = read_configs()
    if problem:
        st.session_state[MESSAGE] = problem
        return
    lab_runs.sweep()  # the runs of sessions gone for good give their slots back first
    stop()
    try:
        new = FinetuneRunner(configs, _start_model())
        new.start()
    except (InputError, LabBusy, LabTooLarge) as exc:
        st.session_state[MESSAGE] = str(exc)
        return
    st.session_state[RUNNER] = new
    st.session_state[NUMBER] = st.session_state[COUNT] = st.session_state.get(COUNT, 0) + 1
    lab_runs.register(new, "finetune")


def stop() -> None:
    """Stop callback: end the session's fine-tune after its step in progress (its slot comes back)."""
    current = st.session_state.get(RUNNER)
    if current is not None:
        current.stop(wait=lab_runs.STOP_WAIT_S)
        lab_runs.forget(current)


def pause() -> None:
    """Pause callback: the fine-tune parks after its step in progress, keeping its slot and its model."""
    if (current := runner()) is not None:
        current.pause()


def resume() -> None:
    if (current := runner()) is not None:
        current.resume()


def runner() -> FinetuneRunner | None:
    return st.session_state.get(RUNNER)


def run_name(run: FinetuneRun) -> str:
    """The picker name of a fine-tuned model: "ft 2 · LoRA"."""
    return f"ft {st.session_state.get(NUMBER, 1)} · {MODE_LABELS[run.config.mode]}"


# ---- the fine-tuned models on the other pages ----------------------------------------------------------
def _saved(run: FinetuneRun, merged: bool) -> Path:
    """The run's folder (once per run and kind): its model folder (`merged`: LoRA merged into its base, what
    the other pages open) or its own result (LoRA: the PEFT adapter folder)."""
    attribute = "_app_merged_folder" if merged else "_app_folder"
    with _SAVE_LOCK:
        folder = getattr(run, attribute, None)
        if folder is None or not folder.is_dir():
            folder = Path(tempfile.mkdtemp(prefix="ft-", dir=_FOLDERS))
            (run.save_merged if merged else run.save)(folder)
            setattr(run, attribute, folder)
    return folder


def open_in_picker(run: FinetuneRun) -> None:
    """Button callback: add the fine-tuned model to this session's model picker and select it there."""
    folder = _saved(run, merged=True)
    access.allow_lab_folder(folder)
    name = run_name(run)
    st.session_state.setdefault(lab_runs.LAB_MODELS, {})[name] = str(folder)
    st.session_state["model"] = access.LAB_PREFIX + name


def zip_bytes(run: FinetuneRun) -> bytes:
    """The run's result zipped: the PEFT adapter folder (LoRA) or the model folder."""
    folder = _saved(run, merged=False)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                archive.write(path, Path("moeviz-finetune") / path.relative_to(folder))
    return buffer.getvalue()


# ---- the view ----------------------------------------------------------------------------------------------
def curves(current: FinetuneRunner) -> None:
    """Every mode's curves so far on shared axes (2 × 2), and the aux loss of the training steps."""
    results = current.results()
    histories = {MODE_LABELS[r.config.mode]: r.history for r in results}
    frame = runs_curves(histories, CURVE_METRICS)
    order = [MODE_LABELS[c.mode] for c in current.configs]
    steps = max(c.steps for c in current.configs)
    even = 1.0 / current.model_config.num_local_experts
    for metrics in (CURVE_METRICS[:2], CURVE_METRICS[2:]):
        for column, metric in zip(st.columns(2, gap="medium"), metrics, strict=True):
            chart = lab_finetune_chart(
                frame, metric, runs=order, steps=steps, reference=even if metric == "max_share" else None
            )
            column.altair_chart(chart, width="stretch", key=f"ft_chart_{metric}")


def side_by_side(current: FinetuneRunner) -> None:
    """The modes side by side, and each fine-tuned model's actions."""
    summary = finetune_summary(current.results())
    st.markdown("**Side by side**")
    st.dataframe(summary.drop(columns="mode").round(4), hide_index=True, key="ft_summary")  # run = mode
    st.caption(
        "Adapted: the new-domain held-out loss fell by at least 0.02 nats. Forgot: the old domains' held-out "
        "loss rose by more than 0.02. Kept balance: no layer's busiest expert gained more than a quarter of "
        "an even share. Router mismatch: the share of (token, layer) top-k sets that differ from the start "
        "model's on the held-out batch."
    )
    row = st.container(horizontal=True, gap="small")
    for run in list(current.runs):
        if not run.done:
            continue
        label = MODE_LABELS[run.config.mode]
        row.button(
            f"Open {label}",
            key=f"ft_open_{run.config.mode}",
            icon=":material/open_in_new:",
            on_click=open_in_picker,
            args=(run,),
            help="Add it to the model picker of every page (this session only).",
        )
        row.download_button(
            f"{label} (.zip)",
            functools.partial(zip_bytes, run),
            f"moeviz-finetune-{run.config.mode}.zip",
            "application/zip",
            icon=":material/download:",
            on_click="ignore",
            key=f"ft_zip_{run.config.mode}",
            help="A PEFT adapter folder (adapter_config.json, adapter_model.safetensors)"
            if run.config.mode == "lora"
            else "A Hugging Face model folder that `moeviz.load_model` opens.",
        )
    row.download_button(
        "Table (.csv)",
        exports.csv_bytes(summary),
        "moeviz-finetune-summary.csv",
        "text/csv",
        icon=":material/download:",
        on_click="ignore",
        key="ft_summary_csv",
    )
    opened = [n for n in st.session_state.get(lab_runs.LAB_MODELS, {}) if n.startswith("ft ")]
    if opened:
        st.success("In the model picker of every page: " + ", ".join(f"**lab: {n}**" for n in opened))


def live() -> None:
    """The fine-tune's progress, curves and, once it ends, the side-by-side table (a fragment)."""
    current = runner()
    if current is None:
        st.info("Pick a start model, a new domain and the modes, then press **Fine-tune**.")
        return
    state = current.state
    run = current.run
    doing = f" · {MODE_LABELS[run.config.mode]}" if run is not None and state in ("idle", "running") else ""
    st.progress(
        min(current.steps_done / current.total_steps, 1.0),
        text=f"Step {current.steps_done} of {current.total_steps}{doing} · {state}",
    )
    if state == "error":
        st.error(f"The fine-tune stopped with an error: {current.error}")
    if current.runs:
        curves(current)
    if state in ("done", "stopped") and current.runs:
        side_by_side(current)
    if state != st.session_state.get("ft_drawn_state"):
        st.session_state["ft_drawn_state"] = state
        if state not in UNDER_WAY:
            st.rerun()  # the run ended: the whole section redraws (controls unlocked)


def section() -> None:
    """The Lab page's fine-tune section."""
    st.subheader("Fine-tune on a new domain")
    st.caption(
        "Start from a bundled sample (or the model the Lab just trained) and fine-tune it on a new domain in "
        "up to four modes, one after another on the same batches: which adapts, which forgets the old "
        "domains, which keeps the experts balanced, and how far the routing moves from the start model."
    )
    current = runner()
    state = None if current is None else current.state
    locked = state in UNDER_WAY
    configs, problem = controls(locked)
    if problem:
        st.error(problem)
    row = st.container(horizontal=True, gap="small")
    row.button(
        "Fine-tune",
        key="ft_go",
        type="primary",
        icon=":material/play_arrow:",
        on_click=start,
        disabled=bool(problem) or locked,
    )
    row.button("Pause", key="ft_pause", icon=":material/pause:", on_click=pause, disabled=state != "running")
    row.button(
        "Resume", key="ft_resume", icon=":material/resume:", on_click=resume, disabled=state != "paused"
    )
    row.button("Stop", key="ft_stop", icon=":material/stop:", on_click=stop, disabled=not locked)
    if (message := st.session_state.pop(MESSAGE, None)) is not None:
        st.warning(message, icon=":material/hourglass_top:")
    if current is not None and current.note:
        st.info(current.note, icon=":material/timer_off:")
    if configs and not locked and _value("start") != LAB_START:
        try:
            model_config = start_config(configs[0])
            need = max((memory_needed(c, model_config) for c in configs), key=lambda m: m.total)
            st.caption(f"Memory the largest mode needs: {need.describe()}, of {gib(memory_budget())} here.")
        except InputError as exc:
            st.error(str(exc))
    st.fragment(run_every={"idle": 1.0, "running": 1.0, "paused": 2.0}.get(state or ""))(live)()
