"""The Deployment page's building blocks: the routing the simulators replay, and the simulators' results
cached per (model key, input, settings); an engine's expert counts (a load table, `ExpertLoad`) replayed by
the expert-parallel what-if alone. No model math here: every number comes from `moeviz.whatif`."""

from __future__ import annotations

import dataclasses

import pandas as pd
import streamlit as st

import moeviz
from components import access, corpus_store, exports
from components.docs import deployment_section
from components.errors import stop_on_error
from components.widgets import toggle
from moeviz.charts.deployment import balancedness_chart, gpu_load_heatmap
from moeviz.store import StoreQuery
from moeviz.trace import ExpertLoad
from moeviz.whatif.capacity import SmallestCF, replay_capacity, smallest_cf
from moeviz.whatif.ep import (
    EPConfig,
    fit_placement,
    fit_placement_counts,
    simulate_ep,
    simulate_ep_load,
    split_load_steps,
)
from moeviz.whatif.model_size import (
    KNOWN_MODELS,
    ModelSize,
    expert_bytes,
    expert_flops_per_token,
    known_model_size,
    model_size,
)
from moeviz.whatif.offload import hit_rate_curve, simulate_offload_policies
from moeviz.whatif.routes import Routes, routes_from_store, routes_from_trace, sequence_token_ids

DOC = "docs/deployment-whatifs.md"  # where the definitions are, as the page names it
GIB = 2**30
SPLITS = {"shuffled": "half at random (seed 0)", "ordered": "the first half, in order"}


@dataclasses.dataclass(frozen=True)
class RerunInput:
    """The input of the tabs that run the model (quantisation, prefetch): `kwargs` for
    `quantisation_flips` / `prefetch_recall` (text= or token_ids=), `key` what their results are kept
    under, `label` how the tabs name it, `note` why it is not the page's input ("" when it is)."""

    kwargs: dict
    key: str
    label: str
    note: str


def rerun_input(page_in, text: str, stored: bool) -> RerunInput:
    """What the model-running tabs run: the evaluation corpus's sequences when the page replays the corpus,
    else the prompt; a routing file, a load table or a store run holds routing, not text the model can run
    again, so those tabs run the prompt (or the corpus) and `note` says so."""
    if page_in.is_corpus:
        ids = sequence_token_ids(page_in.routing)
        kwargs, key = {"token_ids": ids}, "corpus"
        label = f"the evaluation corpus ({len(ids)} sequences, {sum(map(len, ids)):,} tokens)"
    else:
        kwargs, key, label = {"text": text}, text, "the prompt"
    if stored:
        note = f"It runs the model, so it uses {label}, not the store run (a store holds routing only)."
    elif page_in.from_file:
        note = f"It runs the model, so it uses {label}, not the routing file."
    else:
        note = ""
    return RerunInput(kwargs, key, label, note)


def definitions(heading: str, *used: str) -> None:
    """The lines naming the definitions the results used, and the docs' section of them in an expander."""
    if len(used) == 1:
        st.caption(f"Definition: {used[0]}" + ("" if DOC in used[0] else f" ({DOC})") + ".")
    else:
        st.caption(f"Definitions ({DOC}):\n" + "".join(f"\n- {line}" for line in used))
    section = deployment_section(heading)
    if section:
        with st.expander(f"The definitions ({DOC})"):
            st.markdown(section)


@st.cache_resource(show_spinner=False, max_entries=8)
def routes(source: str, input_key: str, _trace: moeviz.Trace) -> Routes:
    """The routing of `_trace` (that of `input_key`: the prompt's text, or the corpus) as the simulators
    replay it; shared read-only by all sessions."""
    return routes_from_trace(_trace)


@st.cache_resource(show_spinner=False, max_entries=4)
def store_routes(root: str, model: str, checkpoint: str) -> Routes:
    """One run of a corpus store as the simulators replay it; shared read-only by all sessions."""
    return routes_from_store(root, model=model, checkpoint=checkpoint)


