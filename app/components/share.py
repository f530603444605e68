"""What a view shares: its state in the URL and the Python that reproduces it.

URL state (`st.query_params`): the model, MoE layer, token, expert and Learn step; the page is the URL's path
(Streamlit's navigation). A link opened restores them once, on the session's first run with that value: a
value read from the URL is applied like a choice made by hand, a bad or unknown one is ignored with a toast
naming it, never a traceback. Each picker writes its value back after it is drawn (`publish`), so the
address bar always holds the view on show. A model comes from a link only when this server may open it: a
bundled sample, or a folder inside `MOEVIZ_MODEL_DIRS` (`access.check_source`).

"Reproduce in Python" (`reproduce`): an expander with the code string of `moeviz.snippets` built from the
page's current choices; `snippet_input` turns a page's model key and input into a `SnippetInput`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

import streamlit as st

import moeviz
from components import access, load_options
from moeviz import snippets
from moeviz.snippets import SnippetInput

MODEL, LAYER, TOKEN, EXPERT, STEP = "model", "layer", "token", "expert", "step"
SYNCED = "share_synced"  # session: {parameter: the value this session last read from or wrote to the URL}
LINK_EXPERT = "share_link_expert"  # session: an expert id read from a link, until the expert picker takes it


# ---- the URL -----------------------------------------------------------------------------------------------
def incoming(name: str) -> str | None:
    """The URL's value of `name` when it came from a link (not this session's own `publish`), once; else
    None. A widget changed since then is the user's choice: the URL's old value must not undo it."""
    value = st.query_params.get(name)
    synced = st.session_state.setdefault(SYNCED, {})
    if value is None or synced.get(name) == value:
        return None
    synced[name] = value
    return value


def publish(name: str, value: object | None) -> None:
    """Write `value` (None: remove the parameter) as the URL's `name`."""
    synced = st.session_state.setdefault(SYNCED, {})
    if value is None:
        synced.pop(name, None)
        if name in st.query_params:
            del st.query_params[name]
        return
    text = str(value)
    synced[name] = text
    if st.query_params.get(name) != text:
        st.query_params[name] = text


def ignored(name: str, value: str, why: str) -> None:
    """Say that a link's `name`=`value` was not applied, and why (one line, no traceback)."""
    st.toast(f"Link: ignored {name}={value!r}: {why}", icon=":material/link_off:")


def restore(name: str, store_key: str, options: Sequence[str], what: str) -> None:
    """Before a kept picker (`widgets.kept(store_key, options, …)`): a link's `name` among `options` becomes
    the kept choice; another value is ignored with a toast (`what` names the options)."""
    value = incoming(name)
    if value is None:
        return
    if value in options:
        st.session_state[store_key] = value
    else:
        ignored(name, value, f"not one of the {what}")


def restore_model(choices: Sequence[str]) -> None:
    """In the model picker, after its first-run default: a link's model becomes the sidebar's model — a
    bundled sample among `choices`, or a local folder this server may open (`access.check_source`: inside
    MOEVIZ_MODEL_DIRS, links under it too). A Lab model is this session's only: never from a link."""
    value = incoming(MODEL)
    if value is None:
        return
    if value.startswith(access.SAMPLE_PREFIX):
        if value in choices:
            st.session_state["model"] = value
        else:
            ignored(MODEL, value, "no such sample model")
        return
    try:
        folder = access.check_source(value)
    except moeviz.MoevizError as exc:
        ignored(MODEL, value, str(exc))
        return
    if not Path(folder).is_dir():
        ignored(MODEL, value, "no such folder on this server")
        return
    st.session_state["model"] = access.LOCAL_FOLDER
    st.session_state["model_folder_kept"] = folder


def model_value(choice: str, source: str) -> str | None:
    """What the URL names for the sidebar's `choice` whose source is `source`: the sample or the folder; None
    for a Lab model (a link cannot open it)."""
    return None if choice.startswith(access.LAB_PREFIX) else (source or None)


def token_value(seq: int, pos: int) -> str:
    """A token in the URL: "pos" in the first sequence, "seq/pos" in another."""
    return str(pos) if seq == 0 else f"{seq}/{pos}"


def parse_token(text: str) -> tuple[int, int] | None:
    """(seq, pos) of a URL token ("pos" or "seq/pos"); None when it is neither."""
    seq, _, pos = text.rpartition("/")
    try:
        return int(seq or 0), int(pos)
    except ValueError:
        return None


def restore_token(options: dict[str, tuple[int, int]]) -> bool:
    """Before the token picker: a link's token among `options` (label → (seq, pos)) becomes the kept one (a
    choice: no default moves it); → whether it did. Another value is ignored with a toast."""
    value = incoming(TOKEN)
    if value is None:
        return False
    key = parse_token(value)
    labels = [label for label, where in options.items() if where == key]
    if not labels:
        ignored(TOKEN, value, "no such token in this input" if key else "not a position (pos or seq/pos)")
        return False
    st.session_state["token"] = labels[0]
    return True


def check_link_expert(num_experts: int) -> None:
    """With the layer known: keep a link's expert for the expert picker (`take_link_expert`) if this model
    has it; otherwise ignore it with a toast."""
    value = incoming(EXPERT)
    if value is None:
        return
    try:
        expert = int(value)
    except ValueError:
        ignored(EXPERT, value, "not an expert id")
        return
    if 0 <= expert < num_experts:
        st.session_state[LINK_EXPERT] = expert
    else:
        ignored(EXPERT, value, f"this model has experts 0–{num_experts - 1}")


