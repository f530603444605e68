"""Pickers whose choice survives page switches: the model (sidebar), MoE layer, token and attention head (the
expert picker is the expert axis's: `expert_axis.pick_expert`; where it starts, `default_expert`); a click
on a selectable chart moves the token and head pickers."""

from __future__ import annotations

import streamlit as st

import moeviz
import moeviz.charts
from components import access, load_options, share
from components.errors import stop_on_error
from components.widgets import keep, kept, new_click
from moeviz.analysis import expert_order


def model_picker() -> str:
    """Sidebar: pick a sample, a model this session trained on the Lab page ("lab: <name>", opened from its
    saved folder) or type a local folder, and how to load it (the "Advanced" expander). Returns
    the model key (`load_options`: the checked source, plus the load options when not the defaults); stops
    the page with a message on a bad source or option."""
    samples = access.sample_sources()
    lab = st.session_state.get("lab_models", {})  # models trained on the Lab page: name -> saved folder
    choices = [*samples, *(access.LAB_PREFIX + name for name in lab), access.LOCAL_FOLDER]
    default = access.default_model()
    if "model" not in st.session_state:  # the choice kept across page switches
        if default.startswith(access.SAMPLE_PREFIX):
            st.session_state["model"] = default if default in samples else choices[0]
        else:
            st.session_state["model"] = access.LOCAL_FOLDER
            st.session_state["model_folder_kept"] = default
    share.restore_model(samples)  # a link's model (a sample, or a folder this server may open)
    with st.sidebar:
        choice = kept("model", choices, st.selectbox, "Model", choices, widget_key="model_choice")
        source = choice
        if choice.startswith(access.LAB_PREFIX):
            source = lab[choice.removeprefix(access.LAB_PREFIX)]
        elif choice == access.LOCAL_FOLDER:
            st.session_state["model_folder"] = st.session_state.get("model_folder_kept", "")
            source = st.text_input(
                "Model folder",
                key="model_folder",
                help=f"A Hugging Face folder. {access.roots_hint('model')}",
                on_change=keep,
                args=("model_folder", "model_folder_kept"),
            )
        options = advanced_load_options()
    share.publish(share.MODEL, share.model_value(choice, source))
    with stop_on_error():
        checked = access.check_source(source or "")
        options.load_kwargs()  # a bad option stops the page before anything loads
        return options.key(checked)


def _kept_text(label: str, store_key: str, **kwargs) -> str:
    """A text input whose value survives page switches (`st.session_state[store_key]`)."""
    widget_key = f"{store_key}_widget"
    st.session_state[widget_key] = st.session_state.get(store_key, "")
    return st.text_input(label, key=widget_key, on_change=keep, args=(widget_key, store_key), **kwargs)


def advanced_load_options() -> load_options.LoadOptions:
    """The "Advanced" expander of the model picker: dtype, device, device map (offload folder, max memory)
    and an adapter folder, passed on to `moeviz.load_model`; each choice survives page switches."""
    with st.expander("Advanced", expanded=False):
        dtype = kept(
            "load_dtype",
            load_options.DTYPES,
            st.selectbox,
            "dtype",
            load_options.DTYPES,
            help="auto = the checkpoint's own dtype (fp16 loads as fp32 on a CPU). Router scores are always "
            "computed in fp32.",
        )
        devices = load_options.devices()
        device = kept(
            "load_device",
            devices,
            st.selectbox,
            "Device",
            devices,
            help="auto = CUDA, then MPS, then the CPU (only the devices available here are offered)",
        )
        device_map = kept(
            "load_device_map",
            load_options.DEVICE_MAPS,
            st.selectbox,
            "Device map",
            load_options.DEVICE_MAPS,
            help="auto spreads a model over the GPUs, CPU RAM and disk (needs accelerate); replaces the "
            "device and the memory check",
        )
        spread = device_map != "none"
        folder = _kept_text(
            "Offload folder",
            "load_offload_folder",
            disabled=not spread,
            help="With device map auto: where the modules that go to disk are kept. "
            + access.roots_hint("model"),
        )
        budget = _kept_text(
            "Max memory",
            "load_max_memory",
            disabled=not spread,
            placeholder="cpu=2GiB",
            help="With device map auto: a budget per device, DEVICE=SIZE pairs such as 0=70GiB,cpu=8GiB",
        )
        adapter = _kept_text(
            "Adapter folder",
            "load_adapter",
            help="A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors), merged over "
            "the model above; empty = the model alone. " + access.roots_hint("model"),
        )
    return load_options.LoadOptions(
        dtype=dtype,
        device=device,
        device_map=device_map,
        offload_folder=(folder or "") if spread else "",
        max_memory=(budget or "") if spread else "",
        adapter=(adapter or "").strip(),
    )


def layer_options(keys: list[tuple[str, int]]) -> dict[str, tuple[str, int]]:
    """Slider labels of the MoE layers → (site, layer); the site is named only when a model has several."""
    several = len({site for site, _ in keys}) > 1
    return {(f"{layer} ({site})" if several else str(layer)): (site, layer) for site, layer in keys}