def store_run(source: str) -> tuple[Routes, str] | None:
    """Optionally a run of a corpus store instead of the prompt or the corpus (a toggle): a small store built
    from the evaluation corpus with the sidebar's model, or a store folder. → (its routes, an input key),
    or None when the toggle is off. Errors stop the page."""
    if not toggle(
        "Replay a run of a corpus store instead",
        "deployment_use_store",
        help="The simulators replay the store's routing; quantisation and prefetch still run the prompt",
    ):
        return None
    mode = st.radio(
        "Store", [corpus_store.BUILD, corpus_store.OPEN], horizontal=True, key="deployment_store_mode"
    )
    with stop_on_error():
        if mode == corpus_store.BUILD:
            root = corpus_store.sample_store(source)
        else:
            folder = st.text_input(
                "Store folder", key="deployment_store_folder", help=access.roots_hint("store")
            )
            root = corpus_store.check_store(folder or "")
        runs = sorted({(run.model, run.checkpoint) for run in StoreQuery(root).runs})
        if not runs:
            st.warning("The store holds no traced run.")
            st.stop()
        labels = [f"{model} / {checkpoint}" for model, checkpoint in runs]
        model, checkpoint = runs[labels.index(st.selectbox("Run", labels, key="deployment_store_run"))]
        with st.spinner("Reading the store…"):
            routes = store_routes(root, model, checkpoint)
    return routes, f"store:{root}:{model}:{checkpoint}"


@st.cache_resource(show_spinner=False, max_entries=4)
def model_facts(source: str, _loaded: moeviz.LoadedModel) -> tuple[ModelSize, float]:
    """The loaded model's size (`model_size`) and one routed expert's FLOPs per token."""
    return model_size(_loaded.model, name=source), float(expert_flops_per_token(_loaded))


@st.cache_data(show_spinner=False, max_entries=16)
def expert_size(source: str, _loaded: moeviz.LoadedModel, dtype: str) -> int:
    """Bytes of one routed expert of the model at `dtype`."""
    return int(expert_bytes(_loaded, dtype))


@st.cache_data(show_spinner=False, max_entries=64)
def ep_whatif(
    source: str, input_key: str, _routes: Routes, settings: tuple, fit_on_part: bool, split: str = "shuffled"
):
    """(before, after, how): the EP results of the plain deployment (contiguous, no redundant slot) and of the
    chosen one (`settings`: EPConfig's fields as (name, value) pairs). With `fit_on_part` the placement is
    fitted on half of the routing (`split`: `Routes.split`'s order, seed 0) and both are judged on the rest
    (`how` names the split); otherwise it is fitted on the same routing (how = "")."""
    config = EPConfig(**dict(settings))
    plain = dataclasses.replace(config, placement="contiguous", redundant=0)
    if fit_on_part:
        fit, rest, how = _routes.split(0.5, order=split)
        return simulate_ep(rest, plain), simulate_ep(rest, config, fit_placement(fit, config)), how
    return simulate_ep(_routes, plain), simulate_ep(_routes, config), ""


@st.cache_data(show_spinner=False, max_entries=64)
def ep_load_whatif(
    input_key: str,
    _load: ExpertLoad,
    settings: tuple,
    fit_on_part: bool,
    groups: int,
    split: str = "shuffled",
):
    """(before, after, how) of a load table (`simulate_ep_load`: GPU loads and balancedness from the counts,
    no traffic), as `ep_whatif`: with `fit_on_part` the placement is fitted on half of the table's steps
    (`split`'s order) and both are judged on the rest. `groups`: the router's n_group (EPLB's hierarchy)."""
    config = EPConfig(**dict(settings))
    plain = dataclasses.replace(config, placement="contiguous", redundant=0)
    if fit_on_part:
        fit, rest, how = split_load_steps(_load, 0.5, order=split)
        placement = fit_placement_counts(
            fit.layer_counts(),
            list(fit.layers),
            config,
            groups=groups,
            fitted_on=f"{len(fit.steps)} steps of {_load.model.source}",
        )
        return (
            simulate_ep_load(rest, plain, groups=groups),
            simulate_ep_load(rest, config, placement, groups=groups),
            how,
        )
    return simulate_ep_load(_load, plain, groups=groups), simulate_ep_load(_load, config, groups=groups), ""


