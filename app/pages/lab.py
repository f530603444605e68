"""Lab: train a small Mixtral-style MoE live on the sample corpus; watch its experts balance, or collapse."""

import functools
from dataclasses import asdict, fields

import streamlit as st
from components import exports, finetune, presentation
from components import lab as runs
from components.widgets import keep

from moeviz.charts.lab import (
    lab_load_chart,
    lab_load_snapshot_chart,
    lab_loss_chart,
    lab_metric_chart,
    lab_runs_chart,
)
from moeviz.errors import InputError
from moeviz.lab import PRESETS, LabConfig, max_runs
from moeviz.lab.budget import gib, memory_budget, memory_estimate
from moeviz.lab.curves import CURVE_METRICS, MAX_SMOOTHING, runs_curves, with_smoothed
from moeviz.lab.data import lab_corpus
from moeviz.samples import DOMAINS

DEFAULTS = LabConfig()
# px: every label on one line; the inputs wrap, one a row unless the column is wider (wide mode)
CONTROL_WIDTH = 128
# field -> (label, lowest, highest, step, format, help); the bounds are `LabConfig`'s own
CONTROLS = {
    "experts": ("Experts", 1, 64, 1, None, "Routed experts per MoE layer; 1 = a dense model (one FFN)."),
    "k": (
        "k per token",
        1,
        64,
        1,
        None,
        "Top-k: experts each token is sent to (at most the experts).",
    ),
    "aux_coef": (
        "Aux loss coef.",
        -1.0,
        1.0,
        0.005,
        "%.3f",
        "Weight of the aux loss in Megatron form (aux_loss_megatron, E·Σ f·P with f divided by k: 1 when "
        "even). 0 = no balancing (hub experts); "
        "negative rewards concentration (collapse).",
    ),
    "z_coef": (
        "z-loss coef.",
        0.0,
        1.0,
        0.001,
        "%.3f",
        "ST-MoE z-loss weight: keeps router logits small.",
    ),
    "bias_rate": (
        "Bias rate γ",
        0.0,
        1.0,
        0.001,
        "%.3f",
        "DeepSeek-V3 loss-free balancing: a per-expert bias, for selection only, moves by γ after each step "
        "towards even load. 0 = off.",
    ),
    "router_noise": (
        "Router noise",
        0.0,
        10.0,
        0.1,
        "%.2f",
        "Std of Gaussian noise on the router logits while training.",
    ),
    "lr": ("Learning rate", 1e-6, 0.1, 5e-4, "%.4f", "AdamW learning rate."),
    "steps": ("Steps", 1, 5000, 50, None, "Training steps (300 take well under a minute on 2 CPU cores)."),
    "seed": ("Seed", 0, 2**32 - 1, 1, None, "Same seed, same curves."),
}
SIZE_CONTROLS = {
    "d_model": ("Model width", 16, 512, 16, None, "d_model: a multiple of 8."),
    "layers": ("Layers", 1, 8, 1, None, "Decoder layers, each with an MoE block."),
    "expert_ffn": ("Expert FFN width", 0, 4096, 16, None, "Width of each expert's FFN; 0 = the model width."),
    "batch": ("Batch", 1, 64, 1, None, "Sequences per step."),
    "seq": ("Sequence length", 8, 512, 8, None, "Tokens per sequence."),
    "eval_every": ("Evaluate every", 1, 5000, 5, None, "Steps between held-out evaluations."),
}
CAPACITY_ON, CAPACITY = "lab_capacity_on", "lab_capacity_factor"
DEFAULT_CAPACITY = 1.25
LOCKED = ("running", "paused", "idle")  # the controls are locked while a run is under way
SMALL_METRICS = ("load_entropy", "dead_experts_window_sum", "z_loss")  # the row of small curves
VIEWS = ("This run", "All runs")
VIEW, SMOOTHING, HIDDEN_RUNS = "lab_view", "lab_smoothing", "lab_hidden_runs"
SLIDER_WIDTH = 180  # px of the smoothing slider: with the view's buttons and the layer, one row at 1280 px
SCRUBBER_WIDTH = 360  # px of the snapshot's step scrubber in the projector layout
# px of the curves outside the projector layout: two (three) fit beside each other at 1280 px with the
# sidebar open, and wrap one under another at 900 px instead of cutting their titles
MAIN_CHART_WIDTH, SMALL_CHART_WIDTH = 280, 185
SCRUB = "lab_scrub"  # (run name, step) of the load snapshot; absent or another run's: the run's end


