"""Deployment what-ifs: what the routing would cost under expert parallelism, expert offloading, capacity
limits and quantisation, and how big the model is — replayed from the model on text, a routing file or a
store run (an engine's expert counts: the expert-parallel what-if alone). Every number comes from
`moeviz.whatif`."""

import dataclasses

import pandas as pd
import streamlit as st
from components import caches, deployment, exports, page_input, pickers, prompt
from components import share as sharing  # `share` names the communication share below
from components.counterfactual import cost_line, forward_timing, progress_bar, quantise_seconds, rerun_ids
from components.errors import stop_on_error

import moeviz
from moeviz import snippets
from moeviz.capture.layer_progress import layer_progress
from moeviz.charts.deployment import (
    capacity_drop_chart,
    comm_share_chart,
    cumulative_bytes_chart,
    dispatch_bytes_chart,
    flip_rate_chart,
    hit_rate_curve_chart,
    margin_flips_chart,
    overflow_heatmap,
    params_chart,
    position_drop_chart,
    prefetch_recall_chart,
)
from moeviz.charts.tables import token_options
from moeviz.interventions.cost import prefetch_cost, quantisation_cost
from moeviz.whatif.capacity import DEFAULT_CFS, DROP_POLICIES
from moeviz.whatif.ep import MESSAGE_DTYPES, PLACEMENTS, REPLICAS, SOURCES, EPConfig
from moeviz.whatif.offload import POLICIES
from moeviz.whatif.prefetch import prefetch_recall
from moeviz.whatif.quant import DEFINITION as QUANT_DEFINITION
from moeviz.whatif.quant import DTYPES, FORMATS, TARGETS, quantisation_flips

TABS = ["Expert parallelism", "Offloading", "Capacity", "Quantisation", "Model size"]
CAPACITY_FACTORS = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]
QUANT = "deployment_quant"  # session: {(model key, input key, dtype, target): QuantResult}
PREFETCH = "deployment_prefetch"  # session: {(model key, input key): prefetch recall frame}
GROUPS = ("one sequence", "a batch of N tokens")  # the capacity tab's dispatch groups


st.title("Deployment what-ifs")
source = pickers.model_picker()
chosen = page_input.page_input(source, corpus=True)
text = prompt.current_prompt()
on_prompt = not chosen.from_file and not chosen.is_corpus  # the quantisation flips open on the Why page then
loaded = caches.get_model(source)
stored = deployment.store_run(source)
load_table = None  # an engine's expert counts: the EP what-if replays them, the other simulators need tokens
with stop_on_error():
    if stored is not None:
        routes, input_key = stored
        replayed = f"the store run {routes.model} ({', '.join(routes.notes)})"
    elif chosen.is_load:
        routes, load_table, input_key = None, chosen.routing, chosen.input_key
        replayed = chosen.label
    else:
        input_key = chosen.input_key
        routes = deployment.routes(source, input_key, chosen.routing)
        replayed = chosen.label
    size, expert_flops = deployment.model_facts(source, loaded)
if load_table is not None:
    experts, k = load_table.num_experts, load_table.top_k
    st.caption(
        f"{load_table.model.architecture} · a load table of {load_table.counts.shape[0]} step(s) · "
        f"{len(load_table.layers)} MoE layers · {experts} experts, top-{k} · replayed from {replayed}"
    )
else:
    first = routes.layers[0]
    experts, k = first.num_experts, first.k
    st.caption(
        f"{chosen.routing.model.architecture} · {routes.tokens} tokens in {routes.sequences} sequence(s) · "
        f"{len(routes.layers)} MoE layers · {experts} experts, top-{k} · replayed from {replayed}"
    )
    if stored is None and routes.notes:  # zero-computation experts: the compute the router skipped
        st.info(" ".join(routes.notes))
