"""The input of a page that reads routing, chosen once and shared by every page (session state, as the
prompt is): the sidebar model run on the prompt (or, where a page offers it, on the evaluation corpus), or a
routing file (`routing_files`: a path inside the store folders, or an upload) — a Trace captured by `moeviz
capture` or imported by `moeviz import`, or an engine's expert counts without tokens (an `ExpertLoad`).

Pages that need per-token routing stop on a load table with one line (`trace_or_stop`); pages that run the
model say in one line that they use the prompt when a file is chosen (`runs_the_model`); what an imported
trace lacks (router scores, slot order, token ids) is said once per page (`not_shown`). No model math here.
"""

from __future__ import annotations

import dataclasses

import streamlit as st

import moeviz
from components import caches, prompt, routing_files
from components.routing_frames import RoutingFrames, ScaleFrames, frames_for
from components.widgets import kept, toggle
from moeviz.trace import ExpertLoad

MODEL = "model"
INPUT = "page_input"  # session: the input chosen (MODEL, routing_files.PATH or UPLOAD), shared by the pages
KINDS = {MODEL: "this model on the prompt", **routing_files.KINDS}
FILE = "file"  # the first part of a file's cache key: ("file", its ident)
CORPUS = "corpus"  # the second part of the evaluation corpus's: (model key, "corpus")


@dataclasses.dataclass(frozen=True)
class PageInput:
    """A page's routing: `routing` a Trace, or an ExpertLoad (a file of expert counts); `key` what the caches
    key on ((model key, the prompt's text or "corpus"), or (FILE, the file's ident)); `label` how the page
    names it ("the prompt", "the evaluation corpus", the file's name)."""

    kind: str
    key: tuple[str, str]
    routing: moeviz.Trace | ExpertLoad
    label: str

    @property
    def from_file(self) -> bool:
        return self.kind != MODEL

    @property
    def is_load(self) -> bool:
        """A load table: expert counts per layer, no tokens."""
        return isinstance(self.routing, ExpertLoad)

    @property
    def is_corpus(self) -> bool:
        return not self.from_file and self.key[1] == CORPUS

    @property
    def input_key(self) -> str:
        """What a cache keyed by (model key, input) takes as the input: the prompt's text, CORPUS, or
        "file:<ident>"."""
        return f"{FILE}:{self.key[1]}" if self.from_file else self.key[1]


def chosen() -> str:
    """The input kind chosen in this session (MODEL until another is chosen)."""
    return st.session_state.get(INPUT, MODEL)


def page_input(source: str, *, corpus: bool = False, form: bool = True) -> PageInput:
    """The input picker (shared across pages) and the routing it gives: the prompt form (and, with `corpus`,
    the evaluation-corpus toggle) for the model — without `form`, the prompt last submitted, no form — or the
    routing file's widget. Errors stop the page with their message."""
    model_label = "this model on the prompt or corpus" if corpus else KINDS[MODEL]
    kind = kept(
        INPUT,
        list(KINDS),
        st.radio,
        "Routing of",
        list(KINDS),
        format_func=lambda k: model_label if k == MODEL else KINDS[k],
        horizontal=True,
        help="The sidebar model run on text, or a moeviz routing file: a trace from `moeviz capture --out` "
        "or `moeviz import --out` (an engine's routing), or a load table of expert counts from `moeviz "
        "import`. The choice holds on every page.",
    )
    if kind != MODEL:
        picked = routing_files.pick_file(kind, INPUT, "Routing file")
        return PageInput(kind, (FILE, picked.ident), picked.routing, f"{picked.name} ({source_name(picked)})")
    if corpus and toggle(
        "Use the evaluation corpus (all domains) instead of the prompt",
        "use_corpus",
        help="8 windows of 256 tokens from each domain of sample_models/eval: enough for the verdicts.",
    ):
        return PageInput(kind, (source, CORPUS), caches.corpus_trace(source), "the evaluation corpus")
    text = prompt.prompt_form() if form else prompt.current_prompt()
    return PageInput(kind, (source, text), caches.load_or_stop(source, text), "the prompt")


def source_name(picked: routing_files.RoutingFile) -> str:
    """Where a file's routing came from: the import format, or "moeviz capture" for a capture."""
    routing = picked.routing
    if isinstance(routing, ExpertLoad):
        return f"{routing.source} expert counts"
    sources = sorted({r.decision_source for r in routing.layers})
    captured = {"dispatch", "router_output", "recomputed"}
    return "moeviz capture" if set(sources) <= captured else ", ".join(sources)


def trace_or_stop(page_in: PageInput, needs: str) -> moeviz.Trace:
    """The page's Trace; for a load table one line saying what the page needs (`needs`: "which experts each
    token chose", …) and the page stops."""
    if page_in.is_load:
        st.info(
            f"{page_in.label} is a load table (expert counts per layer, no tokens): this page needs {needs}. "
            "Load & collapse and Deployment's expert-parallel what-if read load tables.",
            icon=":material/table_chart:",
        )
        st.stop()
    return page_in.routing


def runs_the_model(what: str) -> None:
    """One line, when a routing file is the chosen input: `what` runs the model on the prompt instead."""
    if chosen() != MODEL:
        st.caption(
            f"{what} runs the model on text, so it uses the prompt below, not the routing file chosen on the "
            "other pages."
        )


def has_scores(trace: moeviz.Trace) -> bool:
    """Whether every MoE layer carries router logits (an engine import records only the chosen experts)."""
    return all(r.has_logits for r in trace.layers)


def is_ranked(trace: moeviz.Trace) -> bool:
    """Whether every MoE layer's slot 0 is its top choice (Megatron's router trace lists experts by id)."""
    return all(r.ranked for r in trace.layers)


def not_shown(trace: moeviz.Trace, scores: str = "", top1: str = "") -> None:
    """One caption naming what this page does not show of `trace`: `scores` (the views that need router
    scores) when it has none, `top1` (the views of top-1 experts) when its slots are not ranked."""
    missing = []
    source = trace.layers[0].decision_source if trace.layers else "the file"
    if scores and not has_scores(trace):
        missing.append(
            f"{scores} need router scores, which {source} does not record (only the chosen experts)"
        )
    if top1 and not is_ranked(trace):
        missing.append(
            f"{top1} need ranked slots: {source} lists each token's experts in id order, not by weight"
        )
    if missing:
        st.caption("Not shown: " + "; ".join(missing) + ".")


@st.cache_resource(show_spinner=False, max_entries=8)
def _file_frames(ident: str, _trace: moeviz.Trace) -> RoutingFrames | ScaleFrames:
    """The Routing page's frames of a routing file, built once per file and shared (read-only)."""
    return frames_for(_trace)


def routing_frames(page_in: PageInput) -> RoutingFrames | ScaleFrames:
    """The Routing page's frames of the page's trace (`caches.routing_frames` for the prompt)."""
    if page_in.from_file:
        return _file_frames(page_in.key[1], page_in.routing)
    return caches.routing_frames(*page_in.key)