def _store_key(field: str) -> str:
    return f"lab_{field}"


def _config_values(config: LabConfig) -> dict:
    """Control store values of a config (capacity as a toggle and a factor, expert_ffn None as 0)."""
    values = {_store_key(name): value for name, value in asdict(config).items() if name != "capacity_factor"}
    values[_store_key("expert_ffn")] = config.expert_ffn or 0
    values[CAPACITY_ON] = config.capacity_factor is not None
    values[CAPACITY] = config.capacity_factor or DEFAULT_CAPACITY
    return values


def fill(config: LabConfig) -> None:
    """Preset callback: set every control to `config`'s value (the store and the widget: a value typed in
    the same rerun must not win over the preset, whichever callback runs last)."""
    for key, value in _config_values(config).items():
        st.session_state[key] = st.session_state[f"{key}_widget"] = value


def _kept(store_key: str, widget, *args, **kwargs):
    """A widget whose value survives page switches: kept under `store_key`, shown by `<store_key>_widget`."""
    widget_key = f"{store_key}_widget"
    st.session_state[widget_key] = st.session_state[store_key]
    return widget(*args, key=widget_key, on_change=keep, args=(widget_key, store_key), **kwargs)


def _number(field: str, spec: tuple, disabled: bool, width: int | str = "stretch") -> None:
    label, low, high, step, fmt, help_text = spec
    key = _store_key(field)
    value = st.session_state[key]
    st.session_state[key] = type(low)(min(max(value, low), high))  # a preset outside the range is clamped
    _kept(
        key,
        st.number_input,
        label,
        low,
        high,
        step=step,
        format=fmt,
        help=help_text,
        disabled=disabled,
        width=width,
    )


def controls(locked: bool) -> tuple[LabConfig | None, str | None]:
    """Presets and one control per `LabConfig` field. → (the config, None) or (None, what is wrong)."""
    for key, value in _config_values(DEFAULTS).items():
        st.session_state.setdefault(key, value)
    st.markdown("**Presets**")
    row = st.container(horizontal=True, gap="small")
    for name, preset in PRESETS.items():
        row.button(
            name,
            key=f"lab_preset_{name.replace(' ', '_')}",
            on_click=fill,
            args=(preset,),
            disabled=locked,
            help=preset.label(),
        )
    # wrapping rows of fixed-width inputs: two fixed columns cut the labels mid-word ("Expert|s" at 900 px)
    row = st.container(horizontal=True, gap="small")
    for name, spec in CONTROLS.items():
        with row:
            _number(name, spec, locked, CONTROL_WIDTH)
    _kept(
        CAPACITY_ON,
        st.toggle,
        "Capacity limit",
        help="Megatron-style capacity per sequence: ceil(factor · S·k / E) slots per expert; the "
        "lowest-probability slots beyond it are dropped.",
        disabled=locked,
    )
    _number(
        "capacity_factor",
        ("Capacity factor", 0.05, 64.0, 0.25, "%.2f", "Slots per expert over the even share."),
        locked or not _value(CAPACITY_ON),
        CONTROL_WIDTH,
    )
    with st.expander("Model size and batches"):  # one a row: the expander's padding leaves no room for two
        for name, spec in SIZE_CONTROLS.items():
            _number(name, spec, locked)
    st.caption(
        f"Data: the bundled sample corpus ({len(DOMAINS)} domains), each split into training text (90%) and "
        "held-out text (10%), tokenised with the samples' tokenizer."
    )
    return read_config()