if load_table is None and (stored is not None or chosen.from_file):
    replayed_kind = "store was traced with" if stored is not None else "routing file was taken from"
    model_experts = sorted({site.num_experts for site in loaded.sites})
    sizes = "hidden size, expert bytes and FLOPs are the sidebar model's"
    if experts not in model_experts:  # the sizes below are of another model
        st.warning(
            f"The {'store run' if stored is not None else 'routing file'} routes over {experts} experts, the "
            f"sidebar model over {', '.join(map(str, model_experts))}: {sizes}, so choose the model the "
            f"{replayed_kind}.",
            icon=":material/warning:",
        )
    else:
        st.caption(f"{sizes.capitalize()}: choose the model the {replayed_kind}.")
with stop_on_error():
    rerun = deployment.rerun_input(chosen, text, stored is not None)  # what quantisation and prefetch run
NEEDS_TOKENS = (
    "needs each token's experts: a load table has expert counts only (Expert parallelism replays them)"
)

ep_tab, offload_tab, capacity_tab, quant_tab, size_tab = st.tabs(
    TABS, key="deployment_tab", on_change="rerun"
)

if ep_tab.open is not False and load_table is not None:
    with ep_tab:
        gpus, gpus_per_node, placement, redundant = deployment.ep_layout_controls(
            experts,
            ["contiguous", "eplb"],
            key="ep_load_placement",
            placement_help="contiguous: expert e on GPU e // (E/G); eplb: DeepSeek's EPLB rebalance_experts "
            "on the counts. (traffic needs which experts tokens choose together: per-token routing.)",
        )
        fit_on_part, split = deployment.fit_split_controls(st, "load table's steps")
        # EPLB's hierarchy uses the router's groups: the sidebar model's, when it routes over as many experts
        sites = [site for site in loaded.sites if site.num_experts == experts]
        groups = (sites[0].n_group or 1) if sites else 1
        ep_result = None
        try:
            config = EPConfig(
                gpus=gpus, gpus_per_node=gpus_per_node, redundant=redundant, placement=placement
            )
            with st.spinner("Placing the experts on the deployment…"):
                ep_result = deployment.ep_load_whatif(
                    input_key,
                    load_table,
                    tuple(dataclasses.asdict(config).items()),
                    fit_on_part,
                    groups,
                    split,
                )
        except moeviz.MoevizError as exc:
            st.error(str(exc))
        if ep_result is not None:
            before, after, how = ep_result
            st.metric(
                "ep_balancedness_over_layers",
                f"{after.ep_balancedness_over_layers:.3f}",
                delta=f"contiguous: {before.ep_balancedness_over_layers:.3f}",
                delta_color="off",
                delta_arrow="off",
                help="vLLM's Σ_l mean_g load / Σ_l max_g load (1 = every GPU equally loaded)",
            )
            st.caption(
                "From the expert counts alone: which GPU each expert's tokens land on and how evenly. The "
                "All-to-All bytes, times and communication share need each token's set of experts, which a "
                "load table does not have." + (f" Split: the {placement} placement was {how}." if how else "")
            )
            deployment.show_ep_placements(before, after, placement, redundant)
            layers = after.layers_frame()[["layer", "ep_balancedness", "max_gpu_load", "mean_gpu_load"]]
            st.dataframe(layers, hide_index=True)
            exports.table_downloads(layers, "ep_layers")
            deployment.definitions("Expert parallelism", after.definition)

if load_table is not None:
    for tab, what in ((offload_tab, "Offloading"), (capacity_tab, "The capacity replay")):
        if tab.open is not False:
            with tab:
                st.info(f"{what} {NEEDS_TOKENS}.", icon=":material/table_chart:")

