"""One balance vocabulary: a Switch-style model that drops tokens at capacity, run through every surface.

The library (`balance_frame`, `expert_balance_frame`), the `moeviz capture` summary, the `moeviz report` JSON,
a store query over the same trace, the load chart, `moeviz whatif ep`, the playground's and Learn's replays
(`moeviz.analysis.reroute`) and the Lab's history must show the same numbers under the same names: shares
f = c/(kT) of all kT slots (so they sum to 1 − dropped_fraction), utilisation c/(kT/E) and the dropped slots
as their own quantity, load_entropy normalised, each aux loss named by its form (AUX_LOSS_FORMS), one
ep_balancedness (docs/routing-metrics.md). Together with tests/app/test_balance_surfaces_app.py (the app's
pages: Load & collapse, Routing and Playground on the same kind of model, Learn and Deployment on the samples)
this is the cross-surface check; tests/app/test_app_balance_table.py checks the Load page's whole table.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import moeviz
from moeviz import cli
from moeviz.analysis import (
    balance_frame,
    ep_balancedness_over_layers,
    expert_balance_frame,
    loss_frame,
    trace_device_load,
)
from moeviz.charts import expert_load_chart
from moeviz.store import StoreQuery
from moeviz.store.writer import write_trace
from tests.support.charts import data_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOKEN_IDS = list(range(5, 29))  # 24 tokens, 4 experts of capacity 3 per layer: at least half dropped
DEVICES = 2
# the per-layer numbers every surface shows, by balance_frame's names
SHARED = [
    "tokens",
    "max_share",
    "min_utilisation",
    "max_utilisation",
    "dead_fraction",
    "dropped",
    "dropped_fraction",
    "load_entropy",
    "effective_experts",
    "max_vio",
    "cv",
    "cv_unbiased",
    "gini",
    "gini_megatron",
    "jain",
    "ep_balancedness",
]


@dataclass
class Surfaces:
    model_dir: Path  # the saved Switch-style model (no tokenizer: token ids only)
    token_ids: list[int]
    trace: moeviz.Trace
    balance: pd.DataFrame  # balance_frame(trace, DEVICES)
    experts: pd.DataFrame  # expert_balance_frame(trace, DEVICES)
    capture_stdout: str
    report: dict
    store: Path


@pytest.fixture(scope="module")
def surfaces(tiny_model_dir, tmp_path_factory) -> Surfaces:
    folder = tiny_model_dir("switch_transformers", expert_capacity=3)
    trace = moeviz.capture(moeviz.load_model(folder), token_ids=[TOKEN_IDS])
    ids = ",".join(map(str, TOKEN_IDS))
    tmp = tmp_path_factory.mktemp("surfaces")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert (
            cli.main(["capture", "--model", str(folder), "--token-ids", ids, "--out", str(tmp / "t.parquet")])
            == 0
        )
    captured = stdout.getvalue()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli.main(
            [
                "report",
                "--model",
                str(folder),
                "--token-ids",
                ids,
                "--format",
                "json",
                "--devices",
                str(DEVICES),
            ]
        )
    assert code in (0, cli.EXIT_VERDICT)
    store = tmp / "store"
    write_trace(trace, store, model="switch")
    return Surfaces(
        model_dir=folder,
        token_ids=TOKEN_IDS,
        trace=trace,
        balance=balance_frame(trace, DEVICES),
        experts=expert_balance_frame(trace, DEVICES),
        capture_stdout=captured,
        report=json.loads(stdout.getvalue()),
        store=store,
    )


def test_the_model_drops_slots_and_the_library_counts_them(surfaces):
    trace, balance, experts = surfaces.trace, surfaces.balance, surfaces.experts
    assert (balance["dropped"] > 0).any(), "the test needs capacity drops"
    for routing, row in zip(trace.layers, balance.itertuples(), strict=True):
        n, k, e = len(routing.token_rows), routing.k, routing.num_experts
        counts = np.bincount(routing.experts[routing.experts >= 0], minlength=e)
        dropped = int((routing.experts < 0).sum())
        assert (row.tokens, row.top_k, row.dropped) == (n, k, dropped)
        assert row.dropped_fraction == pytest.approx(dropped / (n * k))
        assert row.max_share == pytest.approx(counts.max() / (n * k))  # f = c/(kT): drops stay in kT
        mine = experts[(experts["layer"] == routing.layer) & (experts["site"] == routing.site)]
        np.testing.assert_array_equal(mine["count"], counts)
        np.testing.assert_allclose(mine["share"], counts / (n * k))
        np.testing.assert_allclose(mine["utilisation"], counts / (n * k / e))
        assert mine["share"].sum() + row.dropped_fraction == pytest.approx(1.0)
        assert row.max_share == pytest.approx(mine["share"].max())
        assert row.max_utilisation == pytest.approx(mine["utilisation"].max())
        assert row.min_utilisation == pytest.approx(mine["utilisation"].min())


def test_capture_summary_prints_the_library_numbers(surfaces):
    lines = surfaces.capture_stdout.splitlines()
    header = lines[1].split()
    assert header == [
        "layer",
        "site",
        "tokens",
        "experts",
        "k",
        "load_entropy",
        "max_share",
        "dead",
        "dropped",
        "dropped_fraction",
    ]
    rows = [line.split() for line in lines[2 : 2 + len(surfaces.balance)]]
    for cells, row in zip(rows, surfaces.balance.itertuples(), strict=True):
        assert (int(cells[0]), cells[1], int(cells[2])) == (row.layer, row.site, row.tokens)
        assert (int(cells[3]), int(cells[4])) == (row.experts, row.top_k)
        assert cells[5] == f"{row.load_entropy:.3f}"
        assert cells[6] == f"{row.max_share:.3f}"
        assert int(cells[7]) == row.dead_experts and int(cells[8]) == row.dropped
        assert cells[9] == f"{row.dropped_fraction:.3f}"


def test_report_json_has_the_library_numbers(surfaces):
    layers = surfaces.report["layers"]
    balance, losses = surfaces.balance, loss_frame(surfaces.trace)
    assert len(layers) == len(balance)
    for got, row, loss in zip(layers, balance.to_dict("records"), losses.to_dict("records"), strict=True):
        assert (got["layer"], got["site"]) == (row["layer"], row["site"])
        for name in SHARED:
            want = row[name]
            assert (got[name] is None) if want != want else got[name] == pytest.approx(want, rel=1e-12), name
        assert got["aux_loss_topk"] == pytest.approx(loss["aux_loss_topk"], rel=1e-12)
        assert got["aux_loss_megatron"] == pytest.approx(loss["aux_loss_megatron"], rel=1e-12)
        assert got["seq_aux_loss"] == pytest.approx(loss["seq_aux_loss"], rel=1e-12)
    over_layers = ep_balancedness_over_layers(trace_device_load(surfaces.trace, DEVICES))
    assert surfaces.report["ep_balancedness_over_layers"] == pytest.approx(over_layers, rel=1e-12)


def test_store_query_equals_the_library(surfaces):
    query = StoreQuery(surfaces.store)
    got = query.balance(devices=DEVICES).drop(columns=["model", "checkpoint", "z_loss"])
    pd.testing.assert_frame_equal(
        got.reset_index(drop=True),
        surfaces.balance.sort_values(["site", "layer"], kind="stable").reset_index(drop=True),
        check_dtype=False,
        check_exact=False,
        rtol=1e-12,
    )
    experts = query.expert_balance(devices=DEVICES).drop(columns=["model", "checkpoint"])
    want = surfaces.experts.sort_values(["site", "layer", "expert"], kind="stable").reset_index(drop=True)
    pd.testing.assert_frame_equal(experts.reset_index(drop=True), want, check_dtype=False)
    collapse = query.collapse()
    np.testing.assert_allclose(
        collapse["max_share"], surfaces.balance.sort_values(["site", "layer"])["max_share"]
    )


def test_load_chart_draws_the_dropped_slots(surfaces):
    for row in surfaces.balance.itertuples():
        rows = surfaces.experts[
            (surfaces.experts["layer"] == row.layer) & (surfaces.experts["site"] == row.site)
        ]
        for dropped in (None, row.dropped):  # recovered from the rows, or given
            data = data_of(expert_load_chart(rows, dropped=dropped).to_dict())
            bars = data.set_index("bar")
            assert bars["share"].sum() == pytest.approx(1.0)  # experts + dropped: all kT slots
            fair = row.tokens * row.top_k / row.experts
            assert bars["fair"].iloc[0] == pytest.approx(fair)
            if row.dropped:
                assert bars.loc["dropped", "count"] == row.dropped
                assert bars.loc["dropped", "share"] == pytest.approx(row.dropped_fraction)
            else:
                assert "dropped" not in bars.index


# ---- the playground and Learn replay the library's losses -------------------------------------------------
def test_playground_and_learn_replays_are_the_library_losses(surfaces):
    """The playground's re-routing (`moeviz.analysis.reroute`) of each captured layer, under the settings that
    reproduce it, and the per-expert terms Learn and the playground draw (`aux_terms`): the dispatched form
    of the library (`loss_frame`), on layers that drop slots; replayed without the capacity, the top-k
    form."""
    from moeviz.analysis.reroute import RerouteSettings, aux_terms, reroute

    losses = loss_frame(surfaces.trace).set_index(["site", "layer"])
    experts = surfaces.experts
    assert (surfaces.balance["dropped"] > 0).any()
    for routing in surfaces.trace.layers:
        want = losses.loc[(routing.site, routing.layer)]
        replayed = reroute(routing, RerouteSettings.captured(routing))
        assert replayed.captured_aux_loss_dispatched == pytest.approx(want["aux_loss_dispatched"], rel=1e-12)
        assert aux_terms(routing)["term"].sum() == pytest.approx(want["aux_loss_dispatched"], rel=1e-12)
        # without the capacity the replay dispatches the plain top-k: its dispatched form is the top-k form
        assert replayed.aux_loss_dispatched == pytest.approx(want["aux_loss_topk"], rel=1e-12)
        mine = experts[(experts["layer"] == routing.layer) & (experts["site"] == routing.site)]
        np.testing.assert_array_equal(replayed.load_rows(captured=True)["count"], mine["count"])


# ---- the expert-parallel what-if and the Lab say the same --------------------------------------------
def _whatif_ep_json(surfaces) -> dict:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli.main(
            [
                "whatif",
                "ep",
                "--model",
                str(surfaces.model_dir),
                "--token-ids",
                ",".join(map(str, surfaces.token_ids)),
                "--gpus",
                str(DEVICES),
                "--gpus-per-node",
                "1",
                "--placement",
                "contiguous",
                "--format",
                "json",
            ]
        )
    assert code == 0
    return json.loads(stdout.getvalue())


def test_whatif_ep_contiguous_is_report_devices(surfaces):
    """`moeviz report --devices D` and `moeviz whatif ep --gpus D --placement contiguous`: one quantity,
    one name, the same numbers (whatif counts GPU loads itself; report places the expert counts)."""
    got = _whatif_ep_json(surfaces)
    report = {(row["site"], row["layer"]): row for row in surfaces.report["layers"]}
    whatif_sites = {r.site for r in surfaces.trace.layers}
    assert len(got["layers"]) == len(surfaces.trace.layers) and whatif_sites
    for row, routing in zip(got["layers"], surfaces.trace.layers, strict=True):
        assert row["layer"] == routing.layer
        counts = np.bincount(routing.experts[routing.experts >= 0], minlength=routing.num_experts)
        devices = counts.reshape(DEVICES, -1).sum(axis=1)  # contiguous, by hand
        assert row["gpu_load"] == devices.tolist()
        want = devices.mean() / devices.max() if devices.max() else None
        assert row["ep_balancedness"] == pytest.approx(want, rel=1e-12)
        assert report[(routing.site, routing.layer)]["ep_balancedness"] == pytest.approx(want, rel=1e-12)
    assert got["ep_balancedness_over_layers"] == pytest.approx(
        surfaces.report["ep_balancedness_over_layers"], rel=1e-12
    )


def test_lab_history_is_the_library_balance(monkeypatch):
    """The Lab's history: load entropy normalised as `load_entropy` (not nats), the aux loss it trains on
    named by its form and equal to `aux_loss_megatron` of the step's router probabilities, its z-loss the
    library's `z_loss` of the step's router logits, and the dead experts of the last LOAD_WINDOW steps the
    library's per-layer `dead_experts` of the window's load, summed over the layers (a name of its own)."""
    from dataclasses import replace

    import torch

    from moeviz.analysis.balance import balance_indicators, load_entropy
    from moeviz.analysis.losses import aux_loss_megatron, z_loss
    from moeviz.lab import LabConfig, LabRun
    from moeviz.lab.train import BIAS_NAME, HISTORY_COLUMNS, LOAD_WINDOW, LabRouter

    seen = []  # per training forward of a router: (logits [N, E], probabilities [N, E])
    forward = LabRouter.forward

    def recording(self, hidden_states):
        out = forward(self, hidden_states)
        if self.lab_record is not None:
            logits, probs = self.lab_record[:2]
            seen.append((logits.detach().numpy().copy(), probs.detach().numpy().copy()))
        return out

    monkeypatch.setattr(LabRouter, "forward", recording)
    steps = LOAD_WINDOW + 2  # the window full, then sliding
    config = replace(
        LabConfig(),
        experts=4,
        k=2,
        d_model=16,
        layers=2,
        batch=2,
        seq=16,
        steps=steps,
        eval_every=5,
        capacity_factor=1.0,  # drops: the window's loads are the kept slots
        router_noise=0.5,  # logits of some size: z_loss far from 0
        bias_rate=1e-6,  # a selection bias, set below so that expert 0 of layer 0 is never chosen
    )
    run = LabRun(config)
    with torch.no_grad():
        getattr(run.routers[0], BIAS_NAME)[0] = -10.0  # probabilities are in [0, 1]: a dead expert
    rows = [run.step() for _ in range(steps)]
    assert "aux_loss" not in HISTORY_COLUMNS and "aux_loss_megatron" in HISTORY_COLUMNS
    assert {"z_loss", "dead_experts_window_sum"} <= set(HISTORY_COLUMNS)
    assert len(seen) == config.layers * steps
    loads = run.load_history()
    slots = config.batch * config.seq * config.k
    for step, row in enumerate(rows, start=1):
        mine = seen[(step - 1) * config.layers : step * config.layers]
        want = np.mean([aux_loss_megatron(probs, config.k) for _, probs in mine])
        assert row["aux_loss_megatron"] == pytest.approx(want, rel=1e-5)
        # torch's float32 logsumexp² against the library's (float32 logsumexp, float64 square and mean)
        assert row["z_loss"] == pytest.approx(np.mean([z_loss(logits) for logits, _ in mine]), rel=1e-5)
        at = loads[loads["step"] == step].sort_values(["layer", "expert"])
        shares = at["load"].to_numpy().reshape(config.layers, config.experts)
        assert row["load_entropy"] == pytest.approx(float(np.mean(load_entropy(shares))), rel=1e-9)
        assert 0 <= row["load_entropy"] <= 1
        window = loads[(loads["step"] > step - LOAD_WINDOW) & (loads["step"] <= step)]
        counts = np.rint(window.groupby(["layer", "expert"])["load"].sum().to_numpy() * slots).reshape(
            config.layers, config.experts
        )
        tokens = config.batch * config.seq * window["step"].nunique()
        dead = balance_indicators(counts, tokens, config.k, ("dead_experts",))["dead_experts"]
        assert row["dead_experts_window_sum"] == int(dead.sum())
    assert rows[-1]["z_loss"] > 0
    assert all(row["dead_experts_window_sum"] >= 1 for row in rows)  # the case under test: a dead expert


# ---- one vocabulary -------------------------------------------------------------------------------------
def test_every_surface_names_balance_by_the_vocabulary(surfaces):
    """No surface says a bare `aux_loss` or `balancedness`, and every aux-loss key names a form of
    AUX_LOSS_FORMS: the report JSON, loss_frame, the Lab's history and chart metrics, `whatif ep`."""
    from moeviz.analysis import AUX_LOSS_FORMS, aux_loss_frame
    from moeviz.charts.lab import LAB_METRICS
    from moeviz.lab.train import HISTORY_COLUMNS

    ep = _whatif_ep_json(surfaces)
    names = {
        "report": set(surfaces.report) | {k for row in surfaces.report["layers"] for k in row},
        "loss_frame": set(loss_frame(surfaces.trace).columns),
        "aux_loss_frame": set(aux_loss_frame(loss_frame(surfaces.trace)).columns),
        "lab history": set(HISTORY_COLUMNS),
        "lab charts": set(LAB_METRICS),
        "whatif ep": set(ep) | set(ep["totals"]) | {k for row in ep["layers"] for k in row},
    }
    for surface, keys in names.items():
        assert not keys & {"aux_loss", "balancedness"}, surface
        for key in keys:
            if "aux_loss" in key:
                assert key.removesuffix("_balanced") in AUX_LOSS_FORMS, (surface, key)
            if "entropy" in key:
                assert key in ("load_entropy", "load_entropy_nats"), (surface, key)
            if "balancedness" in key:
                assert key in ("ep_balancedness", "ep_balancedness_over_layers"), (surface, key)
    # the Lab says the library's z-loss by its name, and gives its own dead-expert count (a window, summed
    # over layers) a name of its own: `dead_experts` is the library's per-layer count
    lab = names["lab history"] | names["lab charts"]
    assert "z_loss" in names["lab history"] and not lab & {"router_z", "dead_experts"}