def _value(store_key: str):
    """A control's value now: its widget's (set before any callback runs), else its store's."""
    return st.session_state.get(f"{store_key}_widget", st.session_state[store_key])


def read_config() -> tuple[LabConfig | None, str | None]:
    """The controls' config → (it, None), or (None, what is wrong)."""
    values = {f.name: _value(_store_key(f.name)) for f in fields(LabConfig) if f.name != "capacity_factor"}
    values["expert_ffn"] = values["expert_ffn"] or None
    values["capacity_factor"] = float(_value(CAPACITY)) if _value(CAPACITY_ON) else None
    try:
        return LabConfig(**values), None
    except InputError as exc:
        return None, str(exc)


def start() -> None:
    """Start callback: the config of the controls as they are at the click (a value typed just before it
    counts), on the session's runner."""
    config, _ = read_config()
    if config is not None:
        runs.start(config)


def buttons(config: LabConfig | None, state: str | None) -> None:
    """Start / Pause / Resume / Reset in one row that wraps (four equal columns cut their labels to one
    letter on a 900 px screen with the sidebar open)."""
    row = st.container(horizontal=True, gap="small")
    row.button(
        "Start",
        key="lab_start",
        type="primary",
        icon=":material/play_arrow:",
        on_click=start,
        disabled=config is None or state in ("running", "idle", "paused"),
        width="content",
    )
    row.button(
        "Pause",
        key="lab_pause",
        icon=":material/pause:",
        on_click=runs.pause,
        disabled=state != "running",
        width="content",
    )
    row.button(
        "Resume",
        key="lab_resume",
        icon=":material/resume:",
        on_click=runs.resume,
        disabled=state != "paused",
        width="content",
    )
    row.button(
        "Reset",
        key="lab_reset",
        icon=":material/restart_alt:",
        on_click=runs.reset,
        disabled=state is None,
        width="content",
        help="Stop and discard the run (the controls keep their values).",
    )


def _polling_every(state: str | None) -> float | None:
    """How often the curves refresh: every second while training, slower while paused, not at all after."""
    return {"idle": 1.0, "running": 1.0, "paused": 2.0}.get(state or "")


def _chart(chart, key: str, size: str) -> None:
    """A live chart, its labels kept and themed as `exports.show_chart` draws them, without its "Save chart"
    popover (five of them would push the curves off a 720 px screen; the chart's own menu saves a PNG); its
    height is `size`'s in the layout now on (`presentation.HEIGHTS`)."""
    chart = chart.properties(height=presentation.height(size))
    exports.keep_labels(chart)
    exports.for_the_page(chart)
    presentation.larger_fonts(chart)
    with st.container(key=key):
        st.altair_chart(chart, width="stretch", key=f"{key}_chart")


def _smoothing(width: int | str = "stretch") -> float:
    """TensorBoard's smoothing slider (an EMA weight, 0 = raw curves) → its value."""
    st.session_state.setdefault(SMOOTHING, 0.0)
    _kept(
        SMOOTHING,
        st.slider,
        "Smoothing",
        0.0,
        MAX_SMOOTHING,
        step=0.01,
        help="As TensorBoard smooths: an exponential moving average of each curve (debiased at its start), "
        "drawn over the faint raw curve; 0 = raw. The CSV of the curves has both.",
        width=width,
    )
    return float(st.session_state[SMOOTHING])


def _view_controls(layers: int) -> tuple[str, float, int]:
    """The view (this run / all runs), the smoothing and, in this run's view of a model of several layers,
    the layer of the load charts, in one row that wraps (three columns cut the view's buttons at 900 px)
    → (view, smoothing, layer)."""
    st.session_state.setdefault(VIEW, VIEWS[0])
    row = st.container(horizontal=True, gap="medium", vertical_alignment="bottom")
    with row:
        _kept(VIEW, st.segmented_control, "View", VIEWS, required=True, label_visibility="collapsed")
        smoothing = _smoothing(width=SLIDER_WIDTH)
        layer = 0
        if layers > 1 and st.session_state[VIEW] == VIEWS[0]:
            layer = st.selectbox(
                "Layer",
                list(range(layers)),
                format_func=lambda n: f"layer {n}",
                key="lab_layer",
                label_visibility="collapsed",
                width=CONTROL_WIDTH,
            )
    return st.session_state[VIEW], smoothing, layer


