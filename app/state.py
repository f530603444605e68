"""What the app pages share: which models may be opened, the model picker, and cached loading and capture.

One loaded model per source is kept for the whole server process and shared by every session
(`st.cache_resource`); captures are cached per (model, text) and are thread-safe in the library, so
concurrent sessions never see each other's routing. No model math here: everything goes through `moeviz`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import altair as alt
import pandas as pd
import streamlit as st

import moeviz
import moeviz.analysis
import moeviz.charts
from moeviz.attention import AttentionCapture
from moeviz.errors import ModelSourceError
from moeviz.models.loading import DEFAULT_SAMPLE
from moeviz.samples import DOMAINS, eval_batch

SAMPLE_PREFIX = "sample:"
LOCAL_FOLDER = "Local folder…"
EXAMPLE_PROMPT = (
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list)."
)


class FolderNotAllowedError(ModelSourceError):
    """The folder lies outside the roots this server was told to serve (`MOEVIZ_MODEL_DIRS`)."""


def allowed_roots(variable: str) -> list[Path] | None:
    """Folders listed in environment variable `variable` (os.pathsep-separated); None = any folder."""
    raw = os.environ.get(variable, "")
    roots = [Path(part).expanduser().resolve() for part in raw.split(os.pathsep) if part.strip()]
    return roots or None


def folder_inside(text: str, variable: str, what: str) -> Path:
    """`text` resolved (symlinks followed); FolderNotAllowedError unless inside `allowed_roots(variable)`."""
    folder = Path(text).expanduser().resolve()
    roots = allowed_roots(variable)
    if roots is not None and not any(folder.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(root) for root in roots)
        raise FolderNotAllowedError(f"{folder} is outside the {what} folders this server may open: {allowed}")
    return folder


def roots_hint(variable: str) -> str:
    """A widget help text: where folders may be opened from (`allowed_roots(variable)`)."""
    roots = allowed_roots(variable)
    return "Any local folder." if roots is None else "Inside: " + ", ".join(map(str, roots))


@contextlib.contextmanager
def stop_on_error() -> Iterator[None]:
    """Show a library error raised inside as a message (never a traceback) and stop the page."""
    try:
        yield
    except moeviz.MoevizError as exc:
        st.error(str(exc))
        st.stop()


def default_model() -> str:
    """`MOEVIZ_DEFAULT_MODEL` if set, else the healthy Mixtral sample."""
    return os.environ.get("MOEVIZ_DEFAULT_MODEL", "").strip() or DEFAULT_SAMPLE


def check_source(source: str) -> str:
    """Normalise a model source; a folder must resolve (symlinks followed) inside `MOEVIZ_MODEL_DIRS`."""
    text = source.strip()
    if text.startswith(SAMPLE_PREFIX):
        return text
    if not text:
        raise ModelSourceError("enter the path of a local Hugging Face model folder")
    return str(folder_inside(text, "MOEVIZ_MODEL_DIRS", "model"))


def sample_sources() -> list[str]:
    """The model sources of the bundled samples (`sample:<name>`)."""
    return [f"{SAMPLE_PREFIX}{name}" for name in moeviz.list_samples()]


def model_picker() -> str:
    """Sidebar: pick a sample or type a local folder. Returns the checked source; stops the page on error."""
    samples = sample_sources()
    choices = [*samples, LOCAL_FOLDER]
    default = default_model()
    if "model" not in st.session_state:  # the choice kept across page switches
        if default.startswith(SAMPLE_PREFIX):
            st.session_state["model"] = default if default in samples else choices[0]
        else:
            st.session_state["model"] = LOCAL_FOLDER
            st.session_state["model_folder_kept"] = default
    with st.sidebar:
        choice = kept("model", choices, st.selectbox, "Model", choices, widget_key="model_choice")
        source = choice
        if choice == LOCAL_FOLDER:
            st.session_state["model_folder"] = st.session_state.get("model_folder_kept", "")
            source = st.text_input(
                "Model folder",
                key="model_folder",
                help=f"A Hugging Face folder. {roots_hint('MOEVIZ_MODEL_DIRS')}",
                on_change=keep,
                args=("model_folder", "model_folder_kept"),
            )
    with stop_on_error():
        return check_source(source or "")


@st.cache_resource(show_spinner="Loading the model…", max_entries=4)
def get_model(source: str) -> moeviz.LoadedModel:
    """The model for `source`, loaded once per server process and shared by all sessions."""
    return moeviz.load_model(check_source(source))


class CaptureCache:
    """The latest captures per (model, text), shared by every session; each is computed once, also when
    several sessions ask for it at the same time.

    A capture is a resource, not data: its attention part holds a lock and lazily computed summaries, so it
    cannot be pickled; it is read-only and thread-safe, so sessions may share it. Few entries: it keeps
    every layer's queries and keys (linear in tokens, but not small). Not `st.cache_resource` on the
    capture itself: a cached function replays the elements it drew on later hits, and a capture draws its
    progress bar while it runs."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._done: OrderedDict[tuple[str, str], moeviz.Trace] = OrderedDict()
        self._running: dict[tuple[str, str], threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, source: str, text: str, progress: Callable[[int, int], None] | None = None) -> moeviz.Trace:
        key = (source, text)
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                return self._done[key]
            running = self._running.setdefault(key, threading.Lock())
        with running:  # a second session asking for the same capture waits for the first one
            with self._lock:
                if key in self._done:
                    return self._done[key]
            try:
                loaded = get_model(source)
                trace = moeviz.capture(
                    loaded, text, attention=not loaded.is_encoder_decoder, progress=progress
                )
            finally:
                with self._lock:
                    self._running.pop(key, None)
            with self._lock:
                self._done[key] = trace
                while len(self._done) > self._size:
                    self._done.popitem(last=False)
        return trace


