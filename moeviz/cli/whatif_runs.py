"""The four `moeviz whatif` simulators run from parsed flags (moeviz.cli.whatif): the model loaded, the
routing gathered (a prompt, --trace or --store), the simulator run, and its screen (text) or payload (JSON)
returned for `run_whatif` to print.

--trace takes a trace written by `moeviz capture` or `moeviz import` (per-token routing; an import may lack
combination weights, and what needs them says so), and `ep` also a load table `moeviz import` wrote from an
engine's expert counts: placement and balancedness from the counts, with only the model's config read."""

from __future__ import annotations

import argparse
from typing import Any

from moeviz.cli.flags import load_kwargs, prompt_inputs
from moeviz.cli.output import frame_table, json_text, note_lines, number
from moeviz.errors import InputError

EP_COLUMNS = {  # layers_frame column -> the text table's shorter header
    "layer": "layer",
    "ep_balancedness": "ep_balancedness",
    "max_gpu_load": "max_load",
    "mean_gpu_load": "mean_load",
    "dispatch_bytes_local": "local",
    "dispatch_bytes_intra": "intra",
    "dispatch_bytes_inter": "inter",
    "dispatch_bytes_nodedup": "nodedup",
    "dispatch_bytes_node_dedup_rdma": "node_rdma",
    "combine_bytes": "combine",
    "a2a_time_s": "a2a_s",
    "compute_time_s": "compute_s",
    "comm_share": "comm_share",
}


def _load(args: argparse.Namespace, bar) -> Any:
    """The model, its bytes drawn in the bar's postfix."""
    from moeviz.models import load_model

    def loading(done: int, total: int) -> None:
        bar.set_postfix_str(f"loading model {done / 2**20:,.1f}/{total / 2**20:,.1f} MiB")

    bar.set_postfix_str("loading model")
    loaded = load_model(args.model, **load_kwargs(args), progress=loading)
    bar.update()
    return loaded


def _routes(args: argparse.Namespace, bar, loaded=None):
    """(routes, notes): the routing to replay, from the prompt (run through `loaded`), --trace or --store.
    A load table given to --trace is refused here (one line): these simulators replay each token."""
    from moeviz.whatif.routes import routes_from_store, routes_from_trace

    notes: list[str] = []
    if args.store is not None:
        bar.set_postfix_str("reading store")
        routes = routes_from_store(args.store, model=args.run_model, checkpoint=args.checkpoint)
        notes += routes.notes
    elif args.trace is not None:
        bar.set_postfix_str("reading trace")
        trace = _read_trace(args)
        routes = routes_from_trace(trace)
        notes += _import_notes(args, trace)
    else:
        from moeviz.cli.capture import capture_quietly

        inputs = prompt_inputs(args)
        bar.set_postfix_str("running forward" if not args.generate else f"generating {args.generate} tokens")
        trace = capture_quietly(loaded, generate=args.generate, **inputs)
        routes = routes_from_trace(trace)
    if args.trace is not None or args.store is not None:
        notes += _model_mismatch(routes, loaded)
    _warn_non_finite(args, routes)
    bar.update()
    return routes, notes


def _warn_non_finite(args: argparse.Namespace, routes) -> None:
    """Keep capture's warning on router scores that are not finite (in a trace file, a store run or a fresh
    capture alike) for `run_whatif` to print after the result: the replayed experts mean nothing there."""
    if routes.non_finite:
        from moeviz.capture.forward import non_finite_warning

        vars(args).setdefault("routing_warnings", []).append(non_finite_warning(routes.non_finite))


def _is_load_table(path) -> bool:
    from moeviz.trace.load import LOAD_FORMATS, read_moeviz_meta

    return read_moeviz_meta(path).get("format") in LOAD_FORMATS


def _refuse_load_table(args: argparse.Namespace) -> None:
    """A load table (counts, no tokens) given to a simulator that replays tokens: refused before the model
    loads."""
    if args.trace is not None and _is_load_table(args.trace):
        from moeviz.trace.load import read_moeviz_meta

        source = read_moeviz_meta(args.trace).get("source", "an engine")
        raise InputError(
            f"whatif {args.whatif} replays each token's experts; {args.trace} is a load table of expert "
            f"counts from {source} (no tokens): only `whatif ep` takes one (placement, balancedness)"
        )