def fit_split_controls(container, units: str) -> tuple[bool, str]:
    """The EP tab's "Fit on one part" toggle and, when on, how the part is drawn (`SPLITS`) → (fit on a part,
    the split order). `units`: what is split ("sequences (tokens of one sequence)", "steps")."""
    fit_on_part = container.toggle(
        "Fit on one part",
        key="ep_fit_on_part",
        help=f"Fit the placement on half of the {units} and judge it on the other half",
    )
    if not fit_on_part:
        return False, "shuffled"
    split = container.selectbox(
        "Split",
        list(SPLITS),
        format_func=SPLITS.get,
        key="ep_split",
        help=f"At random: the {units} in the fit half are drawn with seed 0 (a corpus lists its sequences "
        "domain by domain: in order, the placement would be fitted on some domains and judged on others). "
        "In order: the first half, the past to judge the future.",
    )
    return True, split


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ep_layout_controls(
    experts: int, placements: list[str], *, key: str, placement_help: str
) -> tuple[int, int, str, int]:
    """The EP tab's first row: GPUs, GPUs per node, placement (one of `placements`, eplb first chosen; its
    widget keyed `key`) and redundant slots → (gpus, gpus_per_node, placement, redundant), for routing of
    tokens and for a load table alike."""
    a, b, c, d = st.columns(4)
    gpu_options = divisors(experts)
    gpus = a.selectbox("GPUs", gpu_options, index=min(2, len(gpu_options) - 1), key="ep_gpus")
    per_node_options = divisors(gpus)
    gpus_per_node = b.selectbox(
        "GPUs per node",
        per_node_options,
        index=max(0, len(per_node_options) - 2),
        key="ep_gpus_per_node",
        help="GPUs of one node share NVLink; the rest is reached over the inter-node network",
    )
    placement = c.selectbox(
        "Placement", placements, index=placements.index("eplb"), key=key, help=placement_help
    )
    redundant = d.selectbox(
        "Redundant slots",
        [gpus * i for i in range(0, max(experts // gpus, 1) + 1)] if placement != "contiguous" else [0],
        key="ep_redundant",
        help="Extra expert copies, a multiple of the GPU count (as EPLB requires); none for contiguous",
    )
    return gpus, gpus_per_node, placement, redundant


def show_ep_placements(before, after, placement: str, redundant: int) -> None:
    """The EP tab's two GPU-load heatmaps (contiguous, no copies | the chosen placement) side by side and
    their balancedness per layer: the same views for an EPResult of tokens and an EPLoadResult of counts."""
    left, right = st.columns(2)
    with left:
        exports.show_chart(
            gpu_load_heatmap(before.gpu_load_frame(), title="Before: contiguous, no copies"), "ep_load_before"
        )
    with right:
        exports.show_chart(
            gpu_load_heatmap(after.gpu_load_frame(), title=f"After: {placement}, {redundant} redundant"),
            "ep_load_after",
        )
    both = pd.concat(
        [
            before.layers_frame().assign(placement="contiguous"),
            after.layers_frame().assign(placement=f"{placement} (+{redundant})"),
        ]
    )
    exports.show_chart(balancedness_chart(both), "ep_balancedness")


@st.cache_data(show_spinner=False, max_entries=64)
def offload_whatif(
    source: str,
    input_key: str,
    _routes: Routes,
    cache: int,
    policies: tuple[str, ...],
    size: int,
    bandwidth: float,
):
    """{policy: OffloadResult} at one cache size, experts of `size` bytes over `bandwidth` GB/s."""
    results = simulate_offload_policies(_routes, cache, policies, expert_bytes=size, bandwidth_gbps=bandwidth)
    return dict(zip(policies, results, strict=True))


CURVE_POINTS = 25  # cache sizes the hit-rate curve is drawn at, at most


def curve_caches(k: int, experts: int) -> tuple[int, ...]:
    """The cache sizes of the hit-rate curve: every size from k to E, or CURVE_POINTS of them evenly spaced
    (k and E included) when there are more (k = 8 of 256 experts: 249 replays of every layer took 30–100 s
    on 2 cores; 25 take a tenth of that and draw the same curve)."""
    if experts - k + 1 <= CURVE_POINTS:
        return tuple(range(k, experts + 1))
    return tuple(sorted({round(k + (experts - k) * i / (CURVE_POINTS - 1)) for i in range(CURVE_POINTS)}))


@st.cache_data(show_spinner=False, max_entries=16)
def offload_curve(
    source: str,
    input_key: str,
    _routes: Routes,
    caches: tuple[int, ...],
    policies: tuple[str, ...],
    size: int,
):
    """Hit rate against the cache size, per policy (`hit_rate_curve`), bytes = misses × `size` (one
    expert's bytes at the tab's format)."""
    return hit_rate_curve(_routes, caches, policies=policies, expert_bytes=size)


@st.cache_data(show_spinner=False, max_entries=64)
def capacity_whatif(
    source: str,
    input_key: str,
    _routes: Routes,
    cfs: tuple[float, ...],
    policy: str,
    exact: bool,
    group_tokens: int | None = None,
):
    """The capacity replay at the capacity factors `cfs` with drop policy `policy` (`exact` rounding or
    Megatron's float order), a dispatch group of one sequence or `group_tokens` tokens."""
    return replay_capacity(_routes, cfs, policy=policy, exact=exact, group_tokens=group_tokens)


@st.cache_data(show_spinner=False, max_entries=64)
def capacity_search(
    source: str, input_key: str, _routes: Routes, max_drop: float, exact: bool, group_tokens: int | None
) -> SmallestCF:
    """The smallest CF (to 0.01) whose replay drops less than `max_drop` (`smallest_cf`)."""
    return smallest_cf(_routes, max_drop, group_tokens=group_tokens, exact=exact)


def parse_cfs(chosen: list) -> tuple[list[float], list[str]]:
    """The capacity factors of the CF picker (presets are floats, typed ones strings) → (the positive
    numbers ascending, the entries that are not)."""
    good, bad = set(), []
    for value in chosen:
        try:
            number = float(value)
        except (TypeError, ValueError):
            bad.append(str(value))
            continue
        if number > 0 and number == number and number != float("inf"):
            good.add(number)
        else:
            bad.append(str(value))
    return sorted(good), bad


@st.cache_resource(show_spinner=False)
def known_sizes() -> list[ModelSize]:
    """The sizes of the well-known MoE architectures (`KNOWN_MODELS`, counted on the meta device)."""
    return [known_model_size(name) for name in KNOWN_MODELS]


def size_table(
    sizes: list[ModelSize], formats: tuple[str, ...], dtype: str, context: int, batch: int, gpu_gib: float
) -> pd.DataFrame:
    """One row per model: parameters, weight bytes at each of `formats`, the KV cache (per token, and for
    `batch` sequences of `context` tokens) and the GPUs of `gpu_gib` GiB needed at `dtype` (`ModelSize`)."""
    rows = []
    for size in sizes:
        rows.append(
            {
                "name": size.name,
                "total_params": size.total_params,
                "active_params": size.active_params,
                f"gpus_needed_{dtype}": size.gpus_needed(dtype, context, batch, gpu_gib),
                "kv_bytes_per_token": size.kv_bytes_per_token,
                "kv_bytes_at_context": size.kv_bytes(context, batch),
                **{f"bytes_{fmt}": size.weight_bytes(fmt) for fmt in formats},
                "routed_experts": size.routed_experts,
                "top_k": size.top_k,
                "shared_experts": size.shared_experts,
                "moe_layers": size.moe_layers,
                "layers": size.layers,
            }
        )
    return pd.DataFrame(rows)


def in_gib(table: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """The size table for the screen, beside its GiB input: every byte column in GiB (2³⁰ bytes), and its
    column settings; the downloads keep the exact bytes."""
    shown = table.copy()
    config = {}
    for name in table.columns:
        if name.startswith(("bytes_", "kv_bytes")):
            shown[name] = table[name] / GIB
            config[name] = st.column_config.NumberColumn(
                f"{name} (GiB)", format="%.3g GiB", help="GiB = 2³⁰ bytes; exact bytes in the downloads"
            )
    return shown, config
