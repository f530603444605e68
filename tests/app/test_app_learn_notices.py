"""The Learn page's "what to notice" lines against the chart beside them (Streamlit AppTest): each line's
numbers are read back from the chart's own rows or recomputed here from the captured routing (numpy,
torch), its claims (rises / flat, more / less even, alike / different) judged by hand; each layered step
opens on the layer where its point shows most, found here independently."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from streamlit.testing.v1 import AppTest

from tests.support.app import run_page
from tests.support.learn import (  # noqa: F401  (fixtures: pytest finds them in the module)
    BIASED,
    HEALTHY,
    PAGE,
    _app_env,
    chart_rows,
    traces,
    ui,
)


def notice(at: AppTest) -> str:
    (line,) = [i.value for i in at.info if "What to notice" in i.value]
    return line


def entropy(counts) -> float:
    """Normalised load entropy H(c / Σc) / log E, by hand."""
    c = np.asarray(counts, dtype=float)
    p = c[c > 0] / c.sum()
    return float(-(p * np.log(p)).sum() / np.log(len(c)))


# ---- step 9 ---------------------------------------------------------------------------------------------
def test_sweep_step_reads_its_curves_against_the_seed_noise_and_rings_the_collapses(ui) -> None:
    """The shipped sweep: top-1's loss rises from the dense model, top-2's is flat within the seed spread; the
    notice once said "more experts help less and less". The recorded collapses are named and ringed."""
    sweep = ui.experts_sweep()
    assert sweep is not None and "collapse_step" in sweep
    at = run_page(PAGE, learn_step="sweep")
    line = notice(at)
    assert "help less and less" not in line
    grouped = sweep.groupby(["k", "experts"])["heldout_loss"]
    means, spread = grouped.mean(), grouped.max() - grouped.min()
    k1, k2 = means.loc[1], means.loc[2]
    # by hand: k = 1 is lowest at 1 expert (dense) and climbs by more than its seeds differ
    assert k1.idxmin() == 1 and k1.max() - k1.min() > spread.loc[1].max()
    assert f"k = 1 rises, from {k1.min():.3f} at 1 expert to {k1.max():.3f} at {k1.idxmax()} experts" in line
    # k = 2 moves less than its seeds differ
    assert k2.max() - k2.min() <= spread.loc[2].max()
    assert f"k = 2 is flat within seed noise ({k2.min():.3f}–{k2.max():.3f}" in line
    rows = chart_rows(at, "Held-out loss vs number of experts")
    ringed = rows[rows["collapses"] != ""]
    collapsed = sweep[sweep["collapse_step"].notna()]
    assert sorted(zip(ringed["k"], ringed["experts"], strict=True)) == sorted(
        {(f"k = {r.k}", r.experts) for r in collapsed.itertuples()}
    )
    for run in collapsed.itertuples():
        assert f"seed {run.seed} at step {int(run.collapse_step)}" in line
    drawn = rows.assign(k=rows["k"].str[4:].astype(int)).set_index(["k", "experts"]).sort_index()
    np.testing.assert_allclose(drawn["heldout_loss"], means.sort_index())
    np.testing.assert_allclose(drawn["highest"] - drawn["lowest"], spread.sort_index())


# ---- step 6 ---------------------------------------------------------------------------------------------
def unbiased_choice(routing) -> np.ndarray:
    """DeepSeek-V3's choice on sigmoid(logits) alone (best `topk_group` groups by the sum of their two best
    scores, then the top k), in numpy → [T, k] expert ids."""
    scores = 1 / (1 + np.exp(-routing.logits.astype(np.float64)))
    n, e = scores.shape
    grouped = scores.reshape(n, routing.n_group, e // routing.n_group)
    group_score = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)
    best = np.argsort(-group_score, axis=1)[:, : routing.topk_group]
    keep = np.zeros_like(group_score, dtype=bool)
    np.put_along_axis(keep, best, True, axis=1)
    masked = np.where(np.repeat(keep, e // routing.n_group, axis=1), scores, -np.inf)
    return np.argsort(-masked, axis=1)[:, : routing.k]


def test_bias_step_opens_where_the_bias_evens_the_load_most_and_reads_the_whole_load(traces) -> None:
    """The default layer is where the bias raises the load entropy most; at every layer the notice's
    verdict follows the entropy and its quietest / busiest shares are the chart's. (At layer 1 the busiest
    expert is busier with the bias: the line once read as if removing the bias evened the load.)"""
    trace = traces[BIASED]
    gains = {}
    for routing in trace.layers:
        if routing.bias is None:
            continue
        e = routing.num_experts
        with_bias = np.bincount(routing.experts.ravel(), minlength=e)
        without = np.bincount(unbiased_choice(routing).ravel(), minlength=e)
        gains[routing.layer] = entropy(with_bias) - entropy(without)
    best = max(gains, key=gains.get)
    at = run_page(PAGE, learn_step="bias")
    for layer in [best, *(layer for layer in gains if layer != best)]:
        if layer != best:
            at.select_slider(key="learn_bias_layer_widget").set_value(str(layer)).run()
        load = chart_rows(at, f"Load with and without the bias, MoE layer {layer}")  # the default: best
        slots = load["count"].sum() / 2
        counts = {
            name: rows.sort_values("expert")["count"].to_numpy() for name, rows in load.groupby("routing")
        }
        biased, plain = counts["with the bias (the model)"], counts["without the bias"]
        line = notice(at)
        h_with, h_without = entropy(biased), entropy(plain)
        assert h_with - h_without == pytest.approx(gains[layer])
        verdict = "With it the load is more even" if h_with > h_without else "less even with it"
        assert verdict in line, (layer, line)
        assert f"load entropy {h_with:.3f} vs {h_without:.3f} without" in line
        assert f"quietest expert gets {biased.min() / slots:.1%} of the slots with the bias, " in line
        assert f"{plain.min() / slots:.1%} without" in line
        assert f"busiest takes {biased.max() / slots:.1%} with it, {plain.max() / slots:.1%} without" in line
        if h_with > h_without and biased.max() >= plain.max():
            assert "The busiest expert alone does not show the difference" in line
    assert 1 in gains and best != 1  # on this model the bias shows most on a layer other than 1


# ---- step 5 ---------------------------------------------------------------------------------------------
def test_collapse_step_opens_where_the_three_trainings_differ_most(traces, ui) -> None:
    """The default layer is where the smallest entropy gap between consecutive trainings is largest (at
    layer 0 healthy and unbalanced look alike); at layer 0 the notice says so and points there."""
    names = list(ui.COLLAPSE_SAMPLES)
    layers = [r.layer for r in traces[ui.COLLAPSE_SAMPLES["healthy"]].layers]
    table = {
        layer: [
            entropy(np.bincount(traces[ui.COLLAPSE_SAMPLES[n]].layer(layer).experts.ravel(), minlength=8))
            for n in names
        ]
        for layer in layers
    }
    smallest_gap = {layer: float(np.min(-np.diff(values))) for layer, values in table.items()}
    best = max(smallest_gap, key=smallest_gap.get)
    at = run_page(PAGE, learn_step="collapse")
    load = chart_rows(at, f"Load per expert, MoE layer {best}")
    drawn = [entropy(load[load["model"] == n].sort_values("expert")["count"]) for n in names]
    np.testing.assert_allclose(drawn, table[best])
    line = notice(at)
    assert f"load entropy {', '.join(f'{v:.2f}' for v in table[best])}" in line
    assert "The weaker the balancing, the less even the load." in line  # true: strictly decreasing here
    assert all(np.diff(table[best]) < 0)
    assert "clearest there" not in line
    at.select_slider(key="learn_collapse_layer_widget").set_value("0").run()
    gaps = -np.diff(table[0])
    closest = int(np.argmin(gaps))
    pair = f"{names[closest].capitalize()} and {names[closest + 1]} differ by {gaps[closest]:.3f}"
    assert pair in notice(at) and f"at layer {best}: the contrast is clearest there" in notice(at)


# ---- steps 1–4 and 7 ------------------------------------------------------------------------------------
def test_load_and_aux_steps_open_on_their_most_telling_layer(traces) -> None:
    """Step 3 opens on the least even layer, step 4 on the largest aux loss / k; their notices name the
    chart's busiest and quietest experts and the sum of the chart's terms."""
    trace = traces[HEALTHY]
    counts = {r.layer: np.bincount(r.experts.ravel(), minlength=r.num_experts) for r in trace.layers}
    uneven = min(counts, key=lambda layer: entropy(counts[layer]))
    at = run_page(PAGE, learn_step="load")
    load = chart_rows(at, f"Expert load, MoE layer {uneven}")
    load = load[load["expert"] >= 0]
    busiest, quietest = load.loc[load["share"].idxmax()], load.loc[load["share"].idxmin()]
    assert f"expert {busiest.expert} gets {busiest.share:.1%}" in notice(at)
    assert f"expert {quietest.expert} {quietest.share:.1%}" in notice(at)

    def aux(routing) -> float:  # E · Σ f · P in torch, f = share of tokens whose top-k has e
        p = torch.softmax(torch.tensor(routing.logits, dtype=torch.float64), -1)
        top = torch.topk(p, routing.k).indices
        f = torch.bincount(top.ravel(), minlength=routing.num_experts) / len(p)
        return float(routing.num_experts * (f * p.mean(0)).sum())

    ratio = {r.layer: aux(r) / r.k for r in trace.layers}
    largest = max(ratio, key=ratio.get)
    at.session_state["learn_step"] = "aux"
    at.run()
    terms = chart_rows(at, f"Terms E·f_e·P_e, MoE layer {largest}")
    line = notice(at)
    assert f"it is {ratio[largest] * 2:.4f}" in line and f"{ratio[largest]:.3f}× that" in line
    top = terms.loc[terms["term"].idxmax()]
    assert f"Expert {int(top.expert)} adds the most" in line
    shares = ("more" if top.f > 2 / 8 else "no more", "more" if top.P > 1 / 8 else "no more")
    assert f"{shares[0]} than its share of the tokens" in line
    assert f"and {shares[1]} than its share of the probability" in line


def test_router_top_k_and_shared_notices_are_their_charts_numbers(traces) -> None:
    routing = traces[HEALTHY].layers[0]
    at = run_page(PAGE, learn_step="router")
    walk = chart_rows(at, "Token 0").sort_values("weight", ascending=False)
    chosen = walk[walk["chosen"]]
    for r in chosen.itertuples():
        # the model's own weight (captured), which the notice says is the renormalised score
        w = float(routing.weights[0][list(routing.experts[0]).index(r.expert)])
        assert f"expert {r.expert}: p = {r.score:.3f} → w = {w:.3f}" in notice(at)
    assert np.isclose(routing.weights[0].sum(), 1, atol=1e-3) and "rescaled to sum to 1" in notice(at)

    at.session_state["learn_step"] = "top_k"
    at.run()
    p = torch.softmax(torch.tensor(routing.logits, dtype=torch.float64), -1)
    top = torch.topk(p, 2).values
    first = float((top[:, 0] / top.sum(1)).mean())
    assert f"1st expert carries {first:.0%} of the output on average and the other {1 - first:.0%}" in notice(
        at
    )

    at.session_state["learn_step"] = "shared"
    at.run()
    layer = traces[BIASED].layers[0].layer  # the first MoE layer (block 0 is dense)
    shares = chart_rows(at, f"each expert processes, layer {layer}")
    routed = shares[shares["kind"] == "routed"]["share"]
    assert f"each routed expert {routed.min():.0%}–{routed.max():.0%} of them" in notice(at)