def _read_trace(args: argparse.Namespace):
    """The Trace of --trace (a load table refused: `_refuse_load_table`)."""
    from moeviz.trace import read_routing_file

    _refuse_load_table(args)
    return read_routing_file(args.trace)


def _import_notes(args: argparse.Namespace, trace) -> list[str]:
    """Refuse what needs combination weights the routing lacks; note what its slot order changes."""
    notes = []
    weightless = [r for r in trace.layers if not r.has_weights]
    if weightless and args.whatif == "capacity" and args.policy == "probs":
        raise InputError(
            f"--policy probs keeps an over-full expert's largest combination weights; {args.trace} holds "
            f"none (routing from {weightless[0].decision_source}): use --policy position"
        )
    unranked = [r for r in trace.layers if not r.ranked]
    if unranked and getattr(args, "replica", None) == "vllm":
        notes.append(
            f"routing from {unranked[0].decision_source} lists a token's experts in ascending id, not the "
            "router's order: the vllm replica rule (copy by slot) follows that order"
        )
    return notes


def _model_mismatch(routes, loaded) -> list[str]:
    """Refuse routes whose layers route over other expert counts than --model's; note another model name."""
    if loaded is None:
        return []
    experts = {(site.layer, site.site): site.num_experts for site in loaded.sites}
    for layer in routes.layers:
        want = experts.get((layer.layer, layer.site))
        if want is not None and want != layer.num_experts:
            raise InputError(
                f"the routes' layer {layer.layer} has {layer.num_experts} experts, --model "
                f"{loaded.info.source} has {want}: give the model the routing was captured from"
            )
    if routes.model != loaded.info.source:
        return [f"routing captured from {routes.model}; sizes taken from --model {loaded.info.source}"]
    return []


def run_ep(args: argparse.Namespace, bar) -> str:
    from dataclasses import replace

    from moeviz.whatif.ep import EPConfig, fit_placement, simulate_ep
    from moeviz.whatif.model_size import expert_flops_per_token, model_size

    overrides = {
        name: getattr(args, name)
        for name in ("nvlink_gbps", "internode_gbps", "gpu_tflops")
        if getattr(args, name) is not None
    }
    config = EPConfig(  # checks the flags before the model loads; the model's sizes come after
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        redundant=args.redundant,
        placement=args.placement,
        source=args.source,
        replica=args.replica,
        message_dtype=args.message_dtype,
        **overrides,
    )
    if args.trace is not None and _is_load_table(args.trace):
        return _run_ep_load(args, config, bar)
    loaded = _load(args, bar)
    routes, notes = _routes(args, bar, loaded)
    size = model_size(loaded.model)
    config = replace(
        config,
        hidden_size=int(size.hidden_size),
        expert_flops_per_token=float(expert_flops_per_token(loaded)),
    )
    bar.set_postfix_str(f"placing experts ({args.placement})")
    if args.fit_fraction is not None:
        fit, evaluate, fitted = routes.split(args.fit_fraction, order=args.split)
        result = simulate_ep(evaluate, config, fit_placement(fit, config))
    else:
        fitted = "fitted and evaluated on the same tokens (in-sample; --fit-fraction evaluates out of sample)"
        result = simulate_ep(routes, config)
    if args.placement == "contiguous":
        fitted = "contiguous placement: nothing fitted"
    bar.update()
    payload = {**result.to_json(), "fit": fitted, "config": _config_json(config), "notes": notes}
    if args.format == "json":
        return json_text(payload)
    head = [
        f"{payload['model']}: {payload['tokens']} tokens, {len(routes.layers)} MoE layers; placement "
        f"{args.placement} over {args.gpus} GPUs ({args.gpus_per_node} per node), {args.redundant} redundant "
        f"slots; source {args.source}, replica {args.replica}, messages {args.message_dtype}",
        f"placement: {fitted}",
        f"definition: {result.definition}",
    ]
    frame = result.layers_frame().rename(columns=EP_COLUMNS)[list(EP_COLUMNS.values())]
    totals = {EP_COLUMNS.get(key, key): value for key, value in payload["totals"].items()}
    tail = [
        f"ep_balancedness_over_layers (Σ mean / Σ max, vLLM): {result.ep_balancedness_over_layers:.4f}",
        "total: "
        + ", ".join(
            f"{key} {number(v)}" for key, v in totals.items() if key != "ep_balancedness_over_layers"
        ),
        "bytes: local = to the token's own GPU (no link), intra/inter = de-duplicated per destination GPU "
        "(DeepEP), nodedup = one message per remote (token, expert), node_rdma = once per remote node",
    ]
    return _screen(head, frame, tail, notes)