@st.cache_resource
def _captures() -> CaptureCache:
    return CaptureCache(size=8)


def _captured(source: str, text: str, progress: Callable[[int, int], None] | None = None) -> moeviz.Trace:
    """One forward of `text` with routing and (decoder-only models) attention, per (model, text)."""
    return _captures().get(source, text, progress)


@st.cache_data(show_spinner=False, max_entries=64)
def get_trace(source: str, text: str) -> moeviz.Trace:
    """Routing of `text` through the model at `source` (cached per model and text; each session gets
    its own copy). Attention is left out here: see `get_attention`."""
    return dataclasses.replace(_captured(source, text), attention=None)


@dataclasses.dataclass(frozen=True)
class RoutingFrames:
    """The frames the Routing page slices on every interaction, built once per (model, text).

    routing: `Trace.routing_frame()`; scores: every layer's `scores_frame` stacked (with site, layer);
    confidence: `confidence_frame`; load: `expert_load_frame`; summary: `layer_summary_frame` indexed by
    (site, layer)."""

    routing: pd.DataFrame
    scores: pd.DataFrame
    confidence: pd.DataFrame
    load: pd.DataFrame
    summary: pd.DataFrame
    by_layer: dict[str, dict[tuple[str, int], pd.DataFrame]]  # "scores"/"routing" split per (site, layer)

    def layer_scores(self, site: str, layer: int) -> pd.DataFrame:
        """The scores rows of one MoE layer (a 32k-token input has a million score rows: split once)."""
        return self.by_layer["scores"][(site, layer)]

    def layer_routing(self, site: str, layer: int) -> pd.DataFrame:
        """The routing rows of one MoE layer."""
        return self.by_layer["routing"][(site, layer)]


@st.cache_resource(show_spinner=False, max_entries=8)
def routing_frames(source: str, text: str) -> RoutingFrames:
    """`RoutingFrames` of `text`, built once and shared (read-only: pages only select from them; a
    per-session copy would cost an unpickling of a million rows on every click of a 32k-token input)."""
    trace = get_trace(source, text)
    routing = trace.routing_frame()
    scores = moeviz.charts.stack_scores({key: trace.scores_frame(key[1], key[0]) for key in trace.layer_keys})
    return RoutingFrames(
        routing=routing,
        scores=scores,
        confidence=moeviz.analysis.confidence_frame(trace),
        load=moeviz.analysis.expert_load_frame(trace),
        summary=moeviz.analysis.layer_summary_frame(trace).set_index(["site", "layer"]),
        by_layer={
            name: dict(list(frame.groupby(["site", "layer"], sort=False)))
            for name, frame in (("scores", scores), ("routing", routing))
        },
    )


def get_attention(source: str, text: str) -> AttentionCapture | None:
    """The attention capture of `text` (None for models without one), shared by all sessions."""
    with stop_on_error():
        return _captured(source, text).attention


def load_or_stop(source: str, text: str) -> moeviz.Trace:
    """Load and capture, showing a library error as a message (never a traceback) and stopping the page."""
    with stop_on_error():
        get_model(source)
        bar = st.empty()

        def progress(done: int, total: int) -> None:
            text = f"Routing the prompt through the model: MoE layer {done} of {total}…"
            bar.progress(done / total, text=text)

        _captured(source, text, progress)
        bar.empty()
        return get_trace(source, text)