if ep_tab.open is not False and load_table is None:
    with ep_tab:
        gpus, gpus_per_node, placement, redundant = deployment.ep_layout_controls(
            experts,
            list(PLACEMENTS),
            key="ep_placement",
            placement_help="contiguous: expert e on GPU e // (E/G); eplb: DeepSeek's EPLB rebalance_experts; "
            "traffic: experts often chosen together on the same GPU/node, under a balance constraint",
        )
        a, b, c, d = st.columns(4)
        token_source = a.selectbox(
            "Token source",
            SOURCES,
            key="ep_source",
            help="contiguous: token t of N on GPU ⌊t·G/N⌋; round-robin: t mod G",
        )
        replica = b.selectbox(
            "Replica choice",
            REPLICAS,
            key="ep_replica",
            help="even: the i-th token that chose an expert goes to copy i mod r (EPLB's model); "
            "vllm: (t·k + j) mod r",
        )
        message_dtype = c.selectbox(
            "Message dtype",
            MESSAGE_DTYPES,
            key="ep_message_dtype",
            help="FP8 as DeepEP sends it (one scale per 128)",
        )
        fit_on_part, split = deployment.fit_split_controls(
            d, "sequences (the tokens, when there is one sequence)"
        )
        with st.expander("Links and compute"):
            a, b, c = st.columns(3)
            nvlink = a.number_input("NVLink GB/s per GPU", 1.0, 10_000.0, 450.0, key="ep_nvlink")
            internode = b.number_input("Inter-node GB/s per GPU", 1.0, 10_000.0, 50.0, key="ep_internode")
            tflops = c.number_input("GPU TFLOP/s (achieved)", 1.0, 100_000.0, 400.0, key="ep_tflops")
            st.caption(
                "The time model is bandwidth only: each GPU's bytes ÷ its link's GB/s, with no per-message "
                "latency (the few µs each RDMA or NVLink transfer costs to start). Many small messages, as "
                "in decoding, take longer than it says."
            )
        ep_result = None
        try:
            config = EPConfig(
                gpus=gpus,
                gpus_per_node=gpus_per_node,
                redundant=redundant,
                placement=placement,
                source=token_source,
                replica=replica,
                hidden_size=size.hidden_size,
                message_dtype=message_dtype,
                nvlink_gbps=nvlink,
                internode_gbps=internode,
                gpu_tflops=tflops,
                expert_flops_per_token=expert_flops,
            )
            with st.spinner("Replaying the routing on the deployment…"):
                ep_result = deployment.ep_whatif(
                    source, input_key, routes, tuple(dataclasses.asdict(config).items()), fit_on_part, split
                )
        except moeviz.MoevizError as exc:
            st.error(str(exc))
        if ep_result is not None:
            before, after, how = ep_result
            totals, plain = after.totals(), before.totals()
            m1, m2, m3, m4 = st.columns(4)
            m1.metric(
                "ep_balancedness_over_layers",
                f"{totals['ep_balancedness_over_layers']:.3f}",
                delta=f"contiguous: {plain['ep_balancedness_over_layers']:.3f}",
                delta_color="off",
                delta_arrow="off",
                help="vLLM's Σ_l mean_g load / Σ_l max_g load (1 = every GPU equally loaded)",
            )
            m2.metric(
                "Inter-node bytes",
                f"{totals['dispatch_bytes_inter']:,}",
                delta=f"contiguous: {plain['dispatch_bytes_inter']:,}",
                delta_color="off",
                delta_arrow="off",
                help="Dispatch bytes that cross nodes (RDMA, the slow link), over all layers; a token is "
                "sent once per destination GPU (DeepEP). Combine sends as many back.",
            )
            m3.metric(
                "Dispatch bytes",
                f"{totals['combine_bytes']:,}",
                help="Over all layers, local + intra-node + inter-node; a token is sent once per destination "
                f"GPU (DeepEP). Combine bytes are the same. Remote without dedup: "
                f"{totals['dispatch_bytes_nodedup']:,}",
            )
            share = totals["comm_share"]
            m4.metric(
                "Communication share",
                "n/a" if share is None or share != share else f"{share:.1%}",
                help="Modelled All-to-All time ÷ (All-to-All + expert compute) over the MoE layers; "
                "bandwidth only, no per-message latency",
            )
            if after.same_data:
                st.caption(
                    f"The {placement} placement was fitted and evaluated on the same tokens: an in-sample "
                    "figure. Turn on *Fit on one part* to judge it on tokens it has not seen."
                )
            else:
                st.caption(
                    f"Split: the {placement} placement was {how}; both heatmaps show the evaluation part."
                )
            if replica == "vllm" and stored is None and not page_input.is_ranked(chosen.routing):
                st.caption(
                    f"{chosen.label} lists each token's experts in id order, not the router's: the vllm "
                    "replica rule (a copy by slot) follows that order."
                )
            deployment.show_ep_placements(before, after, placement, redundant)
            layers = after.layers_frame()
            exports.show_chart(dispatch_bytes_chart(layers), "ep_bytes")
            exports.show_chart(comm_share_chart(layers), "ep_comm_share")
            if not expert_flops:
                st.caption(
                    "No compute model for this model's experts: the communication share is not meaningful."
                )
            st.dataframe(layers, hide_index=True)
            exports.table_downloads(layers, "ep_layers")
            deployment.definitions("Expert parallelism", after.definition)
            sharing.reproduce(
                lambda: snippets.ep_view(
                    sharing.deployment_input(source, chosen, stored is not None, text),
                    dataclasses.asdict(config),
                    fit_on_part,
                    split,
                ),
                "the expert-parallel what-if",
            )