def _scrub(name: str) -> None:
    """Scrubber callback: keep the step chosen in run `name` (the widget's state is lost on a page switch)."""
    st.session_state[SCRUB] = (name, int(st.session_state[f"{SCRUB}_widget"]))


def _scrubber(name: str, steps: int, done: int) -> int:
    """The step scrubber of the load snapshot → the step to show. Its range is the run's planned steps, so
    it keeps its place while the run trains (a range growing with each step would make a new widget every
    second); it starts at the end, where the snapshot follows the training's latest step."""
    kept = st.session_state.get(SCRUB)
    chosen = kept[1] if kept and kept[0] == name else steps
    if steps > 1:
        st.session_state[f"{SCRUB}_widget"] = chosen
        st.slider(
            "Load snapshot at step",
            1,
            steps,
            step=1,
            key=f"{SCRUB}_widget",
            on_change=_scrub,
            args=(name,),
            help="Scrub through the training: the bars show each expert's share of the slots at that step "
            "(the grey rule on the load chart). At a step not reached yet, the latest.",
        )
    return min(chosen, done)


def this_run(
    history, load, config: LabConfig, collapse_step: int | None, *, smoothing: float, layer: int, name: str
) -> None:
    """The current run's curves: loss and per-expert load, the small indicators, and the load snapshot at
    the scrubbed step."""
    shown = with_smoothed(history, ["train_loss", *SMALL_METRICS], smoothing)
    done = int(history["step"].max()) if len(history) else 0
    main, small, snapshot_row = st.container(), st.container(), st.container()
    if (
        presentation.projector()
    ):  # one screen: the small curves and the snapshot two by two, its scrubber below
        left, right = small.columns(2, gap="medium")
        # containers made in reading order: the snapshot is drawn first, yet sits last
        *small_columns, snapshot = (left.container(), right.container(), left.container(), right.container())
        scrubber = snapshot_row.container(width=SCRUBBER_WIDTH)
    else:  # fixed widths in a row that wraps: side by side on a wide screen, stacked at 900 px (uncut titles)
        row = small.container(horizontal=True, gap="medium")
        small_columns = [row.container(width=SMALL_CHART_WIDTH) for _ in SMALL_METRICS]
        row = snapshot_row.container(horizontal=True, gap="medium", vertical_alignment="center")
        scrubber, snapshot = row.container(width=SMALL_CHART_WIDTH), row.container(width=MAIN_CHART_WIDTH)
    with scrubber:  # drawn below the curves, read first: the load chart marks the snapshot's step
        step = _scrubber(name, config.steps, done)
    if step:
        with snapshot:
            _chart(
                lab_load_snapshot_chart(load, layer, step, config.experts),
                "lab_load_snapshot",
                "lab_snapshot",
            )
    if presentation.projector():
        left, right = main.columns(2, gap="medium")
    else:
        row = main.container(horizontal=True, gap="medium")
        left, right = row.container(width=MAIN_CHART_WIDTH), row.container(width=MAIN_CHART_WIDTH)
    with left:
        _chart(lab_loss_chart(shown, steps=config.steps, collapse_step=collapse_step), "lab_loss", "lab_main")
    with right:
        chart = lab_load_chart(
            load,
            layer,
            config.experts,
            steps=config.steps,
            collapse_step=collapse_step,
            marked_step=step if 0 < step < done else None,
        )
        _chart(chart, "lab_load", "lab_main")
    even = 1.0 if config.experts > 1 else None  # the normalised load entropy of an even load
    for column, metric in zip(small_columns, SMALL_METRICS, strict=True):
        with column:
            chart = lab_metric_chart(
                shown,
                metric,
                steps=config.steps,
                collapse_step=collapse_step,
                reference=even if metric == "load_entropy" else None,
            )
            _chart(chart, f"lab_{metric}", "lab_small")
    # on a projector the curves come first: their explanation one click away
    (st.expander("What the curves show") if presentation.projector() else st.container()).caption(
        "**Load entropy**: of each layer's load over its experts, normalised by log E, mean over the layers "
        "(1 = even, 0 = one expert takes every token). **Dead experts**: experts that got no token in "
        "the last steps, summed over the layers. **Router z-loss**: mean over tokens of "
        "(log Σ exp router logits)², mean over the layers: how large the router's logits grow. Red dashes: "
        "the step where moeviz's collapse verdict (the Load & collapse page's) first tripped."
    )