def layer_options(keys: list[tuple[str, int]]) -> dict[str, tuple[str, int]]:
    """Slider labels of the MoE layers → (site, layer); the site is named only when a model has several."""
    several = len({site for site, _ in keys}) > 1
    return {(f"{layer} ({site})" if several else str(layer)): (site, layer) for site, layer in keys}


def remember(widget_key: str, store_key: str, options: list) -> None:
    """Give widget `widget_key` the value kept under `store_key` (or the first option when that value is
    not offered). Call before the widget, which must pass `on_change=keep, args=(widget_key, store_key)`
    (`kept` does both): widget state does not survive a page switch, the store does."""
    value = st.session_state.get(store_key)
    st.session_state[store_key] = value if value in options else options[0]
    st.session_state[widget_key] = st.session_state[store_key]


def keep(widget_key: str, store_key: str) -> None:
    """Widget callback: copy the widget's new value to its store (see `remember`)."""
    st.session_state[store_key] = st.session_state[widget_key]


def kept(
    store_key: str, options, widget: Callable, *widget_args, widget_key: str | None = None, **widget_kwargs
):
    """Draw `widget(*widget_args, **widget_kwargs)` keyed `widget_key` (default `<store_key>_widget`) with
    the value kept under `store_key` (see `remember`): a choice that survives page switches. → that value."""
    widget_key = widget_key or f"{store_key}_widget"
    remember(widget_key, store_key, options)
    widget(*widget_args, key=widget_key, on_change=keep, args=(widget_key, store_key), **widget_kwargs)
    return st.session_state[store_key]


def _new_click(clicked, seen_key: str) -> bool:
    """Whether `clicked` (a chart selection, or None) differs from the one seen on the last run: a chart
    keeps reporting its selection on every rerun, but only a new click should move a picker."""
    new = clicked is not None and clicked != st.session_state.get(seen_key)
    st.session_state[seen_key] = clicked
    return new


def _csv(frame: pd.DataFrame) -> bytes:
    return frame.to_csv(index=False).encode()


def routing_csv(routing: pd.DataFrame) -> Callable[[], bytes]:
    """Deferred CSV of the routing table (`RoutingFrames.routing`), built only when clicked."""
    return functools.partial(_csv, routing)


def routing_parquet(trace: moeviz.Trace) -> Callable[[], bytes]:
    """Deferred Parquet of the routing table, as a moeviz trace file (adds each row's router logits and
    metadata; `moeviz.Trace.from_parquet` reads it back, pandas reads it as a table)."""

    def build() -> bytes:
        with tempfile.TemporaryDirectory() as tmp:
            return trace.to_parquet(Path(tmp) / "routing.parquet").read_bytes()

    return build


# ---- shared prompt, selections, downloads ----------------------------------------------------------------
PROMPT_FILE_LIMIT = 1 << 20  # bytes of an uploaded prompt file (the server refuses larger uploads too)
PROMPT_FILE_TYPES = ["txt", "md", "py", "json", "jsonl", "csv"]


def prompt_from_file(name: str, data: bytes) -> str:
    """The text of an uploaded prompt file; ValueError (saying what to do) if too large, not UTF-8, empty."""
    if len(data) > PROMPT_FILE_LIMIT:
        raise ValueError(
            f"{name} has {len(data):,} bytes; prompt files may have at most {PROMPT_FILE_LIMIT:,}"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name} is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    if not text.strip():
        raise ValueError(f"{name} is empty")
    return text


def _upload_key() -> str:
    return f"prompt_file_{st.session_state.setdefault('prompt_file_round', 0)}"


def _keep_prompt() -> None:
    """Submit: the uploaded file's text if a file was given (the uploader is then cleared), else the box."""
    st.session_state.pop("prompt_error", None)
    upload = st.session_state.get(_upload_key())
    if upload is None:
        st.session_state["prompt"] = st.session_state["routing_prompt"]
        return
    try:
        st.session_state["prompt"] = prompt_from_file(upload.name, upload.getvalue())
    except ValueError as exc:
        st.session_state["prompt_error"] = str(exc)
    st.session_state["prompt_file_round"] += 1  # a new key empties the uploader