if offload_tab.open is not False and routes is not None:
    with offload_tab:
        a, b, c, d = st.columns([3, 3, 2, 2])
        cache = a.slider(
            "Cache size C (experts per layer on the GPU)",
            k,
            experts,
            min(experts, 2 * k),
            key="offload_cache",
        )
        policies = b.multiselect("Policies", POLICIES, default=list(POLICIES), key="offload_policies")
        weight_dtype = c.selectbox(
            "Expert weights", FORMATS, key="offload_dtype", help="The bytes one miss moves"
        )
        bandwidth = d.number_input(
            "Host → GPU GB/s", 0.1, 1000.0, 16.0, key="offload_bandwidth", help="PCIe 4.0 x16 ≈ 16 GB/s"
        )
        if not policies:
            st.info("Choose at least one policy.")
        else:
            with stop_on_error():
                expert_size = deployment.expert_size(source, loaded, weight_dtype)
                results = deployment.offload_whatif(
                    source, input_key, routes, cache, tuple(policies), expert_size, float(bandwidth)
                )
            columns = st.columns(len(results))
            for column, (policy, result) in zip(columns, results.items(), strict=True):
                column.metric(
                    f"{policy} hit rate",
                    f"{result.hit_rate:.1%}",
                    help=f"Tokens/s bound from the stalls alone: {result.tokens_per_s_bound:,.0f}",
                )
            curve_place = st.container()  # filled last: the curve replays every cache size
            steps = pd.concat([r.steps_frame().assign(policy=p) for p, r in results.items()])
            exports.show_chart(cumulative_bytes_chart(steps), "offload_bytes")
            st.caption(
                f"One miss moves one expert: {expert_size:,} bytes at {weight_dtype}. Each sequence is "
                "decoded on its own from a cold cache; prompt positions stand in for decode steps."
            )
            layers = pd.concat([r.layers_frame() for r in results.values()], ignore_index=True)
            st.dataframe(layers, hide_index=True)
            exports.table_downloads(layers, "offload_layers")
            with curve_place, stop_on_error():
                with st.spinner("Replaying every cache size for the hit-rate curve…"):
                    curve = deployment.offload_curve(
                        source,
                        input_key,
                        routes,
                        deployment.curve_caches(k, experts),
                        tuple(policies),
                        expert_size,
                    )
                exports.show_chart(hit_rate_curve_chart(curve), "offload_hit_rate")
            exports.table_downloads(curve, "offload_hit_rate_curve")
            deployment.definitions(
                "Offloading",
                *(f"{policy} — {result.definition}" for policy, result in results.items()),
            )
            sharing.reproduce(
                lambda: snippets.offload_view(
                    sharing.deployment_input(source, chosen, stored is not None, text),
                    cache,
                    policies,
                    weight_dtype,
                    bandwidth,
                ),
                "the offloading what-if",
            )