# flag -> (its value, the value that needs no per-token routing): flags of the traffic and time model
LOAD_TABLE_FLAGS = {
    "--placement traffic": ("placement", "traffic"),
    "--replica vllm": ("replica", "vllm"),
    "--source round-robin": ("source", "round-robin"),
    "--message-dtype fp8": ("message_dtype", "fp8"),
}


def _run_ep_load(args: argparse.Namespace, config, bar) -> str:
    """`whatif ep --trace LOAD.parquet`: placement and ep_balancedness from an engine's expert counts; the
    model's config gives E and the router's groups (no weights are read)."""
    from moeviz.engines.layout import routing_layout
    from moeviz.trace import ExpertLoad
    from moeviz.whatif.ep import fit_placement_counts, simulate_ep_load, split_load_steps

    for flag, (name, value) in LOAD_TABLE_FLAGS.items():
        if getattr(args, name) == value:
            raise InputError(
                f"{flag} needs each token's set of experts; {args.trace} is a load table of expert counts: "
                "it gives placement (contiguous, eplb) and balancedness only"
            )
    for name in ("nvlink_gbps", "internode_gbps", "gpu_tflops"):
        if getattr(args, name) is not None:
            raise InputError(
                f"--{name.replace('_', '-')} sets the All-to-All time model, which needs each token's set of "
                f"experts; {args.trace} is a load table: it gives placement and balancedness only"
            )
    bar.set_postfix_str("reading the model's config")
    layout = routing_layout(args.model)
    bar.update()
    bar.set_postfix_str("reading load table")
    load = ExpertLoad.from_parquet(args.trace)
    if load.num_experts != layout.num_experts:
        raise InputError(
            f"the load table routes over {load.num_experts} experts, --model {layout.source} has "
            f"{layout.num_experts}: give the model the counts were taken from"
        )
    notes = []
    if load.model.source != layout.source:
        notes.append(
            f"counts from {load.model.source}; the router's groups taken from --model {layout.source}"
        )
    notes.append(
        "a load table has no tokens: All-to-All bytes and times (null) need each token's set of experts"
    )
    bar.update()
    bar.set_postfix_str(f"placing experts ({args.placement})")
    groups = layout.n_group or 1
    if args.fit_fraction is not None:
        fit, evaluate, fitted = split_load_steps(load, args.fit_fraction, order=args.split)
        placement = fit_placement_counts(
            fit.layer_counts(),
            list(fit.layers),
            config,
            groups=groups,
            fitted_on=f"{len(fit.steps)} steps of {load.model.source}",
        )
        result = simulate_ep_load(evaluate, config, placement, groups=groups)
    else:
        fitted = "fitted and evaluated on the same counts (in-sample; --fit-fraction evaluates out of sample)"
        result = simulate_ep_load(load, config, groups=groups)
    if args.placement == "contiguous":
        fitted = "contiguous placement: nothing fitted"
    bar.update()
    payload = {**result.to_json(), "fit": fitted, "source": load.source, "notes": notes}
    if args.format == "json":
        return json_text(payload)
    head = [
        f"{payload['model']}: {payload['tokens']} tokens, {len(load.layers)} MoE layers, expert counts from "
        f"{load.source} ({load.counts.shape[0]} steps); placement {args.placement} over {args.gpus} GPUs "
        f"({args.gpus_per_node} per node), {args.redundant} redundant slots",
        f"placement: {fitted}",
        f"definition: {result.definition}",
    ]
    columns = ["layer", "ep_balancedness", "max_gpu_load", "mean_gpu_load"]
    frame = result.layers_frame()[columns].rename(columns=EP_COLUMNS)
    tail = [f"ep_balancedness_over_layers (Σ mean / Σ max, vLLM): {result.ep_balancedness_over_layers:.4f}"]
    return _screen(head, frame, tail, notes)