def _shown_runs(names: list[str]) -> list[str]:
    """The runs picked for the charts (every run but those the user took out: a new run is shown at once)."""
    hidden = set(st.session_state.get(HIDDEN_RUNS, ()))
    st.session_state["lab_shown_runs"] = [name for name in names if name not in hidden]

    def keep_hidden() -> None:
        st.session_state[HIDDEN_RUNS] = [n for n in names if n not in st.session_state["lab_shown_runs"]]

    return st.multiselect(
        "Runs on the charts",
        names,
        key="lab_shown_runs",
        on_change=keep_hidden,
        help="This session's runs (the last ones, at most a few): each new run is added.",
    )


def all_runs(history, smoothing: float) -> None:
    """The session's runs side by side, as TensorBoard and W&B show them: a table of their settings, each
    curve of every picked run on one chart (shared axes, a colour per run), and the curves as CSV."""
    runs_kept = runs.session_runs(history)
    if not runs_kept:
        return
    shown = _shown_runs([kept.name for kept in runs_kept])
    picked = [kept for kept in runs_kept if kept.name in shown]
    st.dataframe(runs.runs_table(runs_kept), hide_index=True, key="lab_runs_table")
    if not picked:
        st.info("Pick runs to draw their curves.")
        return
    curves = runs_curves({kept.name: kept.history for kept in picked}, CURVE_METRICS, smoothing)
    steps = max(kept.config.steps for kept in picked)
    order = [kept.name for kept in picked]
    rows = (("train_loss", "heldout_loss"), ("load_entropy", "dead_experts_window_sum", "z_loss"))
    for metrics in rows:
        for column, metric in zip(st.columns(len(metrics), gap="medium"), metrics, strict=True):
            with column:
                chart = lab_runs_chart(
                    curves,
                    metric,
                    runs=order,
                    steps=steps,
                    smoothed=bool(smoothing),
                    reference=1.0 if metric == "load_entropy" else None,
                )
                _chart(chart, f"lab_runs_{metric}", "lab_runs")
    row = st.container(horizontal=True, gap="small")
    row.download_button(
        "Curves (.csv)",
        exports.csv_bytes(curves),
        "moeviz-lab-curves.csv",
        "text/csv",
        icon=":material/download:",
        on_click="ignore",
        key="lab_runs_csv",
        help="One row per run, curve and step: run, metric, step, value, smoothed (the smoothing set here).",
    )
    row.button(
        "Forget earlier runs",
        key="lab_forget_runs",
        icon=":material/delete_sweep:",
        on_click=runs.forget_kept_runs,
        disabled=not st.session_state.get(runs.KEPT_RUNS),
        help="Drop the kept runs from this view (the current run stays).",
    )