if offload_tab.open is not False:
    with offload_tab:
        st.subheader("Speculative prefetch")
        st.caption(
            "Apply layer ℓ+1's router to layer ℓ's hidden state and prefetch the experts it picks: how many "
            f"of the experts layer ℓ+1 really chose it finds. Runs the model on {rerun.label} (one forward "
            f"per sequence). {rerun.note}"
        )
        prefetched = st.session_state.setdefault(PREFETCH, {})
        prefetch_ids = rerun_ids(loaded, **rerun.kwargs)
        prefetch_row = st.container(horizontal=True, vertical_alignment="center")
        run_prefetch = prefetch_row.button(
            "Measure the prefetch recall", key="prefetch_run", icon=":material/play_arrow:"
        )
        prefetch_forwards = len(prefetch_ids or [None])
        if prefetch_ids:
            timing = forward_timing(source, loaded, prefetch_ids[0])
            prefetch_row.caption(cost_line(prefetch_cost(timing, list(map(len, prefetch_ids))), timing))
        if run_prefetch:
            update, bar = progress_bar(f"Routing {rerun.label} and applying each next router…")
            with stop_on_error(), layer_progress(loaded.model, update, forwards=prefetch_forwards):
                prefetched[(source, rerun.key)] = prefetch_recall(loaded, **rerun.kwargs)
            bar.empty()
        recall = prefetched.get((source, rerun.key))
        if recall is not None:
            exports.show_chart(prefetch_recall_chart(recall), "prefetch_recall")
            st.dataframe(recall, hide_index=True)
            exports.table_downloads(recall, "prefetch_recall")

# routing without combination weights (an engine import) cannot keep an over-full expert's largest weights
weightless = stored is None and load_table is None and not all(r.has_weights for r in chosen.routing.layers)

if capacity_tab.open is not False and routes is not None:
    with capacity_tab:
        a, b, c = st.columns([2, 1, 1])
        picked = a.multiselect(
            "Capacity factors",
            CAPACITY_FACTORS,
            default=list(DEFAULT_CFS),
            key="capacity_cfs",
            accept_new_options=True,
            help="Choose from the list or type any positive number (2.4, 5) and press Enter",
        )
        drop_policy = b.selectbox(
            "Drop policy",
            ["position"] if weightless else DROP_POLICIES,
            key="capacity_policy",
            help="probs: keep the C largest combination weights (Megatron's default); position: keep the "
            "first C arrivals"
            + ("; the routing file has no weights, so position only" if weightless else ""),
        )
        exact = c.toggle(
            "Exact rounding",
            key="capacity_exact",
            help="ceil of the exact (T·k/E)·CF; off = Megatron's float order, which can land one above",
        )
        a, b, c = st.columns([2, 1, 1])
        group = a.radio(
            "Dispatch group",
            GROUPS,
            key="capacity_group",
            horizontal=True,
            help="The tokens one capacity C = ceil((T·k/E)·CF) is counted over: each sequence on its own, or "
            "a batch of N consecutive tokens (the sequences packed one after another, as a server batches "
            "them; the last batch shorter)",
        )
        group_tokens = None
        if group == GROUPS[1]:
            group_tokens = int(
                b.number_input("N tokens", 1, 10_000_000, 2048, step=256, key="capacity_group_tokens")
            )
        max_drop = c.number_input(
            "Drops under (%)",
            0.001,
            100.0,
            1.0,
            step=0.5,
            format="%.3g",
            key="capacity_max_drop",
            help="The readout below finds the smallest CF whose replay drops less than this share",
        )
        cfs, bad = deployment.parse_cfs(picked)
        if bad:
            st.warning(f"Not a positive number, left out: {', '.join(bad)}", icon=":material/warning:")
        with stop_on_error():
            search = deployment.capacity_search(
                source, input_key, routes, float(max_drop) / 100, exact, group_tokens
            )
        st.info(search.readout, icon=":material/search:")
        if not cfs:
            st.info("Choose at least one capacity factor.")
        else:
            with stop_on_error():
                capacity = deployment.capacity_whatif(
                    source, input_key, routes, tuple(cfs), drop_policy, exact, group_tokens
                )
            layers = capacity.layers_frame()
            exports.show_chart(capacity_drop_chart(layers), "capacity_drops")
            exports.show_chart(position_drop_chart(capacity.position_frame()), "capacity_positions")
            shown_cf = st.select_slider("Overflowing experts at CF", cfs, key="capacity_shown_cf")
            exports.show_chart(overflow_heatmap(capacity.experts_frame(), shown_cf), "capacity_overflow")
            st.dataframe(layers, hide_index=True)
            exports.table_downloads(layers, "capacity_layers")
            exports.table_downloads(capacity.experts_frame(), "capacity_experts")
            deployment.definitions("Capacity", capacity.definition)
            sharing.reproduce(
                lambda: snippets.capacity_view(
                    sharing.deployment_input(source, chosen, stored is not None, text),
                    cfs,
                    drop_policy,
                    exact,
                    group_tokens,
                    float(max_drop) / 100,
                ),
                "the capacity what-if",
            )