def _config_json(config) -> dict[str, Any]:
    from dataclasses import asdict

    return {key: value for key, value in asdict(config).items() if isinstance(value, (int, float, str))}


def run_offload(args: argparse.Namespace, bar) -> str:
    import pandas as pd

    from moeviz.whatif.model_size import expert_bytes
    from moeviz.whatif.offload import POLICIES, simulate_offload

    _refuse_load_table(args)
    loaded = _load(args, bar)
    routes, notes = _routes(args, bar, loaded)
    nbytes = int(expert_bytes(loaded, None if args.expert_dtype == "loaded" else args.expert_dtype))
    policies = POLICIES if args.policy == "all" else (args.policy,)
    results = []
    for policy in policies:
        bar.set_postfix_str(f"simulating {policy}")
        results.append(
            simulate_offload(
                routes,
                args.cache,
                policy,
                expert_bytes=nbytes,
                bandwidth_gbps=args.bandwidth,
                step_time_s=args.step_time,
            )
        )
    prefetch = None
    if args.prefetch:
        from moeviz.whatif.prefetch import DEFINITION as PREFETCH
        from moeviz.whatif.prefetch import prefetch_recall

        bar.set_postfix_str("prefetch recall")
        inputs = prompt_inputs(args)
        one = {"text": inputs["texts"]} if "texts" in inputs else {"token_ids": inputs["token_ids"][0]}
        prefetch = prefetch_recall(loaded, **one)
    bar.update()
    definitions = list(dict.fromkeys(r.definition for r in results))
    first = results[0].to_json()
    payload = {
        **first,
        "definition": "; ".join(definitions),
        "layers": [row for r in results for row in r.to_json()["layers"]],
        "expert_bytes": nbytes,
        "expert_dtype": args.expert_dtype,
        "bandwidth_gbps": args.bandwidth,
        "notes": notes,
    }
    if prefetch is not None:
        payload["prefetch"] = prefetch.to_dict(orient="records")
        payload["prefetch_definition"] = PREFETCH
    if args.format == "json":
        return json_text(payload)
    frame = pd.concat([r.layers_frame() for r in results], ignore_index=True)
    head = [
        f"{payload['model']}: {payload['tokens']} tokens in {routes.sequences} sequence(s), "
        f"{len(routes.layers)} MoE layers; cache {args.cache} experts per layer, one expert "
        f"{nbytes:,} bytes ({args.expert_dtype}), {args.bandwidth:g} GB/s",
        *(f"definition: {d}" for d in definitions),
    ]
    tail = []
    for policy, rows in frame.groupby("policy", sort=False):
        hits, misses = int(rows.hits.sum()), int(rows.misses.sum())
        rate = hits / (hits + misses) if hits + misses else float("nan")
        tail.append(
            f"total {policy}: hit rate {rate:.4f}, {misses:,} misses, {int(rows.bytes.sum()):,} bytes, "
            f"stall {rows.stall_s.sum():.4g} s"
        )
    if prefetch is not None:
        tail.append(f"prefetch ({PREFETCH}), on the prompt's tokens:")
        tail += [
            f"  layer {row.from_layer} -> {row.layer}: recall {row.recall:.4f} over {row.tokens} tokens"
            for row in prefetch.itertuples()
        ]
    return _screen(head, frame, tail, notes)


