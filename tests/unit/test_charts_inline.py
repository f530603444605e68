"""Every public chart function of `moeviz.charts` displays inline in a notebook, without Streamlit: its
chart's `_repr_mimebundle_()` (what Jupyter, JupyterLab and VS Code call to show a cell's value) holds the
chart's own Vega-Lite spec, under Altair's default renderer and data transformer, and the spec renders
with Vega.

The inputs come from the analysis functions and what-if simulators on synthetic routing (no model); the
results only a model run makes (attention, attribution, quantisation, prefetch, training runs, checkpoint
timelines) are frames with those results' columns. A chart function added without a case here fails
`test_every_chart_function_has_a_case`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import re
import subprocess
import sys
from collections.abc import Callable

import altair as alt
import numpy as np
import pandas as pd
import pytest

import moeviz.charts
from moeviz.charts import attention as attention_charts
from moeviz.charts import checkpoints as checkpoint_charts
from moeviz.charts import compare as compare_charts
from moeviz.charts import deployment as deployment_charts
from moeviz.charts import finetune as finetune_charts
from moeviz.charts import finetune_lesson as finetune_lesson_charts
from moeviz.charts import lab as lab_charts
from moeviz.charts import learn as learn_charts
from moeviz.charts.attribution import attribution_strip_chart, importance_chart, position_delta_chart
from moeviz.charts.raster import ColourRamp, raster_heatmap
from moeviz.testing.scale_traces import synthetic_trace
from moeviz.trace import Trace

CHART_TYPES = ("alt.Chart", "alt.LayerChart", "alt.FacetChart", "alt.HConcatChart", "alt.VConcatChart")


def chart_functions() -> dict[str, Callable]:
    """module.function → every public function of moeviz.charts' modules annotated to return a chart."""
    found = {}
    for info in pkgutil.iter_modules(moeviz.charts.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"moeviz.charts.{info.name}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ == module.__name__ and not name.startswith("_"):
                returns = str(inspect.signature(fn).return_annotation)
                if any(part.strip() in CHART_TYPES for part in returns.split("|")):
                    found[f"{info.name}.{name}"] = fn
    return found


# ---- the inputs ------------------------------------------------------------------------------------------
def small_trace(seed: int = 0) -> Trace:
    """Two sequences of 48 tokens, three MoE layers of 16 experts (4 groups, top-4, sigmoid, a bias)."""
    trace = synthetic_trace(
        num_experts=16, k=4, n_group=4, topk_group=2, num_blocks=4, first_dense=1, num_tokens=96, seed=seed
    )
    tokens = trace.tokens.copy()
    tokens["seq"] = np.arange(len(tokens)) // 48
    tokens["pos"] = np.arange(len(tokens)) % 48
    trace.tokens = tokens
    return trace


class Inputs:
    """The frames every case reads, built once per module (`inputs` fixture)."""

    def __init__(self) -> None:
        from moeviz import analysis
        from moeviz.analysis import scale_frames
        from moeviz.analysis.engine_diff import engine_diff
        from moeviz.analysis.finetune_diff import finetune_diff
        from moeviz.architecture import bias_frame
        from moeviz.whatif import (
            EPConfig,
            hit_rate_curve,
            replay_capacity,
            routes_from_trace,
            simulate_ep,
            simulate_offload,
        )

        self.trace = trace = small_trace(0)
        other = small_trace(1)
        other.tokens = trace.tokens  # the same tokens, routed by another router
        self.routing = trace.routing_frame()
        self.first = trace.layers[0]
        self.layer, self.site = self.first.layer, self.first.site
        self.scores = scale_frames.layer_scores_frame(trace, self.layer, self.site)
        self.experts = analysis.expert_balance_frame(trace)
        self.layer_load = self.experts[self.experts["layer"] == self.layer]
        self.balance = analysis.balance_frame(trace)
        self.losses = analysis.aux_loss_frame(analysis.loss_frame(trace))
        self.expert_scores = scale_frames.expert_scores_frame(trace, 3)
        self.token_scores = scale_frames.token_scores_frame(trace, 0, 5)
        self.confidence = scale_frames.token_confidence_frame(trace, 0, 5)
        self.path = self.routing[(self.routing["seq"] == 0) & (self.routing["pos"] == 5)]
        self.coactivation = scale_frames.layer_coactivation_frame(trace, self.layer, self.site)
        self.transitions = analysis.transition_frame(trace)
        self.repetition = analysis.repetition_frame(trace)
        self.paths = analysis.path_frame(trace)
        self.agreement = analysis.routing_agreement_frame(trace, other)
        self.drift = analysis.expert_drift_frame(trace, other)
        self.bias = bias_frame(trace)
        self.diff = engine_diff(trace, other)
        self.finetune = finetune_diff(trace, other, seq_domains=["code", "prose"], draws=50, shuffles=5)
        routes = routes_from_trace(trace)
        config = EPConfig(gpus=4, gpus_per_node=2, redundant=4, placement="eplb", expert_flops_per_token=1e6)
        self.ep = simulate_ep(routes, config)
        self.ep_both = pd.concat(
            [
                simulate_ep(routes, EPConfig(gpus=4, gpus_per_node=2)).layers_frame().assign(placement="a"),
                self.ep.layers_frame().assign(placement="eplb"),
            ]
        )
        self.curve = hit_rate_curve(routes, caches=[4, 8, 12])
        self.offload_steps = simulate_offload(routes, 8, "lru", expert_bytes=1000).steps_frame()
        self.capacity = replay_capacity(routes, cfs=[1.0, 1.5], policy="probs")


def attention_inputs() -> dict[str, object]:
    """Per-head summaries, one block of a map, one row and the KV what-if, with their frames' columns."""
    rng = np.random.default_rng(0)
    heads = pd.DataFrame({"layer": np.repeat([0, 1], 4), "head": np.tile(range(4), 2), "reason": ""})
    for metric in attention_charts.HEAD_METRICS:
        heads[metric] = rng.random(len(heads))
    heads["kind"] = "global"
    n = 12
    tokens = pd.DataFrame({"seq": 0, "pos": range(n), "token": [f"t{i}" for i in range(n)]})
    block = np.tril(rng.random((n, n)))
    block /= block.sum(axis=1, keepdims=True)
    kv = pd.DataFrame(
        {"layer": np.repeat([0, 1], 4), "head": np.tile(range(4), 2), "mean_lost": rng.random(8) / 4}
    )
    kv["p95_lost"], kv["max_lost"] = kv["mean_lost"] * 1.5, kv["mean_lost"] * 2
    return {"heads": heads, "tokens": tokens, "block": block, "row": block[n - 1], "kv": kv, "n": n}


def checkpoint_inputs() -> dict[str, pd.DataFrame]:
    """A checkpoint timeline's frames (`moeviz.store` timelines) over 3 checkpoints and 2 layers."""
    rng = np.random.default_rng(0)
    grid = pd.DataFrame(
        [
            {"checkpoint": f"step-{i:05d}", "order": i, "site": "mlp", "layer": layer}
            for i in range(3)
            for layer in (0, 1)
        ]
    )
    n = len(grid)
    saturation = grid.assign(tokens=512, saturation_topk=rng.random(n), saturation_top1=rng.random(n))
    collapse = grid.assign(
        verdict="healthy", reasons="", max_share=rng.random(n), dead_fraction=0.0, load_entropy=rng.random(n)
    ).assign(z_loss=rng.random(n))
    crossings = pd.DataFrame(
        {
            "site": "mlp",
            "layer": [0, 1],
            "indicator": "load_entropy",
            "level": "warning",
            "threshold": 0.8,
            "first_checkpoint": None,
            "value": None,
        }
    )
    drift = pd.concat([grid.assign(expert=e, drift=rng.random(n)) for e in range(4)], ignore_index=True)
    per_domain = pd.concat([grid.assign(domain=d) for d in ("english", "python")], ignore_index=True)
    specialisation = per_domain.assign(
        tokens=512, top_expert=3, ds=rng.random(len(per_domain)), baseline=0.25
    )
    specialisation["lift"] = specialisation["ds"] / 0.25
    domains = pd.DataFrame(
        [
            {"site": "mlp", "layer": layer, "domain": d, "expert": e, "tokens": 100, "dispatched": 10 * e}
            for layer in (0, 1)
            for d in ("english", "python")
            for e in range(8)
        ]
    )
    domains["ds"] = domains["dispatched"] / domains["tokens"]
    domains["baseline"], domains["lift"] = 0.25, domains["ds"] / 0.25
    return {
        "saturation": saturation,
        "collapse": collapse,
        "crossings": crossings,
        "drift": drift,
        "specialisation": specialisation,
        "domains": domains,
    }


def lab_inputs() -> dict[str, pd.DataFrame]:
    """A teaching-lab run's history and load (`moeviz.lab` runs' columns), 12 steps, 2 layers, 4 experts."""
    step = np.arange(1, 13)
    history = pd.DataFrame(
        {
            "step": step,
            "train_loss": 8.0 - 0.3 * step,
            "heldout_loss": np.where(step % 4 == 0, 8.2 - 0.3 * step, np.nan),
            "aux_loss_megatron": 1.0 + 0.01 * step,
            "z_loss": 0.5 * step,
            "load_entropy": np.linspace(1.0, 0.2, 12),
            "dead_experts_window_sum": np.minimum(step // 3, 3),
            "collapsed": step >= 9,
        }
    )
    grid = np.indices((12, 2, 4)).reshape(3, -1)
    load = pd.DataFrame({"step": grid[0] + 1, "layer": grid[1], "expert": grid[2], "load": 0.25})
    curves = pd.DataFrame(
        {"run": np.repeat(["a", "b"], 12), "metric": "train_loss", "step": np.tile(step, 2), "value": 1.0}
    ).assign(smoothed=1.0)
    return {"history": history, "load": load, "curves": curves}


def learn_inputs(inputs: Inputs) -> dict[str, object]:
    from moeviz.analysis.lesson import expert_token_share, router_walkthrough, token_weights_frame
    from moeviz.analysis.reroute import RerouteSettings, aux_terms, reroute

    routing = inputs.first
    rerouted = reroute(routing, RerouteSettings(k=2, score_fn="sigmoid"))
    tokens = inputs.trace.tokens
    load = pd.concat(
        [
            pd.DataFrame({"routing": name, "expert": range(16), "count": counts})
            for name, counts in (("captured", rerouted.captured_load), ("re-routed", rerouted.load))
        ]
    ).assign(fair=len(routing.token_rows) * 4 / 16)
    terms = aux_terms(routing)
    return {
        "walkthrough": router_walkthrough(routing, 3),
        "weights": token_weights_frame(tokens, routing, rerouted.experts, rerouted.weights, limit=8),
        "terms": terms,
        "compare": pd.DataFrame(
            {"expert": range(16), "term_captured": terms["term"], "term": terms["term"][::-1]}
        ),
        "load": load,
        "shares": expert_token_share(routing),
        "side_by_side": pd.concat(
            [inputs.layer_load.assign(model=name) for name in ("a", "b")], ignore_index=True
        ),
        "sweep": pd.DataFrame(
            {"experts": [1, 4, 1, 4, 4], "k": [1, 1, 2, 2, 2], "heldout_loss": [3.0, 2.5, 2.9, 2.4, 2.6]}
        ),
    }


def cases(i: Inputs) -> dict[str, Callable[[], alt.TopLevelMixin]]:
    """module.function → a call of it on the inputs (what the app's pages and the notebooks pass it)."""
    att, cp, lab, learn = attention_inputs(), checkpoint_inputs(), lab_inputs(), learn_inputs(i)
    n, tokens = att["n"], att["tokens"]
    quant_layers = pd.DataFrame(
        {"layer": [0, 1], "site": "mlp", "dtype": "int8", "target": "router", "flip_rate": [0.0, 0.02]}
    ).assign(top1_agreement=[1.0, 0.98], tokens=48)
    quant_margins = pd.DataFrame(
        {
            "layer": 0,
            "quartile": [1, 2, 3, 4],
            "margin_low": [0, 0.1, 0.2, 0.3],
            "margin_high": [0.1, 0.2, 0.3, 0.5],
        }
    ).assign(flip_rate=[0.1, 0.02, 0.0, 0.0], tokens=12)
    attribution = pd.DataFrame({"pos": range(6), "token": list("abcdef"), "ig": np.linspace(-1, 1, 6)})
    attribution["ig_share"], attribution["ablation"] = attribution["ig"] / 3, attribution["ig"] / 2
    importance = pd.DataFrame(
        {"layer": np.repeat([0, 1], 4), "expert": np.tile(range(4), 2), "delta_loss": np.linspace(0, 1, 8)}
    ).assign(weighted_load=0.25, load=0.25, tokens=48)
    positions = pd.DataFrame(
        {
            "pos": range(6),
            "token": list("abcdef"),
            "next_token": list("bcdefg"),
            "delta": np.linspace(-1, 0.5, 6),
        }
    ).assign(intervened=[False, False, True, False, False, False], routing_changed=[False] * 3 + [True] * 3)
    diff = i.diff
    return {
        "about.bias_chart": lambda: moeviz.charts.bias_chart(i.bias),
        "attention.attention_map_chart": lambda: attention_charts.attention_map_chart(
            attention_charts.attention_block_frame(att["block"], range(n), range(n), tokens)
        ),
        "attention.attention_map_raster": lambda: attention_charts.attention_map_raster(
            att["block"], np.arange(n), np.arange(n), tokens
        ),
        "attention.attention_row_chart": lambda: attention_charts.attention_row_chart(
            attention_charts.attention_row_frame(att["row"], tokens, pos=n - 1)
        ),
        "attention.head_metric_heatmap": lambda: attention_charts.head_metric_heatmap(
            att["heads"], "mean_entropy"
        ),
        "attention.kv_whatif_heatmap": lambda: attention_charts.kv_whatif_heatmap(att["kv"]),
        "attribution.attribution_strip_chart": lambda: attribution_strip_chart(attribution),
        "attribution.importance_chart": lambda: importance_chart(importance),
        "attribution.position_delta_chart": lambda: position_delta_chart(positions),
        "binning.binned_dispatch_heatmap": lambda: moeviz.charts.binned_dispatch_heatmap(
            i.scores, max_bins=8
        ),
        "checkpoints.balance_timeline_chart": lambda: checkpoint_charts.balance_timeline_chart(
            cp["collapse"], "load_entropy", cp["crossings"]
        ),
        "checkpoints.domain_specialisation_heatmap": lambda: checkpoint_charts.domain_specialisation_heatmap(
            cp["domains"]
        ),
        "checkpoints.drift_timeline_chart": lambda: checkpoint_charts.drift_timeline_chart(cp["drift"]),
        "checkpoints.saturation_timeline_chart": lambda: checkpoint_charts.saturation_timeline_chart(
            cp["saturation"]
        ),
        "checkpoints.specialisation_timeline_chart": lambda: checkpoint_charts.specialisation_timeline_chart(
            cp["specialisation"]
        ),
        "compare.agreement_chart": lambda: compare_charts.agreement_chart(i.agreement),
        "compare.load_shift_heatmap": lambda: compare_charts.load_shift_heatmap(i.drift),
        "compare.side_by_side_load_heatmap": lambda: compare_charts.side_by_side_load_heatmap(
            i.experts, title="A"
        ),
        "deployment.balancedness_chart": lambda: deployment_charts.balancedness_chart(i.ep_both),
        "deployment.capacity_drop_chart": lambda: deployment_charts.capacity_drop_chart(
            i.capacity.layers_frame()
        ),
        "deployment.comm_share_chart": lambda: deployment_charts.comm_share_chart(i.ep.layers_frame()),
        "deployment.cumulative_bytes_chart": lambda: deployment_charts.cumulative_bytes_chart(
            i.offload_steps.assign(policy="lru")
        ),
        "deployment.dispatch_bytes_chart": lambda: deployment_charts.dispatch_bytes_chart(
            i.ep.layers_frame()
        ),
        "deployment.flip_rate_chart": lambda: deployment_charts.flip_rate_chart(quant_layers),
        "deployment.gpu_load_heatmap": lambda: deployment_charts.gpu_load_heatmap(i.ep.gpu_load_frame()),
        "deployment.hit_rate_curve_chart": lambda: deployment_charts.hit_rate_curve_chart(i.curve),
        "deployment.margin_flips_chart": lambda: deployment_charts.margin_flips_chart(quant_margins),
        "deployment.overflow_heatmap": lambda: deployment_charts.overflow_heatmap(
            i.capacity.experts_frame(), 1.0
        ),
        "deployment.params_chart": lambda: deployment_charts.params_chart(
            pd.DataFrame({"name": ["a", "b"], "total_params": [100, 10_000], "active_params": [50, 1_000]})
        ),
        "deployment.position_drop_chart": lambda: deployment_charts.position_drop_chart(
            i.capacity.position_frame()
        ),
        "deployment.prefetch_recall_chart": lambda: deployment_charts.prefetch_recall_chart(
            pd.DataFrame({"layer": [1, 2], "from_layer": [0, 1], "recall": [0.5, 0.75], "tokens": [9, 9]})
        ),
        "engines.layer_mismatch_chart": lambda: moeviz.charts.layer_mismatch_chart(diff.layers),
        "engines.margin_quartile_chart": lambda: moeviz.charts.margin_quartile_chart(
            diff.margin_quartile_frame(), side="a"
        ),
        "engines.position_heatmap": lambda: moeviz.charts.position_heatmap(diff.layer_position_frame()),
        "engines.routers_per_token_chart": lambda: moeviz.charts.routers_per_token_chart(
            diff.routers_frame()
        ),
        "engines.routers_strip_chart": lambda: moeviz.charts.routers_strip_chart(
            diff.token_frame(), num_layers=len(diff.layers)
        ),
        "finetune.balance_change_chart": lambda: finetune_charts.balance_change_chart(i.finetune.balance),
        "finetune.domain_took_chart": lambda: finetune_charts.domain_took_chart(i.finetune.domain_shift),
        "finetune.load_shift_band_chart": lambda: finetune_charts.load_shift_band_chart(
            i.finetune.load_shift
        ),
        "finetune.router_delta_chart": lambda: finetune_charts.router_delta_chart(
            pd.DataFrame(
                {"layer": [1, 2], "site": "mlp", "module": "gate.weight", "rows": 16, "cols": 8}
            ).assign(norm=[0.1, 0.0], base_norm=2.0, relative=[0.05, 0.0], rank=[4, 0], sigma_max=[0.08, 0.0])
        ),
        "finetune_lesson.finetune_lesson_chart": lambda: finetune_lesson_charts.finetune_lesson_chart(
            pd.DataFrame(
                {
                    "run": ["lora", "lora", "full", "full"],
                    "step": [0, 1, 0, 1],
                    "max_share": [0.2, 0.3, 0.2, 0.4],
                }
            ),
            "max_share",
            runs=["lora", "full"],
            reference=0.125,
        ),
        "finetune.specialisation_change_heatmap": lambda: finetune_charts.specialisation_change_heatmap(
            i.finetune.specialisation
        ),
        "lab.lab_load_chart": lambda: lab_charts.lab_load_chart(lab["load"], 0, 4, collapse_step=9),
        "lab.lab_load_snapshot_chart": lambda: lab_charts.lab_load_snapshot_chart(lab["load"], 0, 6, 4),
        "lab.lab_loss_chart": lambda: lab_charts.lab_loss_chart(lab["history"], collapse_step=9),
        "lab.lab_metric_chart": lambda: lab_charts.lab_metric_chart(lab["history"], "load_entropy"),
        "lab.lab_runs_chart": lambda: lab_charts.lab_runs_chart(lab["curves"], "train_loss"),
        "lab.lab_finetune_chart": lambda: lab_charts.lab_finetune_chart(
            lab["curves"].assign(metric="new_loss"), "new_loss", reference=0.125
        ),
        "learn.aux_terms_chart": lambda: learn_charts.aux_terms_chart(learn["terms"], k=4, title="t"),
        "learn.aux_terms_compare_chart": lambda: learn_charts.aux_terms_compare_chart(
            learn["compare"], k=2, k_captured=4, title="t"
        ),
        "learn.choice_load_chart": lambda: learn_charts.choice_load_chart(learn["load"], title="t"),
        "learn.experts_sweep_chart": lambda: learn_charts.experts_sweep_chart(learn["sweep"]),
        "learn.load_side_by_side_chart": lambda: learn_charts.load_side_by_side_chart(
            learn["side_by_side"], title="t"
        ),
        "learn.router_walkthrough_chart": lambda: learn_charts.router_walkthrough_chart(
            learn["walkthrough"], k=4, score_fn="sigmoid", title="t"
        ),
        "learn.shared_experts_chart": lambda: learn_charts.shared_experts_chart(
            learn["shares"], k=4, title="t"
        ),
        "learn.token_weights_chart": lambda: learn_charts.token_weights_chart(learn["weights"], title="t"),
        "load.aux_loss_chart": lambda: moeviz.charts.aux_loss_chart(i.losses),
        "load.balance_chart": lambda: moeviz.charts.balance_chart(i.balance, "load_entropy"),
        "load.load_heatmap": lambda: moeviz.charts.load_heatmap(i.experts),
        "raster.raster_heatmap": lambda: raster_heatmap(
            att["block"],
            ColourRamp.of("greys", (0.0, 1.0)),
            row_title="query",
            col_title="key",
            value_title="p",
        ),
        "routing.expert_load_chart": lambda: moeviz.charts.expert_load_chart(i.layer_load),
        "routing.expert_timeline_chart": lambda: moeviz.charts.expert_timeline_chart(i.expert_scores, 3),
        "routing.router_score_heatmap": lambda: moeviz.charts.router_score_heatmap(i.scores),
        "routing.token_layer_scores_chart": lambda: moeviz.charts.token_layer_scores_chart(i.token_scores),
        "routing.token_margin_chart": lambda: moeviz.charts.token_margin_chart(i.confidence),
        "routing.token_path_chart": lambda: moeviz.charts.token_path_chart(i.path),
        "routing.token_strip_chart": lambda: moeviz.charts.token_strip_chart(
            i.routing[i.routing["layer"] == i.layer], num_experts=16, n_group=4
        ),
        "scale.expert_load_curve_chart": lambda: moeviz.charts.expert_load_curve_chart(i.layer_load),
        "scale.layer_expert_heatmap": lambda: moeviz.charts.layer_expert_heatmap(i.experts, "utilisation"),
        "scale.token_rank_path_chart": lambda: moeviz.charts.token_rank_path_chart(
            i.token_scores, load=i.experts
        ),
        "structure.coactivation_heatmap": lambda: moeviz.charts.coactivation_heatmap(i.coactivation),
        "structure.path_chart": lambda: moeviz.charts.path_chart(i.paths),
        "structure.repetition_chart": lambda: moeviz.charts.repetition_chart(i.repetition),
        "structure.transition_heatmaps": lambda: moeviz.charts.transition_heatmaps(i.transitions),
    }


@pytest.fixture(scope="module")
def built() -> dict[str, Callable[[], alt.TopLevelMixin]]:
    return cases(Inputs())


# ---- the checks ------------------------------------------------------------------------------------------
def embedded_spec(bundle: dict) -> dict:
    """The Vega-Lite spec a mimebundle carries: the vega-lite mimetype's value, or the spec that the HTML
    renderer's script passes to vegaEmbed."""
    for mimetype, value in bundle.items():
        if mimetype.startswith("application/vnd.vegalite"):
            return value
    html = bundle["text/html"]
    found = re.search(r"\}\)\((\{.*\}), \{\"mode\": \"vega-lite\"\}\);", html, re.S)
    assert found, "the HTML renderer's output holds no vegaEmbed call"
    return json.loads(found.group(1))


def test_every_chart_function_has_a_case(built) -> None:
    assert set(chart_functions()) == set(built)


@pytest.mark.parametrize("name", sorted(chart_functions()))
def test_the_chart_displays_inline(name, built) -> None:
    pytest.importorskip("IPython")  # Altair's renderers build their output with it, as a kernel has
    chart = built[name]()
    assert isinstance(chart, alt.TopLevelMixin)
    with alt.renderers.enable("default"), alt.data_transformers.enable("default"):
        bundle = chart._repr_mimebundle_()
    bundle = bundle[0] if isinstance(bundle, tuple) else bundle
    assert bundle, f"{name}: an empty mimebundle (Altair could not serialise the chart)"
    spec = embedded_spec(bundle)
    assert spec == json.loads(json.dumps(chart.to_dict())), "the notebook shows another spec than the chart's"
    vl_convert = pytest.importorskip("vl_convert")
    svg = vl_convert.vegalite_to_svg(spec)
    assert svg.startswith("<svg") and "NaN" not in re.findall(r'(?:x|y|width|height)="([^"]*)"', svg)


def test_the_charts_import_no_streamlit() -> None:
    """In a fresh interpreter: moeviz.charts and a displayed chart leave Streamlit unimported."""
    code = (
        "import sys, moeviz.charts as c, moeviz.analysis as a\n"
        "from moeviz.testing.scale_traces import synthetic_trace\n"
        "trace = synthetic_trace(num_experts=8, k=2, n_group=1, topk_group=1, num_blocks=2, first_dense=0)\n"
        "assert c.load_heatmap(a.expert_balance_frame(trace))._repr_mimebundle_()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'streamlit'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_chart_at_scale_displays_in_a_fresh_notebook_kernel() -> None:
    """A layer × expert view of 58 layers × 256 experts (14,848 rows, over Altair's 5,000-row default)."""
    code = (
        "import moeviz.charts as c, moeviz.analysis as a\n"
        "from moeviz.testing.scale_traces import synthetic_trace\n"
        "trace = synthetic_trace(num_experts=256, k=8, n_group=8, topk_group=4, num_blocks=61,\n"
        "                        first_dense=3, num_tokens=64)\n"
        "frame = a.expert_balance_frame(trace)\n"
        "assert len(frame) == 58 * 256, len(frame)\n"
        "bundle = c.load_heatmap(frame)._repr_mimebundle_()\n"
        "bundle = bundle[0] if isinstance(bundle, tuple) else bundle\n"
        "print(sorted(bundle))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "MaxRowsError" not in out.stderr, out.stderr[-2000:]
    assert "application/vnd.vegalite.v5+json" in out.stdout or "text/html" in out.stdout, out.stdout