if quant_tab.open is not False:
    with quant_tab:
        st.caption(
            f"Run {rerun.label} through the model and through a copy with fake-quantised weights, and "
            f"compare which experts each token is sent to. The shared model is never changed. {rerun.note}"
        )
        a, b = st.columns(2)
        dtype = a.selectbox("Format", DTYPES, key="quant_dtype")
        target = b.selectbox(
            "Quantise", TARGETS, key="quant_target", help="The routed experts, the router, or both"
        )
        runs = st.session_state.setdefault(QUANT, {})
        quant_ids = rerun_ids(loaded, **rerun.kwargs)
        quant_row = st.container(horizontal=True, vertical_alignment="center")
        run_quant = quant_row.button(
            "Quantise and compare routing", key="quant_run", type="primary", icon=":material/play_arrow:"
        )
        quant_forwards = 1
        if quant_ids:
            timing = forward_timing(source, loaded, quant_ids[0])
            quant_estimate = quantisation_cost(
                timing, list(map(len, quant_ids)), quantise_seconds(source, loaded, dtype, target)
            )
            quant_forwards = quant_estimate.forwards
            quant_row.caption(cost_line(quant_estimate, timing))
        if run_quant:
            with st.status(f"Quantising the {target} to {dtype}…", expanded=True) as status:
                update, bar = progress_bar(f"fake-quantising the {target} weights to {dtype}")
                with layer_progress(loaded.model, update, forwards=quant_forwards) as ticker:

                    def progress(_fraction: float, message: str) -> None:  # a stage: named, and a Stop point
                        ticker.what = message
                        update(ticker.done / (ticker.forwards * ticker.layers), message)

                    try:
                        runs[(source, rerun.key, dtype, target)] = quantisation_flips(
                            loaded, **rerun.kwargs, dtype=dtype, target=target, progress=progress
                        )
                    except moeviz.MoevizError as exc:
                        status.update(label=str(exc), state="error")
                    else:
                        status.update(
                            label=f"Compared {dtype} ({target}) with the original", state="complete"
                        )
        sharing.reproduce(
            lambda: snippets.quantisation_view(
                sharing.snippet_input(source, chosen if chosen.is_corpus else None, text), dtype, target
            ),
            "the quantisation what-if",
        )
        mine = {key[2:]: result for key, result in runs.items() if key[:2] == (source, rerun.key)}
        if not mine:
            st.info(f"Press the button to run the comparison on {rerun.label} (its cost is beside it).")
            deployment.definitions("Quantisation", QUANT_DEFINITION)
        else:
            flips = pd.concat([r.layers_frame() for r in mine.values()], ignore_index=True)
            exports.show_chart(flip_rate_chart(flips), "quant_flip_rate")
            st.dataframe(flips, hide_index=True)
            exports.table_downloads(flips, "quant_flip_rate")
            chosen = mine.get((dtype, target)) or list(mine.values())[-1]
            st.metric(
                f"Δ mean log-prob of the next token ({chosen.dtype}, {chosen.target})",
                f"{chosen.delta_logprob:+.4f}",
                help=f"Quantised − original, mean over the positions of {rerun.label}",
            )
            exports.show_chart(margin_flips_chart(chosen.margin_frame()), "quant_margins")
            st.markdown(f"**Tokens whose experts changed** ({chosen.dtype}, {chosen.target})")
            flipped = chosen.flips_frame()
            if flipped.empty:
                st.success("No token changed its experts.")
            else:
                st.dataframe(flipped, hide_index=True)
                exports.table_downloads(flipped, "quant_flipped_tokens")
                labels = {
                    f"layer {row.layer} · {row.pos}:{row.token}": (int(row.layer), int(row.seq), int(row.pos))
                    for row in flipped.itertuples()
                }
                pick = st.selectbox("See a flipped token's scores", list(labels), key="quant_flip_pick")

                def open_on(layer: int, seq: int, pos: int) -> None:
                    options = {key: label for label, key in token_options(chosen.routing.tokens).items()}
                    st.session_state["layer"] = str(layer)
                    st.session_state["token"] = options.get((seq, pos), st.session_state.get("token"))
                    pickers.open_why_on(seq, pos)
                    st.session_state["deployment_go_why"] = True

                st.button(
                    "Open its scores on the Why page",
                    key="quant_open_why",
                    icon=":material/help:",
                    on_click=open_on,
                    args=labels[pick],
                    disabled=not on_prompt,
                    help=None
                    if on_prompt
                    else "The Why page explains the prompt: choose this model on the "
                    "prompt above (not the corpus or a routing file)",
                )
                if st.session_state.pop("deployment_go_why", False):
                    st.switch_page("pages/why.py")
            st.markdown("**Model bytes per format**")
            st.dataframe(chosen.bytes_frame(), hide_index=True)
            exports.table_downloads(chosen.bytes_frame(), "quant_bytes")
            deployment.definitions("Quantisation", chosen.definition)