def run_capacity(args: argparse.Namespace, bar) -> str:
    from moeviz.whatif.capacity import replay_capacity, smallest_cf

    _refuse_load_table(args)
    if args.trace is None and args.store is None:
        loaded = _load(args, bar)
    else:
        loaded = None
        bar.update()
    routes, notes = _routes(args, bar, loaded)
    bar.set_postfix_str("replaying capacity")
    result = replay_capacity(
        routes,
        args.cf,
        policy=args.policy,
        buckets=args.buckets,
        exact=args.exact,
        group_tokens=args.group_tokens,
    )
    search = None
    if args.max_drop is not None:
        search = smallest_cf(routes, args.max_drop / 100, group_tokens=args.group_tokens, exact=args.exact)
    bar.update()
    payload = {**result.to_json(), "notes": notes}
    if search is not None:
        payload["smallest_cf"] = {"max_drop": search.max_drop, "cf": search.cf, "readout": search.readout}
    if args.format == "json":
        return json_text(payload)
    cfs = ", ".join(f"{c:g}" for c in args.cf)
    head = [
        f"{payload['model']}: {payload['tokens']} tokens in {routes.sequences} sequence(s) ("
        + (
            "one dispatch group each"
            if args.group_tokens is None
            else f"groups of {args.group_tokens} tokens"
        )
        + f"), {len(routes.layers)} MoE layers; policy {args.policy}, CF {cfs}",
        f"definition: {result.definition}",
    ]
    frame, positions = result.layers_frame(), result.position_frame()
    tail = []
    for cf, rows in frame.groupby("cf", sort=True):
        assigned, dropped = int(rows.assigned.sum()), int(rows.dropped.sum())
        share = dropped / assigned if assigned else float("nan")
        curve = positions[positions.cf == cf].sort_values("bucket")
        tail.append(
            f"total CF {cf:g}: {dropped:,} of {assigned:,} assignments dropped ({share:.4f}), "
            f"{int(rows.tokens_all_dropped.sum()):,} token-layers lost every slot; drop rate by position "
            "bucket (start -> end of a sequence): " + " ".join(f"{v:.3f}" for v in curve.drop_rate)
        )
    if search is not None:
        tail.append(search.readout)
    return _screen(head, frame, tail, notes)


def run_quant(args: argparse.Namespace, bar) -> str:
    from moeviz.whatif.quant import quantisation_flips

    inputs = prompt_inputs(args)
    loaded = _load(args, bar)
    bar.set_postfix_str(f"routing with {args.dtype} {args.target}")
    kwargs = {"text": inputs["texts"]} if "texts" in inputs else {"token_ids": inputs["token_ids"][0]}

    def progress(fraction: float, message: str) -> None:
        bar.set_postfix_str(f"{message} ({fraction:.0%})")

    result = quantisation_flips(loaded, **kwargs, dtype=args.dtype, target=args.target, progress=progress)
    bar.update(2)
    payload = result.to_json()
    if args.format == "json":
        return json_text(payload)
    frame = result.layers_frame()
    head = [
        f"{payload['model']}: {payload['tokens']} tokens, {frame.layer.nunique()} MoE layers; "
        f"{args.dtype} on the {args.target} weights",
        f"definition: {result.definition}",
    ]
    tail = [
        f"mean flip rate over layers: {frame.flip_rate.mean():.4f}",
        f"Δ mean log-prob of the next token (quantised − original): {result.delta_logprob:+.4f}",
    ]
    margins = result.margin_frame()
    if len(margins):
        by_quartile = (
            margins.assign(flips=margins.flip_rate * margins.tokens)
            .groupby("quartile")[["flips", "tokens"]]
            .sum()
        )
        tail.append(
            "flip rate by router-margin quartile (1 = lowest margin): "
            + ", ".join(f"Q{q} {row.flips / max(row.tokens, 1):.4f}" for q, row in by_quartile.iterrows())
        )
    sizes = result.bytes_frame()
    tail.append("model bytes: " + ", ".join(f"{row.format} {row.bytes:,}" for row in sizes.itertuples()))
    return _screen(head, frame, tail, [])


def _screen(head: list[str], frame: Any, tail: list[str], notes: list[str]) -> str:
    """The header lines, the per-layer table, the totals and any notes, as one screen of text."""
    return "\n".join([*head, *frame_table(frame), *tail, *note_lines(notes)])


SIMULATORS = {"ep": run_ep, "offload": run_offload, "capacity": run_capacity, "quant": run_quant}