def live() -> None:
    """The run's progress and curves (a fragment: only this part reruns while the model trains)."""
    runner = runs.runner()
    if runner is None:
        st.info("Pick a preset or set the controls, then press **Start**.", icon=":material/science:")
        if runs.session_runs():  # earlier runs of this session, after a Reset
            all_runs(None, _smoothing())
        return
    state = runner.state
    history, load = runner.snapshot()
    config = runner.config
    name = runs.name_of(runner)
    collapse_step = None if runner.run is None else runner.run.collapse_step
    done = int(history["step"].max()) if len(history) else 0
    words = {
        "idle": "starting…",
        "running": "training…",
        "paused": "paused",
        "done": "done",
        "stopped": "stopped",
    }
    st.progress(
        min(done / config.steps, 1.0), text=f"Step {done} of {config.steps} · {words.get(state, state)}"
    )
    if state == "error":
        st.error(f"The training stopped with an error: {runner.error}")
    if len(history):
        last = history.iloc[-1]
        heldout = history["heldout_loss"].dropna()
        verdict = (
            f":red[**collapsed** — the verdict first tripped at step {collapse_step}]"
            if collapse_step is not None
            else ":green[**not collapsed**]" + (" so far" if state in runs.ACTIVE else "")
        )
        st.markdown(
            f"**{name}** · {config.label()} · train loss **{last['train_loss']:.3f}**"
            + (f" · held-out **{heldout.iloc[-1]:.3f}**" if len(heldout) else "")
            + f" · {verdict}"
        )
    view, smoothing, layer = _view_controls(config.layers)
    if view == VIEWS[0]:
        this_run(history, load, config, collapse_step, smoothing=smoothing, layer=layer, name=name)
    else:
        all_runs(history, smoothing)
    if state != st.session_state.get("lab_drawn_state"):
        st.session_state["lab_drawn_state"] = state
        if state not in ("running", "idle", "paused"):
            st.rerun()  # the run ended: redraw the whole page (controls unlocked, the model's actions)


def finished(state: str | None) -> None:
    """Once the run is done: open the model on the other pages, or download it."""
    runner = runs.runner()
    if runner is None or state != "done":
        return
    config = runner.config
    opened = runs.opened_name()
    row = st.container(horizontal=True, gap="small")  # wraps at 900 px rather than cutting the labels
    row.button(
        "Open it on the other pages",
        key="lab_open",
        icon=":material/open_in_new:",
        on_click=runs.open_in_picker,
        disabled=config.dense,
        help="A dense model (1 expert) has no routing to show." if config.dense else None,
        width="content",
    )
    row.download_button(
        "Download (.zip)",
        functools.partial(runs.zip_bytes, runner),
        "moeviz-lab-model.zip",
        "application/zip",
        icon=":material/download:",
        on_click="ignore",
        width="stretch",
        help="The trained model as a Hugging Face folder, zipped: `moeviz.load_model` opens it unzipped.",
    )
    if opened is not None:
        st.success(
            f"In the model picker of every page as **lab: {opened}** ({config.label()}; this session only)."
        )
        links = st.columns(3)
        links[0].page_link("pages/routing.py", label="Routing", icon=":material/alt_route:")
        links[1].page_link("pages/load.py", label="Load & collapse", icon=":material/balance:")
        links[2].page_link("pages/attention.py", label="Attention", icon=":material/visibility:")


st.title("Lab: train a small MoE")
st.caption(
    "A small Mixtral-style model trains on this server while you watch: its loss, how its router spreads "
    "tokens over the experts, and whether the experts collapse. Try the presets: *healthy* (a balancing "
    "loss), *hub experts* (none), *collapse* (a negative one)."
)
state = runs.state()
message = runs.pop_message()
settings, view = st.columns([1.3, 2.7], gap="medium")
with settings:
    config, problem = controls(locked=state in LOCKED)
    if problem:
        st.error(problem)
with view:
    if max_runs() == 0:
        st.info("The Lab is disabled on this server (`MOEVIZ_LAB_MAX_RUNS=0`).", icon=":material/block:")
        st.stop()
    buttons(config, state)
    if message is not None:
        st.warning(f"{message[1]}", icon=":material/hourglass_top:")
    if config is not None and state not in LOCKED:
        need = memory_estimate(config, lab_corpus().vocab_size)
        st.caption(f"Memory this run needs: {need.describe()}, of {gib(memory_budget())} for lab runs here.")
    if (ended := runs.runner()) is not None and ended.note:
        st.info(ended.note, icon=":material/timer_off:")
    finished(state)
    st.fragment(run_every=_polling_every(state))(live)()
st.divider()
finetune.section()