if size_tab.open is not False:
    with size_tab:
        a, b, c, d = st.columns(4)
        size_dtype = a.selectbox("Weights", FORMATS, key="size_dtype")
        context = b.number_input("Context (tokens)", 1, 10_000_000, 32_768, step=1024, key="size_context")
        batch = c.number_input("Sequences at once", 1, 100_000, 1, key="size_batch")
        gpu_gib = d.number_input("GPU memory (GiB)", 1, 10_000, 80, key="size_gpu_gib")
        with stop_on_error():
            sizes = [size, *deployment.known_sizes()]
            table = deployment.size_table(
                sizes, FORMATS, size_dtype, int(context), int(batch), float(gpu_gib)
            )
        exports.show_chart(params_chart(table), "size_params")
        shown, gib_columns = deployment.in_gib(table)  # in the unit of the GPU memory input
        st.dataframe(
            shown,
            hide_index=True,
            column_config={
                **{
                    name: st.column_config.NumberColumn(format="compact")
                    for name in ("total_params", "active_params")
                },
                **gib_columns,
            },
        )
        st.caption(
            "Parameters counted from each architecture's config on the meta device (no weights). The first "
            "row is the loaded model. GPUs needed: weights at the chosen format plus the KV cache of the "
            "chosen context and sequences (bf16), in 90% of each GPU's memory."
        )
        exports.table_downloads(table, "model_sizes")
        deployment.definitions("Model size", size.definition)
        sharing.reproduce(lambda: snippets.size_view(*sharing.model_and_options(source)), "the model size")
