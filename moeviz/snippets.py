"""The Python that reproduces each app view: pure functions that return a runnable code string (load, capture,
the analysis function, the chart) built from a view's current choices. The app shows them under "Reproduce in
Python"; nothing here runs a model.

Every snippet starts from a `SnippetInput` (the model and its load options, and what it routes: a prompt,
the evaluation corpus or a routing file) and ends with named results, listed in each function's docstring,
that equal what the view shows: e.g. `load_view` defines `experts`, `balance`, `verdicts`, `chart`.

    >>> code = routing_view(SnippetInput("sample:mixtral-healthy", text="hi"), layer=1, site="mlp")
    >>> exec(code, {})  # defines trace, scores, heatmap, load, load_chart
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from moeviz.errors import SnippetError

CORPUS = "corpus"  # what a SnippetInput routes: the model on its text, the evaluation corpus, a routing file
TEXT, FILE = "text", "file"


@dataclasses.dataclass(frozen=True)
class SnippetInput:
    """What a view routes. `model`: the model source (`sample:NAME` or a folder); `load_kwargs`: the options
    passed to `moeviz.load_model` besides the source (dtype, device, …; empty for the defaults); `text`: the
    prompt; `corpus`: the evaluation corpus instead; `file`: a routing file's path instead (a capture or an
    engine import, read with `read_routing_file`)."""

    model: str
    text: str | None = None
    corpus: bool = False
    file: str | None = None
    load_kwargs: Mapping[str, object] = dataclasses.field(default_factory=dict)

    @property
    def kind(self) -> str:
        return FILE if self.file is not None else CORPUS if self.corpus else TEXT


@dataclasses.dataclass
class _Program:
    """Imports (deduplicated, sorted) and body lines of one snippet."""

    imports: list[str] = dataclasses.field(default_factory=list)
    lines: list[str] = dataclasses.field(default_factory=list)

    def need(self, *imports: str) -> _Program:
        self.imports.extend(imports)
        return self

    def add(self, *lines: str) -> _Program:
        self.lines.extend(lines)
        return self

    def text(self) -> str:
        imports = sorted(dict.fromkeys(self.imports), key=lambda line: (line.startswith("from"), line))
        return "\n".join([*imports, "", *self.lines]) + "\n"


def _call(function: str, *args: str, **kwargs: object) -> str:
    """`function(arg, …, name=repr(value), …)`: positional `args` are code, keyword values literals."""
    parts = [*args, *(f"{name}={value!r}" for name, value in kwargs.items())]
    return f"{function}({', '.join(parts)})"


def _load(program: _Program, model: str, load_kwargs: Mapping[str, object], name: str = "loaded") -> None:
    program.need("import moeviz").add(f"{name} = {_call('moeviz.load_model', repr(model), **load_kwargs)}")


def _routing(program: _Program, source: SnippetInput, name: str = "trace", attention: bool = False) -> None:
    """Lines that define `loaded` (unless a file) and `name`, the routing the view reads."""
    if source.kind == FILE:
        program.need("from moeviz.trace import read_routing_file")
        program.add(f"{name} = read_routing_file({source.file!r})")
        return
    _load(program, source.model, source.load_kwargs)
    if source.kind == CORPUS:  # as the app routes it: each domain's windows, one capture per domain
        program.need("from moeviz.samples import DOMAINS, eval_batch")
        program.add(
            "batch = eval_batch(loaded)",
            f"{name} = moeviz.Trace.concat(",
            "    [",
            "        moeviz.capture(",
            "            loaded,",
            "            token_ids=[ids for ids, d in zip(batch.token_ids, batch.domains) if d == domain],",
            "        )",
            "        for domain in DOMAINS",
            "    ]",
            ")",
        )
        return
    extra = ", attention=True" if attention else ""
    program.add(f"{name} = moeviz.capture(loaded, {source.text!r}{extra})")


def _needs_model(source: SnippetInput, view: str) -> None:
    if source.kind != TEXT:
        raise SnippetError(f"the {view} view runs the model on a prompt: give the snippet a text")


# ---- Explore ---------------------------------------------------------------------------------------------
def routing_view(
    source: SnippetInput,
    layer: int,
    site: str,
    token: tuple[int, int] | None = None,
    experts: Sequence[int] | None = None,
    max_tokens: int = 200,
    start: int = 0,
) -> str:
    """The Routing page at MoE layer (`site`, `layer`): `scores` (the layer's score rows of `experts`, all
    when None) and their `heatmap`, the layer's `load` (`expert_balance_frame` rows) and `load_chart`; with
    `token` (seq, pos) its `confidence` rows (margins, entropy per layer)."""
    program = _Program().need(
        "from moeviz.analysis import expert_balance_frame, layer_scores_frame, layer_trace",
        "from moeviz.charts import expert_load_chart, router_score_heatmap",
    )
    _routing(program, source)
    chosen = "" if experts is None else f", experts={[int(e) for e in experts]!r}"
    program.add(
        f"scores = layer_scores_frame(trace, {layer!r}, {site!r}{chosen})",
        _call("heatmap = router_score_heatmap", "scores", max_tokens=max_tokens, start=start)
        + "  # the page windows the tokens",
        f"load = expert_balance_frame(layer_trace(trace, {layer!r}, {site!r}))",
        f"load_chart = expert_load_chart(load, title={f'Expert load, layer {layer}'!r})",
    )
    if token is not None:
        program.need("from moeviz.analysis import token_confidence_frame")
        program.add(f"confidence = token_confidence_frame(trace, {int(token[0])!r}, {int(token[1])!r})")
    return program.text()


def load_view(source: SnippetInput, indicator: str = "load_entropy", load_table: bool = False) -> str:
    """The Load & collapse page: `experts` (per layer and expert), `balance` (per layer), `report` and its
    `verdicts` frame, the `chart` of one balance `indicator`, and (a trace with router scores) the balancing
    `losses`. `load_table`: the file holds expert counts (an `ExpertLoad`), judged from the counts alone."""
    program = _Program().need(
        "from moeviz.analysis import CollapseThresholds, collapse_frame",
        "from moeviz.charts import balance_chart",
    )
    _routing(program, source, name="load" if load_table else "trace")
    if load_table:
        program.need(
            "from moeviz.analysis.balance import load_balance_frame, load_expert_balance_frame",
            "from moeviz.analysis.collapse import load_collapse_report",
            "from moeviz.report import STEPS_ARE_SEQUENCES",
        )
        program.add(
            "experts = load_expert_balance_frame(load)",
            "balance = load_balance_frame(load)",
            "report = load_collapse_report(",
            "    load, CollapseThresholds(), steps_are_sequences=load.source in STEPS_ARE_SEQUENCES",
            ")",
        )
    else:
        program.need(
            "from moeviz.analysis import aux_loss_frame, balance_frame, collapse_report",
            "from moeviz.analysis import expert_balance_frame, loss_frame",
        )
        program.add(
            "experts = expert_balance_frame(trace)",
            "balance = balance_frame(trace)",
            "report = collapse_report(trace, CollapseThresholds())",
            "losses = aux_loss_frame(loss_frame(trace))  # needs router scores (not in engine imports)",
        )
    program.add(
        "verdicts = collapse_frame(report)",
        f"chart = balance_chart(balance, {indicator!r})",
        "print(report.verdict.name)",
    )
    return program.text()


def structure_view(
    source: SnippetInput,
    layer: int,
    site: str,
    *,
    adjacent_only: bool = False,
    top1: bool = False,
    path_layers: int | None = None,
    at_scale: bool = False,
) -> str:
    """The Structure page at MoE layer (`site`, `layer`): `coactivation` (the layer's CoAct rows) and its
    `chart`, `transitions` (every pair of consecutive layers; `at_scale`: this layer → the next one), the
    top-1 `paths` over `path_layers` consecutive layers from this one (None: no paths) and `repetition`."""
    program = _Program().need(
        "from moeviz.analysis import layer_coactivation_frame, repetition_frame",
        "from moeviz.charts import coactivation_heatmap",
    )
    _routing(program, source)
    program.add(
        f"coactivation = layer_coactivation_frame(trace, {layer!r}, {site!r}, "
        f"adjacent_only={adjacent_only!r})",
        f"chart = coactivation_heatmap(coactivation, title={f'Co-activation, layer {layer}'!r})",
    )
    if at_scale:
        program.need("from moeviz.analysis import next_layer_transition_frame")
        program.add(f"transitions = next_layer_transition_frame(trace, {layer!r}, {site!r}, top1={top1!r})")
    else:
        program.need("from moeviz.analysis import transition_frame")
        program.add(f"transitions = transition_frame(trace, top1={top1!r})")
    if path_layers is not None:
        program.need(
            "from moeviz.analysis import path_frame",
            "from moeviz.analysis.structure import path_layer_ids, path_window",
        )
        program.add(
            f"window = path_window(path_layer_ids(trace, {site!r}), {layer!r}, {int(path_layers)!r})",
            f"paths = path_frame(trace, top_n=15, layers=window, site={site!r})",
        )
    program.add("repetition = repetition_frame(trace)")
    return program.text()


def attention_view(
    source: SnippetInput,
    layer: int,
    head: int,
    *,
    window: int,
    rows: range,
    cols: range,
    scale: str,
    keep_last: int,
    keep_first: int,
    seq: int = 0,
) -> str:
    """The Attention page: `heads` (every head's summary with local window `window`), one head's map over
    `rows` × `cols` of sequence `seq` (`cells`, `chart` on the colour `scale`), and the KV-cache what-if
    keeping the last `keep_last` keys plus the first `keep_first` (`whatif`)."""
    _needs_model(source, "attention")
    program = _Program().need("from moeviz.charts import attention_block_frame, attention_map_chart")
    program.need("from moeviz.whatif.kv_cache import kv_cache_whatif")
    _routing(program, source, attention=True)
    program.add(
        "att = trace.attention  # queries and keys captured; maps computed on demand",
        f"heads = att.head_summary({int(window)!r})",
        f"rows, cols = range({rows.start}, {rows.stop}), range({cols.start}, {cols.stop})",
        f"block = att.block({layer!r}, {head!r}, {seq!r}, rows=list(rows), cols=list(cols))",
        f"tokens = trace.tokens[trace.tokens['seq'] == {seq!r}]",
        "cells = attention_block_frame(block, rows, cols, tokens)",
        f"chart = attention_map_chart(cells, title={f'Layer {layer}, head {head}'!r}, scale={scale!r})",
        f"whatif = kv_cache_whatif(att, {int(keep_last)!r}, {int(keep_first)!r})",
    )
    return program.text()


INTERVENTIONS = {  # the Why page's what-ifs → the intervention that runs them ({…} filled from the choices)
    "disable_token": "DisableExpert(expert={expert}, layer={layer}, positions={pos}, site={site!r})",
    "disable_layer": "DisableExpert(expert={expert}, layer={layer}, site={site!r})",
    "disable_everywhere": "DisableExpert(expert={expert})",
    "force": "ForceExpert(expert={expert}, layer={layer}, positions={pos}, site={site!r})",
    "next_best": "NextBest(layer={layer}, positions={pos}, site={site!r})",
}


def why_view(
    source: SnippetInput,
    pos: int,
    layer: int,
    site: str,
    expert: int,
    *,
    target: str = "score",
    baseline: str = "pad",
    steps: int = 32,
    intervention: str = "disable_token",
) -> str:
    """The Why page for token `pos` of the prompt at MoE layer (`site`, `layer`) and `expert`: the
    attribution (`attribution`, its `frame`) and the what-if `intervention` (a key of INTERVENTIONS:
    `whatif`, its `positions` frame)."""
    _needs_model(source, "Why")
    if intervention not in INTERVENTIONS:
        raise SnippetError(f"unknown intervention {intervention!r}: one of {', '.join(INTERVENTIONS)}")
    program = _Program().need(
        "from moeviz.attribution import router_attribution",
        "from moeviz.interventions import DisableExpert, ForceExpert, NextBest, counterfactual",
    )
    _routing(program, source)
    spec = INTERVENTIONS[intervention].format(expert=expert, layer=layer, pos=pos, site=site)
    program.add(
        "ids = [int(i) for i in trace.tokens[trace.tokens['seq'] == 0]['token_id']]",
        "attribution = router_attribution(",
        f"    loaded, token_ids=ids, position={pos!r}, layer={layer!r}, site={site!r}, expert={expert!r},",
        f"    target={target!r}, baseline={baseline!r}, n_steps={steps!r},",
        ")",
        "frame = attribution.frame()  # IG and feature ablation per token",
        f"whatif = counterfactual(loaded, token_ids=ids, interventions=[{spec}])",
        "positions = whatif.position_frame()  # Δ log p(next token) per position",
    )
    return program.text()


def compare_view(model_a: str, model_b: str, text: str) -> str:
    """The Compare page on `text`: `agreement` (per layer) and `drift` (the load shift A → B), with the
    `chart` of the agreement."""
    program = _Program().need(
        "from moeviz.analysis import expert_drift_frame, routing_agreement_frame",
        "from moeviz.charts import agreement_chart",
    )
    _routing(program, SnippetInput(model_a, text=text), name="trace_a")
    program.add(f"trace_b = moeviz.capture(moeviz.load_model({model_b!r}), {text!r})")
    program.add(
        "agreement = routing_agreement_frame(trace_a, trace_b)",
        "drift = expert_drift_frame(trace_a, trace_b)",
        "chart = agreement_chart(agreement)",
    )
    return program.text()


def finetune_view(base: SnippetInput, tuned: SnippetInput, domains: bool = False) -> str:
    """The Compare page's "What the fine-tune did": `diff` (`finetune_diff` of the base's and the fine-tune's
    routing of `base.text`, with both routers' weights); with `domains`, `by_domain`, the same on the
    evaluation corpus with each sequence's domain (`by_domain.domain_shift`, `by_domain.specialisation`)."""
    _needs_model(base, "fine-tune")
    program = _Program().need("from moeviz.analysis.finetune_diff import finetune_diff, router_weights")
    _load(program, base.model, base.load_kwargs, name="base")
    _load(program, tuned.model, tuned.load_kwargs, name="tuned")
    program.add(
        f"trace_base = moeviz.capture(base, {base.text!r})",
        f"trace_tuned = moeviz.capture(tuned, {base.text!r})",
        "weights = {'base_weights': router_weights(base), 'tuned_weights': router_weights(tuned)}",
        "diff = finetune_diff(trace_base, trace_tuned, **weights)",
    )
    if domains:  # as the app routes the corpus: each domain's windows, one capture per domain
        program.need("from moeviz.samples import DOMAINS, eval_batch")
        program.add(
            "batch = eval_batch(base)",
            "pairs = list(zip(batch.token_ids, batch.domains))",
            "corpus = [[ids for ids, d in pairs if d == domain] for domain in DOMAINS]",
            "by_domain = finetune_diff(",
            "    moeviz.Trace.concat([moeviz.capture(base, token_ids=ids) for ids in corpus]),",
            "    moeviz.Trace.concat([moeviz.capture(tuned, token_ids=ids) for ids in corpus]),",
            "    seq_domains=batch.domains,",
            "    **weights,",
            ")",
        )
    return program.text()


def corpus_view(
    store: str,
    model: str,
    checkpoint: str,
    domains: Sequence[str] = (),
    layers: Sequence[int] = (),
    indicator: str = "load_entropy",
) -> str:
    """The Corpus page on a store run: `load`, `balance` (and its `chart` of `indicator`), `verdicts` and
    the domain specialisation `spec`, of the chosen `domains` and `layers` (empty: all)."""
    program = _Program().need(
        "from moeviz.charts import balance_chart", "from moeviz.store import StoreQuery"
    )
    program.add(
        "query = StoreQuery(",
        f"    {store!r}, model={model!r}, checkpoint={checkpoint!r},",
        f"    domain={list(domains) or None!r}, layer={[int(x) for x in layers] or None!r},",
        ")",
        "load = query.expert_balance()",
        "balance = query.balance()",
        f"chart = balance_chart(balance, {indicator!r})",
        "verdicts = query.collapse()",
        "spec = query.domain_specialisation()",
    )
    return program.text()


def engines_view(a: SnippetInput, b: SnippetInput) -> str:
    """The Engines page: the two routings (`trace_a`, `trace_b`: a capture at its load options, or a routing
    file) and their `diff` (`diff.layers`: mismatch per layer)."""
    program = _Program().need("from moeviz.analysis.engine_diff import engine_diff")
    for side, source in (("a", a), ("b", b)):
        if source.kind == FILE:
            _routing(program, source, name=f"trace_{side}")
        else:
            _needs_model(source, "Engines")
            _load(program, source.model, source.load_kwargs, name=f"loaded_{side}")
            program.add(f"trace_{side} = moeviz.capture(loaded_{side}, {source.text!r})")
    program.add("diff = engine_diff(trace_a, trace_b)", "print(diff.mismatched, 'of', diff.pairs, 'differ')")
    return program.text()


def checkpoints_view(
    series: str,
    windows: int,
    window_tokens: int,
    kind: str = "topk",
    indicator: str = "load_entropy",
    base: str | None = None,
) -> str:
    """The Checkpoints page: every checkpoint of `series` traced on the first `windows` × `window_tokens`
    tokens of each evaluation slice into a fresh store, then the `timeline` and its `saturation` `chart`
    (`kind`: topk or top1) and balance chart of `indicator`. `base`: the base model of a series of adapters
    (each adapter loaded over it)."""
    program = _Program().need(
        "import tempfile",
        "from pathlib import Path",
        "import moeviz",
        "from moeviz.charts.checkpoints import balance_timeline_chart, saturation_timeline_chart",
        "from moeviz.samples import write_eval_prefix",
        "from moeviz.store import TraceSettings, write_corpus",
        "from moeviz.store.checkpoints import checkpoint_timeline, plan_series",
    )
    program.add(
        f"series = plan_series({series!r}, base={base!r})",
        "name, checkpoints = series.name, series.checkpoints",
        "corpus = write_eval_prefix(",
        "    moeviz.load_model(checkpoints[0][1]),",
        "    Path(tempfile.mkdtemp()),",
        f"    {int(windows) * int(window_tokens)!r},",
        ")",
        "store = tempfile.mkdtemp()",
        f"settings = TraceSettings(batch_size={int(windows)!r}, chunk_tokens={int(window_tokens)!r})",
        "for index, (label, folder) in enumerate(checkpoints):",
        "    write_corpus(",
        "        moeviz.load_model(**series.load_args(folder)), corpus, store, model=name, checkpoint=label,",
        "        checkpoint_index=index, settings=settings, progress=False,",
        "    )",
        "timeline = checkpoint_timeline(store, model=name)",
        f"chart = saturation_timeline_chart(timeline.saturation, {kind!r})",
        f"balance = balance_timeline_chart(timeline.collapse, {indicator!r}, timeline.crossings)",
    )
    return program.text()


# ---- Deploy ----------------------------------------------------------------------------------------------
def _routes(program: _Program, source: SnippetInput) -> None:
    """Lines that define `routes`, the routing the simulators replay."""
    program.need("from moeviz.whatif.routes import routes_from_trace")
    _routing(program, source)
    program.add("routes = routes_from_trace(trace)")


def ep_view(
    source: SnippetInput, config: Mapping[str, object], fit_on_part: bool = False, split: str = ""
) -> str:
    """The expert-parallel what-if with the EPConfig fields `config`: `before` (contiguous, no copies) and
    `after` (the chosen placement), fitted on the same routing or (`fit_on_part`) on half of it (`split`'s
    order, seed 0) and judged on the rest; `totals` of `after`."""
    program = _Program().need("import dataclasses", "from moeviz.whatif.ep import EPConfig, simulate_ep")
    _routes(program, source)
    fields = ", ".join(f"{name}={value!r}" for name, value in config.items())
    program.add(
        f"config = EPConfig({fields})",
        "plain = dataclasses.replace(config, placement='contiguous', redundant=0)",
    )
    if fit_on_part:
        program.need("from moeviz.whatif.ep import fit_placement")
        program.add(
            f"fit, rest, how = routes.split(0.5, order={split or 'shuffled'!r})",
            "before = simulate_ep(rest, plain)",
            "after = simulate_ep(rest, config, fit_placement(fit, config))",
        )
    else:
        program.add("before, after = simulate_ep(routes, plain), simulate_ep(routes, config)")
    program.add("totals = after.totals()")
    return program.text()


def offload_view(
    source: SnippetInput, cache: int, policies: Iterable[str], weight_dtype: str, bandwidth_gbps: float
) -> str:
    """The offloading what-if: one expert's bytes at `weight_dtype` (`size`), `results` {policy:
    OffloadResult} at `cache` experts per layer over `bandwidth_gbps`."""
    program = _Program().need(
        "from moeviz.whatif.model_size import expert_bytes",
        "from moeviz.whatif.offload import simulate_offload",
    )
    _routes(program, source)
    if source.kind == FILE:
        _load(program, source.model, source.load_kwargs)  # the sizes are the model's
    program.add(
        f"size = expert_bytes(loaded, {weight_dtype!r})",
        "results = {",
        f"    policy: simulate_offload(routes, {int(cache)!r}, policy, expert_bytes=size, "
        f"bandwidth_gbps={float(bandwidth_gbps)!r})",
        f"    for policy in {list(policies)!r}",
        "}",
    )
    return program.text()


def capacity_view(
    source: SnippetInput,
    cfs: Sequence[float],
    policy: str,
    exact: bool,
    group_tokens: int | None = None,
    max_drop: float | None = None,
) -> str:
    """The capacity what-if: the replay at the capacity factors `cfs` (`capacity`, its `layers`) and, with
    `max_drop` (a share), the smallest CF that drops less (`search`)."""
    program = _Program().need("from moeviz.whatif.capacity import replay_capacity")
    _routes(program, source)
    program.add(
        _call(
            "capacity = replay_capacity",
            "routes",
            cfs=[float(cf) for cf in cfs],
            policy=policy,
            exact=bool(exact),
            group_tokens=group_tokens,
        ),
        "layers = capacity.layers_frame()  # dropped share per layer and CF",
    )
    if max_drop is not None:
        program.need("from moeviz.whatif.capacity import smallest_cf")
        program.add(
            _call(
                "search = smallest_cf",
                "routes",
                repr(float(max_drop)),
                group_tokens=group_tokens,
                exact=exact,
            )
        )
    return program.text()


def quantisation_view(source: SnippetInput, dtype: str, target: str) -> str:
    """The quantisation what-if: the routing flips (`result`, its `flips` per layer) with weights at `dtype`
    on `target`, run on the prompt or the evaluation corpus's sequences (a routing file: the prompt)."""
    program = _Program().need("from moeviz.whatif.quant import quantisation_flips")
    if source.kind == CORPUS:
        program.need("from moeviz.whatif.routes import sequence_token_ids")
        _routing(program, source)
        program.add("ids = sequence_token_ids(trace)  # the corpus's sequences")
        program.add(f"result = quantisation_flips(loaded, token_ids=ids, dtype={dtype!r}, target={target!r})")
    else:
        if source.text is None:
            raise SnippetError("quantisation runs the model on text: give the snippet the prompt")
        _load(program, source.model, source.load_kwargs)
        program.add(
            f"result = quantisation_flips(loaded, text={source.text!r}, dtype={dtype!r}, target={target!r})"
        )
    program.add("flips = result.layers_frame()")
    return program.text()


def size_view(model: str, load_kwargs: Mapping[str, object] | None = None) -> str:
    """The model-size tab: the loaded model's `size` (`ModelSize`: parameters, bytes, active per token)."""
    program = _Program().need("from moeviz.whatif.model_size import model_size")
    _load(program, model, load_kwargs or {})
    program.add(f"size = model_size(loaded.model, name={model!r})")
    return program.text()


# ---- Teach -----------------------------------------------------------------------------------------------
LEARN_STEPS = (
    "router",
    "top_k",
    "load",
    "aux",
    "collapse",
    "bias",
    "shared",
    "finetune",
    "deployment",
    "sweep",
)


def learn_view(
    step: str,
    text: str,
    model: str,
    layer: int | None = None,
    k: int | None = None,
    token: tuple[int, int] | None = None,
    models: Mapping[str, str] | None = None,
) -> str:
    """A Learn step on the lesson's `text` through `model`: `step` one of LEARN_STEPS; `layer` the step's
    MoE layer (site "mlp" is looked up from the trace), `k` the top-k of step top_k, `token` (seq, pos) of
    step router, `models` {name: source} of step collapse. Each ends with the step's numbers (`walk`,
    `stats`, `terms`, `loads`, `changed`, `fraction`, `params`)."""
    if step not in LEARN_STEPS:
        raise SnippetError(f"unknown Learn step {step!r}: one of {', '.join(LEARN_STEPS)}")
    program = _Program()
    if step == "sweep":
        program.need("import pandas as pd")
        program.add("sweep = pd.read_csv('docs/experts-sweep.csv')  # held-out loss by experts and k")
        return program.text()
    if step == "finetune":  # a shipped run (scripts/samples/finetune_modes.py), read where the app reads it
        program.need("import pandas as pd", "from moeviz.models.loading import sample_models_dir")
        program.add(
            "folder = sample_models_dir() / 'finetune-modes'",
            "curves = pd.read_parquet(folder / 'curves.parquet')  # per mode and step: losses, mismatch",
            "summary = pd.read_parquet(folder / 'summary.parquet')  # per mode: adapted? forgot? balanced?",
            "layers = pd.read_parquet(folder / 'layers.parquet')  # per mode and MoE layer, at the end",
        )
        return program.text()
    if step == "collapse":
        program.need("import moeviz", "from moeviz.analysis import balance_stats")
        program.add(f"sources = {dict(models or {})!r}", "stats = {}")
        program.add(
            "for name, source in sources.items():",
            f"    trace = moeviz.capture(moeviz.load_model(source), {text!r})",
            f"    site = next(s for s, l in trace.layer_keys if l == {layer!r})",
            f"    stats[name] = balance_stats(trace.layer({layer!r}, site))",
            "print({name: round(s.load_entropy, 3) for name, s in stats.items()})",
        )
        return program.text()
    _routing(program, SnippetInput(model, text=text))
    where = (
        "trace.layer_keys[0]" if layer is None else f"next(k for k in trace.layer_keys if k[1] == {layer!r})"
    )
    program.add(f"site, layer = {where}", "routing = trace.layer(layer, site)")
    if step == "router":
        seq, pos = token or (0, 0)
        program.need("from moeviz.analysis.lesson import router_walkthrough")
        program.add(
            "tokens = trace.tokens",
            f"wanted = tokens.index[(tokens['seq'] == {seq!r}) & (tokens['pos'] == {pos!r})][0]",
            "row = list(routing.token_rows).index(wanted)",
            "walk = router_walkthrough(routing, row)  # logits → p → top-k → renormalised weights",
        )
    elif step == "top_k":
        program.need(
            "from moeviz.analysis import balance_stats",
            "from moeviz.analysis.reroute import RerouteSettings, reroute",
        )
        program.add(
            f"rerouted = reroute(routing, RerouteSettings(k={int(k or 2)!r}, score_fn=routing.score_fn))",
            "stats = balance_stats(rerouted.as_layer_routing())",
        )
    elif step == "load":
        program.need("from moeviz.analysis import balance_stats, expert_balance_frame, layer_trace")
        program.add(
            "load = expert_balance_frame(layer_trace(trace, layer, site))",
            "stats = balance_stats(routing)",
        )
    elif step == "aux":
        program.need("from moeviz.analysis.reroute import aux_terms")
        program.add("terms = aux_terms(routing)", "loss = float(terms['term'].sum())  # E · Σ f_e · P_e")
    elif step == "bias":
        program.need("from moeviz.analysis.lesson import bias_effect")
        program.add(
            "without, with_bias, no_bias = bias_effect(routing)  # the same router with the bias set to 0",
            "changed = without.changed_tokens",
        )
    elif step in ("shared", "deployment"):
        program.need("from moeviz.analysis.lesson import expert_parameters, shared_fraction")
        program.need("from moeviz.architecture import parameter_summary")
        program.add(
            "params = expert_parameters(loaded.model, layer)",
            "fraction = shared_fraction(params, routing.k, routing.num_experts)",
            "summary = parameter_summary(loaded.model, experts=routing.num_experts, top_k=routing.k)",
        )
    return program.text()