def pick_layer(trace: moeviz.Trace, label: str = "MoE layer") -> tuple[str, int]:
    """Layer slider whose choice survives page switches (`st.session_state["layer"]`); → (site, layer)."""
    layers = layer_options(trace.layer_keys)
    share.restore(share.LAYER, "layer", list(layers), "MoE layers of this model")
    chosen = kept("layer", list(layers), st.select_slider, label, list(layers))
    share.publish(share.LAYER, chosen)
    site, layer = layers[chosen]
    share.check_link_expert(trace.layer(layer, site).num_experts)  # the expert picker, below, takes it
    _layer_kind(trace.layer(layer, site))
    return site, layer


def _layer_kind(routing) -> None:
    """Say what is special about the chosen layer's routing: a hash table chose its experts, it has
    zero-computation experts, or it is one pass of a looped block."""
    notes = []
    if routing.hash_routed:
        notes.append(
            "This layer chooses experts by a fixed token-id table (hash routing): the router scores only "
            "weight the chosen experts, so scores and margins do not explain the choice."
        )
    if routing.zero_experts:
        first = routing.routed_experts
        notes.append(
            f"Experts {first}–{routing.num_experts - 1} are zero-computation experts (they compute nothing); "
            "loads and balance count only experts "
            f"0–{first - 1}."
        )
    if routing.loop_pass:
        notes.append(f"Pass {routing.loop_pass + 1} of a looped block ({routing.module}).")
    if notes:
        st.caption(" ".join(notes))


# The token label a picker started on by itself (`pick_token`'s first token, `default_token`'s), until the
# user picks one: a page with a default of its own does not take it for the user's choice
TOKEN_DEFAULT = "token_default"


def pick_token(options: dict[str, tuple[int, int]], clicked: tuple[int, int] | None) -> tuple[int, int]:
    """Token picker (label → (seq, pos)); a newly clicked heatmap cell selects its token. The choice
    survives page switches (`st.session_state["token"]`); where none is kept among `options` it starts on
    the first token, remembered as a default (`TOKEN_DEFAULT`) until another token is picked."""
    labels = list(options)
    by_key = {key: label for label, key in options.items()}
    if new_click(clicked, "token_clicked") and clicked in by_key:
        st.session_state["token"] = by_key[clicked]
    if share.restore_token(options):  # a link's token: a choice, as if picked
        st.session_state.pop(TOKEN_DEFAULT, None)
    if st.session_state.get("token") not in labels:  # `kept` falls back on the first
        st.session_state[TOKEN_DEFAULT] = labels[0]
    label = kept("token", labels, st.selectbox, "Token", labels, help="Or click a heatmap cell")
    if label != st.session_state.get(TOKEN_DEFAULT):  # picked, or clicked: the user's
        st.session_state.pop(TOKEN_DEFAULT, None)
    share.publish(share.TOKEN, share.token_value(*options[label]))
    return options[label]


def default_token(labels: list[str], default: str) -> None:
    """Call before `pick_token`: start on `default` (the Why page: the last token) unless the user picked a
    token among `labels` — where the kept one is not among them (a new prompt) or was a picker's own start
    (another page's first token)."""
    token = st.session_state.get("token")
    if token not in labels or token == st.session_state.get(TOKEN_DEFAULT):
        st.session_state["token"] = st.session_state[TOKEN_DEFAULT] = default


def clicked_token(event) -> tuple[int, int] | None:
    """(seq, pos) of the token clicked in a selectable heatmap (`moeviz.charts.TOKEN_SELECTION`), if any."""
    points = (event or {}).get("selection", {}).get(moeviz.charts.TOKEN_SELECTION) or []
    if not points:
        return None
    point = points[0]
    return int(point.get("seq", 0)), int(point["pos"])


WHY_CELL = "why_cell"  # the heatmap cell last clicked on the Routing page: (seq, pos, expert)
WHY_OPEN = "why_open"  # set before the Routing page's link to the Why page: the token it opens on


def clicked_cell(event) -> tuple[int, int, int | None] | None:
    """(seq, pos, expert) of the cell clicked in a selectable heatmap (`moeviz.charts.TOKEN_SELECTION`,
    whose fields carry the expert; None where a chart's do not), if any."""
    points = (event or {}).get("selection", {}).get(moeviz.charts.TOKEN_SELECTION) or []
    if not points:
        return None
    point = points[0]
    expert = point.get("expert")
    return int(point.get("seq", 0)), int(point["pos"]), None if expert is None else int(expert)


def remember_cell(event) -> None:
    """Keep the heatmap cell clicked in `event` (or None) for the Why page (`WHY_CELL`)."""
    st.session_state[WHY_CELL] = clicked_cell(event)