def prompt_form() -> str:
    """The prompt form, the same on every page: the submitted text is kept in `st.session_state["prompt"]`
    (set by the submit callback, so it survives page switches) and shown again on every page. Long texts
    can come from a file: pasting a 100 kB text into the box stalls the browser for seconds."""
    st.session_state.setdefault("prompt", EXAMPLE_PROMPT)
    st.session_state["routing_prompt"] = st.session_state["prompt"]
    with st.form("prompt_form"):
        st.text_area("Prompt", key="routing_prompt", height=100)
        with st.expander("Or a text file (long inputs)"):
            st.file_uploader(
                f"UTF-8 text, up to {PROMPT_FILE_LIMIT >> 20} MiB; it replaces the prompt on Analyse",
                type=PROMPT_FILE_TYPES,
                key=_upload_key(),
            )
        st.form_submit_button(
            "Analyse", type="primary", help="Or press Ctrl+Enter in the prompt", on_click=_keep_prompt
        )
    if "prompt_error" in st.session_state:
        st.error(st.session_state["prompt_error"])
    return st.session_state["prompt"]


def pick_layer(trace: moeviz.Trace, label: str = "MoE layer") -> tuple[str, int]:
    """Layer slider whose choice survives page switches (`st.session_state["layer"]`); → (site, layer)."""
    layers = layer_options(trace.layer_keys)
    return layers[kept("layer", list(layers), st.select_slider, label, list(layers))]


def pick_expert(num_experts: int, label: str = "Expert") -> int:
    """Expert picker whose choice survives page switches (`st.session_state["expert"]`)."""
    options = list(range(num_experts))
    return int(kept("expert", options, st.selectbox, label, options))


def pick_token(options: dict[str, tuple[int, int]], clicked: tuple[int, int] | None) -> tuple[int, int]:
    """Token picker (label → (seq, pos)); a newly clicked heatmap cell selects its token. The choice
    survives page switches (`st.session_state["token"]`)."""
    labels = list(options)
    by_key = {key: label for label, key in options.items()}
    if _new_click(clicked, "token_clicked") and clicked in by_key:
        st.session_state["token"] = by_key[clicked]
    return options[kept("token", labels, st.selectbox, "Token", labels, help="Or click a heatmap cell")]


def clicked_token(event) -> tuple[int, int] | None:
    """(seq, pos) of the token clicked in a selectable heatmap (`moeviz.charts.TOKEN_SELECTION`), if any."""
    points = (event or {}).get("selection", {}).get(moeviz.charts.TOKEN_SELECTION) or []
    if not points:
        return None
    point = points[0]
    return int(point.get("seq", 0)), int(point["pos"])