def take_link_expert() -> int | None:
    """The expert a link asked for (`check_link_expert`), once."""
    return st.session_state.pop(LINK_EXPERT, None)


# ---- "Reproduce in Python" ---------------------------------------------------------------------------------
def snippet_input(model_key: str, page_in=None, text: str | None = None) -> SnippetInput:
    """The `SnippetInput` of a page: `model_key` the sidebar's (`model_picker`), with `page_in` (a
    `page_input.PageInput`: the prompt, the corpus or a routing file) or the prompt `text`."""
    source, options = load_options.split_key(model_key)
    defaults = {"dtype": "auto", "device": "auto"}  # `load_model`'s own: left out of the call
    kwargs = {name: value for name, value in options.load_kwargs().items() if defaults.get(name) != value}
    if page_in is None:
        return SnippetInput(source, text=text, load_kwargs=kwargs)
    if page_in.from_file:  # a path's ident is "path|size|mtime"; an upload: its file name, the user has it
        path = page_in.key[1].split("|")[0] if "|" in page_in.key[1] else page_in.label.rsplit(" (", 1)[0]
        return SnippetInput(source, file=path, load_kwargs=kwargs)
    if page_in.is_corpus:
        return SnippetInput(source, corpus=True, load_kwargs=kwargs)
    return SnippetInput(source, text=page_in.key[1], load_kwargs=kwargs)


def reproduce_key(what: str) -> str:
    """The widget key of the "Reproduce in Python" expander of `what` (its open state)."""
    return "reproduce_" + re.sub(r"\W+", "_", what).strip("_")


def reproduce(build: Callable[[], str], what: str = "this view") -> None:
    """The "Reproduce in Python" expander: the code `build()` returns (a `moeviz.snippets` function with the
    page's choices), with Streamlit's copy button; a choice no snippet reproduces is said in one line.
    Built and sent only while open: a closed one costs the page nothing (the highlighted code alone cost
    the browser ~0.2 s and 1.5 MB of script on every page)."""
    with st.expander(
        "Reproduce in Python", icon=":material/code:", key=reproduce_key(what), on_change="rerun"
    ) as box:
        if not box.open:
            return
        try:
            code = build()
        except moeviz.MoevizError as exc:
            st.caption(f"No snippet for {what}: {exc}")
            return
        st.code(code, language="python", wrap_lines=True)
        st.caption(
            f"The library calls behind {what}, with the choices on screen: paste into Python where moeviz is "
            "installed (HF_HUB_OFFLINE=1, as the app runs)."
        )


# The Learn steps' models and the store keys of their layer sliders (None: the step's first MoE layer)
LEARN_LAYERS = {
    "load": "learn_load_layer",
    "aux": "learn_aux_layer",
    "collapse": "learn_collapse_layer",
    "bias": "learn_bias_layer",
    "shared": "learn_shared_layer",
}


def learn_code(step: str) -> str:
    """The snippet of Learn step `step` with the step's choices on screen (its layer, k, token)."""
    from components import learn as lesson_ui

    model = lesson_ui.BIASED if step in ("bias", "shared", "deployment") else lesson_ui.HEALTHY
    layer = st.session_state.get(LEARN_LAYERS[step]) if step in LEARN_LAYERS else None
    token = None
    if step == "router" and st.session_state.get("learn_token"):
        token = parse_token(str(st.session_state["learn_token"]).split(":", 1)[0])
    return snippets.learn_view(
        step,
        lesson_ui.LESSON_TEXT,
        model,
        layer=None if layer is None else int(layer),
        k=st.session_state.get("learn_k") if step == "top_k" else None,
        token=token,
        models=lesson_ui.COLLAPSE_SAMPLES if step == "collapse" else None,
    )


def engine_input(side, text: str) -> SnippetInput:
    """The `SnippetInput` of one side of the Engines page (`engine_sources.Source`): a capture of the prompt
    at its model key, or a routing file; a vLLM run is not reproduced in-process (SnippetError)."""
    if side.kind == "vllm":
        raise snippets.SnippetError(
            "a vLLM side runs in vLLM's own environment: `moeviz capture --engine vllm` reproduces it"
        )
    if side.model_key is not None:
        return snippet_input(side.model_key, text=text)
    path = side.ident.split("|")[0] if "|" in side.ident else side.label
    return SnippetInput(side.label, file=path)


def kept_token() -> tuple[int, int] | None:
    """(seq, pos) of the token kept by the token picker (its label "pos:token" or "seq/pos:token")."""
    label = st.session_state.get("token")
    return None if label is None else parse_token(str(label).split(":", 1)[0])


# The Why page's what-if choices → `moeviz.snippets.INTERVENTIONS`
WHY_INTERVENTIONS = {
    "Disable expert for this token": "disable_token",
    "Disable expert in this layer": "disable_layer",
    "Disable expert everywhere": "disable_everywhere",
    "Force this token to the expert": "force",
    "Replace the top choice by the next-best": "next_best",
}


def deployment_input(model_key: str, page_in, stored: bool, text: str) -> SnippetInput:
    """The `SnippetInput` of the Deployment page's replays (`snippet_input`); a store run is not a snippet's
    input (SnippetError: `routes_from_store` reads it)."""
    if stored:
        raise snippets.SnippetError(
            "a store run: `moeviz.whatif.routes.routes_from_store(store, model=…, checkpoint=…)` gives its "
            "routes, which the same what-if functions take"
        )
    return snippet_input(model_key, page_in, text)


def model_and_options(model_key: str) -> tuple[str, dict]:
    """(source, the `load_model` options that are not its defaults) of a model key."""
    source = snippet_input(model_key, text="")
    return source.model, dict(source.load_kwargs)