def open_why_on(seq: int, pos: int) -> None:
    """Call just before a link to the Why page: it then opens on token (seq, pos), at the layer on show,
    on the clicked cell's expert where the cell is this token's and its expert was dispatched there,
    else on the token's top-1 expert (`why_expert`)."""
    st.session_state[WHY_OPEN] = (int(seq), int(pos))


def link_to_why(seq: int, pos: int) -> None:
    """The link to the Why page, opening it on token (seq, pos) (`open_why_on`)."""
    open_why_on(seq, pos)
    label = "Why this expert? Attribution and what-if for this token"
    st.page_link("pages/why.py", label=label, icon=":material/help:")


def top_choice(routing, row: int) -> int | None:
    """The top choice of token row `row` of layer `routing` (`LayerRouting`): the dispatched expert with the
    largest combination weight (ties, or no weights recorded: the first slot); None where every slot was
    dropped."""
    experts, weights = routing.experts[row], routing.weights[row]
    dispatched = [(float(w), int(e)) for e, w in zip(experts, weights, strict=True) if e >= 0]
    if not dispatched:
        return None
    if not routing.has_weights:  # NaN weights: the slot order is all there is
        return dispatched[0][1]
    return max(dispatched, key=lambda pair: pair[0])[1]  # max keeps the first of equal weights


# How the kept expert (`st.session_state["expert"]`) was last set here: (model, expert, whether a default)
EXPERT_DEFAULT = "expert_default"


def default_expert(model: object, default: int | None) -> None:
    """Call before an expert picker (`expert_axis.pick_expert`, or the expert axis that draws it): start it
    on `default`, the page's own choice (the token's top choice on the Why page, the layer's busiest expert
    on Routing and Structure), unless the user chose an expert on this `model` (any hashable naming the
    model or routing file). A default moves on with the page (another layer, token, prompt or page: the new
    default); an expert picked by hand stays, until another model is opened — on which its id, kept as
    is, would name an unrelated and often dead expert. `default` None: the picker's own default."""
    linked = share.take_link_expert()  # a link's expert (checked by `pick_layer`): chosen by hand
    if linked is not None:
        set_expert(model, linked)
    kept_expert = st.session_state.get("expert")
    last = st.session_state.get(EXPERT_DEFAULT)
    on_this_model = last is not None and last[0] == model and kept_expert is not None
    # moved since it was set here (by its picker, or another page's), or chosen: the user's choice
    by_hand = on_this_model and (last[1] != kept_expert or not last[2])
    if by_hand:
        st.session_state[EXPERT_DEFAULT] = (model, kept_expert, False)
    elif default is not None:
        st.session_state["expert"] = int(default)
        st.session_state[EXPERT_DEFAULT] = (model, int(default), True)
    share.publish(share.EXPERT, st.session_state.get("expert"))  # the expert the picker below opens on


def set_expert(model: object, expert: int, *, as_default: bool = False) -> None:
    """Set the kept expert to `expert` on `model`: a link that opens a page on an expert chooses for the
    user (the Why page opened on a clicked heatmap cell), or, `as_default`, opens on the page's default
    (the token's top choice), which then moves on with the page as `default_expert` moves a default."""
    st.session_state["expert"] = int(expert)
    st.session_state[EXPERT_DEFAULT] = (model, int(expert), as_default)


def busiest_expert(load) -> int | None:
    """The busiest expert of `load` (`expert_balance_frame` rows; several layers: summed), the default of
    the Routing and Structure pages' expert pickers; None without experts."""
    return int(expert_order(load, by="load")[0]) if len(load) else None


def input_model(page_in) -> object:
    """What the experts of a page's input (`page_input.PageInput`) are experts of, for `default_expert`:
    the model, or the routing file."""
    return page_in.key if page_in.from_file else page_in.key[0]


def why_expert(routing, row: int, token: tuple[int, int]) -> tuple[int | None, str]:
    """On opening the Why page from the Routing page (`open_why_on`): the expert to explain at token
    row `row` (token (seq, pos)) of layer `routing` (`LayerRouting`), and a line saying why — the clicked
    cell's expert if it was dispatched there, else the token's top-1 (`top_choice`). (None, "") where no
    expert was dispatched."""
    top1 = top_choice(routing, row)
    if top1 is None:
        return None, ""
    dispatched = {int(e) for e in routing.experts[row] if e >= 0}
    cell = st.session_state.get(WHY_CELL)
    clicked = cell[2] if cell is not None and tuple(cell[:2]) == tuple(token) else None
    where = f"layer {routing.layer}"
    if clicked is not None and clicked in dispatched:
        return clicked, f"Opened on expert {clicked}, the heatmap cell you clicked (dispatched at {where})."
    if clicked is not None:
        return top1, (
            f"Opened on expert {top1}, this token's top-1 at {where} (largest combination weight): expert "
            f"{clicked}, the cell you clicked, was not dispatched here."
        )
    return top1, f"Opened on expert {top1}, this token's top-1 at {where} (largest combination weight)."


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
    if new_click(clicked, "head_clicked") and clicked[0] in layers:
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