def _parquet(frame: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    return buffer.getvalue()


def table_downloads(frame: pd.DataFrame, name: str) -> None:
    """CSV and Parquet download buttons for one table (files built only when clicked)."""
    formats = (("csv", _csv, "text/csv"), ("parquet", _parquet, "application/vnd.apache.parquet"))
    for column, (ext, build, mime) in zip(st.columns(2), formats, strict=True):
        file = f"{name}.{ext}"
        column.download_button(
            file,
            functools.partial(build, frame),
            file,
            mime,
            icon="⬇",
            on_click="ignore",
            key=f"{ext}_{name}",
        )


def _export(chart: alt.TopLevelMixin, fmt: str) -> bytes:
    import vl_convert

    spec = chart.to_dict()
    if "facet" not in spec and "width" not in spec:
        spec["width"] = 900  # the app fits charts to the page; a file needs a width of its own
    if fmt == "svg":
        return vl_convert.vegalite_to_svg(spec).encode()
    return vl_convert.vegalite_to_png(spec, scale=2)


CANVAS_ABOVE = 400  # marks; Streamlit itself switches to a canvas only above 2,000 data rows


def many_marks(chart: alt.TopLevelMixin, marks: int) -> alt.TopLevelMixin:
    """Have Vega draw a view of more than CANVAS_ABOVE marks on a canvas instead of as SVG: much less work
    in the browser, which redraws these views on every layer switch. Small views stay SVG, their marks
    readable in the page (the browser tests read them)."""
    if marks <= CANVAS_ABOVE:
        return chart
    return chart.properties(usermeta={"embedOptions": {"renderer": "canvas"}})


def _skip_validation(chart: alt.TopLevelMixin) -> None:
    """Make Streamlit's `chart.to_dict()` skip the JSON-schema check: about a quarter of a page rerun
    (~15 ms a chart), and every chart function's spec is already validated by the chart tests."""
    # altair keeps attribute writes in the spec (`SchemaBase.__setattr__`): set the instance attribute.
    object.__setattr__(chart, "to_dict", functools.partial(type(chart).to_dict, chart, validate=False))


def show_chart(chart: alt.TopLevelMixin, key: str, *, select: bool = False):
    """Render a chart in a container keyed `key`, with SVG and PNG downloads below it (built on click).
    With `select`, the page reruns on a selection and the selection event is returned."""
    _skip_validation(chart)
    with st.container(key=key):
        event = st.altair_chart(
            chart, width="stretch", on_select="rerun" if select else "ignore", key=f"{key}_chart"
        )
    with st.popover("Save chart", icon="🖼"):
        for fmt, mime in (("svg", "image/svg+xml"), ("png", "image/png")):
            st.download_button(
                fmt.upper(),
                functools.partial(_export, chart, fmt),
                f"{key}.{fmt}",
                mime,
                on_click="ignore",
                key=f"{key}_{fmt}",
            )
    return event


# ---- corpus -------------------------------------------------------------------------------------------
@st.cache_data(show_spinner=False, max_entries=16)
def get_domain_trace(source: str, domain: str) -> moeviz.Trace:
    """Routing of one domain of the sample evaluation corpus (8 windows × 256 tokens), cached."""
    loaded = get_model(source)
    batch = eval_batch(loaded)
    ids = [ids for ids, d in zip(batch.token_ids, batch.domains, strict=True) if d == domain]
    return moeviz.capture(loaded, token_ids=ids)


def corpus_trace(source: str) -> moeviz.Trace:
    """The evaluation corpus (all domains) routed through the model, with a progress bar per domain."""
    bar = st.progress(0.0, text="Routing the evaluation corpus…")
    parts = []
    with stop_on_error():
        try:
            for i, domain in enumerate(DOMAINS):
                bar.progress(i / len(DOMAINS), text=f"Routing the evaluation corpus: {domain}…")
                parts.append(get_domain_trace(source, domain))
        finally:
            bar.empty()
    return moeviz.Trace.concat(parts)


def prompt_or_corpus_trace(source: str) -> moeviz.Trace:
    """A toggle between the prompt (with its form) and the evaluation corpus; the chosen trace."""
    corpus = toggle(
        "Use the evaluation corpus (all domains) instead of the prompt",
        "use_corpus",
        help="8 windows of 256 tokens from each domain of sample_models/eval: enough for the verdicts.",
    )
    if corpus:
        with stop_on_error():
            get_model(source)  # with its spinner: the per-domain captures show none
        return corpus_trace(source)
    return load_or_stop(source, prompt_form())


def toggle(label: str, store_key: str, help: str | None = None) -> bool:
    """A toggle whose value survives page switches (`st.session_state[store_key]`)."""
    return bool(kept(store_key, [False, True], st.toggle, label, help=help))


# ---- attention ----------------------------------------------------------------------------------------
def clicked_head(*events) -> tuple[int, int] | None:
    """(layer, head) clicked in any of the head-grid heatmaps (`moeviz.charts.HEAD_SELECTION`), if any."""
    for event in events:
        points = (event or {}).get("selection", {}).get(moeviz.charts.HEAD_SELECTION) or []
        if points and int(points[0].get("head", -1)) >= 0:
            return int(points[0]["layer"]), int(points[0]["head"])
    return None


def pick_head(layers: list[int], num_heads: int, clicked: tuple[int, int] | None) -> tuple[int, int]:
    """Attention layer and head pickers (choices survive page switches: `attention_layer`,
    `attention_head`); a newly clicked head-grid cell selects its layer and head."""
    if _new_click(clicked, "head_clicked") and clicked[0] in layers:
        st.session_state["attention_layer"], st.session_state["attention_head"] = clicked
    a, b = st.columns(2)
    heads = list(range(num_heads))
    layer = kept(
        "attention_layer",
        layers,
        a.selectbox,
        "Attention layer",
        layers,
        help="Decoder layers with a softmax attention map",
    )
    head = kept("attention_head", heads, b.selectbox, "Head", heads, help="Or click a cell of the head grid")
    return int(layer), int(head)


def number(label: str, store_key: str, default: int, lo: int, hi: int, help: str | None = None) -> int:
    """An integer input whose value survives page switches (`st.session_state[store_key]`)."""
    # a kept value out of [lo, hi] is clamped (not reset to lo, as `remember` would)
    st.session_state[store_key] = min(max(int(st.session_state.get(store_key, default)), lo), hi)
    return int(kept(store_key, range(lo, hi + 1), st.number_input, label, lo, hi, step=1, help=help))
