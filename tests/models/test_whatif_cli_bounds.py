"""`moeviz whatif` refuses unbounded or non-finite flags with exit 2 and one `moeviz: error:` line naming the
flag and its bound (--cf, --buckets, --redundant, --placement traffic, the link and compute rates), counts a
repeated CF once, keeps every slot at a huge CF, runs 8 experts + 8 slots on 16 GPUs, and prints capture's
`moeviz: warning:` line when the routing it replays (a fresh capture, a trace file, a store) has router
scores that are not finite (all in-process)."""

from __future__ import annotations

import json

import pytest

import moeviz
from moeviz import cli
from moeviz.capture import routing_warning
from moeviz.whatif.routes import routes_from_trace
from tests.support.nan_router import save_nan_router_model

MODEL = "sample:mixtral-healthy"  # 8 experts, top-2
TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    """The sample's routing of TEXT, written as `moeviz capture` writes it; and its routes."""
    trace = moeviz.capture(moeviz.load_model(MODEL), TEXT)
    path = tmp_path_factory.mktemp("trace") / "t.parquet"
    trace.to_parquet(path)
    return path, routes_from_trace(trace)


def run(capsys, *args: str) -> tuple[int, str, list[str]]:
    """(exit code, stdout, the stderr lines that are not the progress bar) of `moeviz whatif ...`."""
    code = cli.main(["whatif", *args])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.replace("\r", "\n").splitlines() if line.strip()]
    return code, captured.out, [line for line in lines if not line.startswith("moeviz whatif")]


def refused(capsys, *args: str) -> str:
    code, _, lines = run(capsys, *args)
    assert code == cli.EXIT_BAD_INPUT and len(lines) == 1 and lines[0].startswith("moeviz: error: "), lines
    return lines[0]


# ---- capacity ---------------------------------------------------------------------------------------------
def test_a_non_finite_cf_is_refused(capsys, trace_file) -> None:
    path, _ = trace_file
    line = refused(capsys, "capacity", "--model", MODEL, "--trace", str(path), "--cf", "1e19,inf")
    assert "--cf: a capacity factor must be > 0 and finite, got inf" in line
    line = refused(capsys, "capacity", "--model", MODEL, "--trace", str(path), "--cf", "nan")
    assert "finite, got nan" in line


def test_a_huge_cf_drops_nothing_and_c_is_t_times_k(capsys, trace_file) -> None:
    path, routes = trace_file
    code, out, _ = run(
        capsys, "capacity", "--model", MODEL, "--trace", str(path), "--cf", "1e19", "--format", "json"
    )
    assert code == 0
    layers = json.loads(out)["layers"]
    assert len(layers) == len(routes.layers)
    for row, layer in zip(layers, routes.layers, strict=True):
        assert row["dropped_fraction"] == 0.0 and row["capacity"] == layer.tokens * layer.k  # one sequence


def test_a_repeated_cf_is_counted_once(capsys, trace_file) -> None:
    path, routes = trace_file
    _, twice, _ = run(capsys, "capacity", "--model", MODEL, "--trace", str(path), "--cf", "1.0,1.25,1.0")
    _, once, _ = run(capsys, "capacity", "--model", MODEL, "--trace", str(path), "--cf", "1.0,1.25")
    assert twice == once
    totals = [line for line in once.splitlines() if line.startswith("total CF 1:")]
    (total,) = totals
    assigned = sum(int((layer.experts >= 0).sum()) for layer in routes.layers)
    assert f"of {assigned:,} assignments" in total  # each slot once, not once per repetition
    _, json_twice, _ = run(
        capsys, "capacity", "--model", MODEL, "--trace", str(path), "--cf", "1.0,1.0", "--format", "json"
    )
    assert [row["cf"] for row in json.loads(json_twice)["layers"]] == [1.0] * len(routes.layers)


def test_buckets_are_bounded_by_the_tokens(capsys, trace_file) -> None:
    path, routes = trace_file
    line = refused(capsys, "capacity", "--model", MODEL, "--trace", str(path), "--buckets", str(10**12))
    assert f"--buckets) must be between 1 and {routes.tokens}" in line and f"got {10**12:,}" in line


# ---- expert parallelism and offloading ------------------------------------------------------------------
def test_redundant_is_bounded_by_e_times_g_minus_one(capsys) -> None:
    ep = [
        "ep",
        "--model",
        MODEL,
        "--text",
        TEXT,
        "--gpus",
        "4",
        "--gpus-per-node",
        "2",
        "--placement",
        "eplb",
    ]
    line = refused(capsys, *ep, "--redundant", str(10**12))
    assert "redundant slots (--redundant) 1,000,000,000,000 exceed E·(G − 1) = 8·3 = 24" in line


def test_eplb_takes_at_most_65536_slots(capsys) -> None:
    gpus = 2**20  # R = 8·(G − 1) − … passes E·(G − 1): the fixed cap on P refuses it, before any table
    cluster = [
        "--gpus",
        str(gpus),
        "--gpus-per-node",
        "8",
        "--redundant",
        str(8 * gpus - 8),
        "--placement",
        "eplb",
    ]
    line = refused(capsys, "ep", "--model", MODEL, "--text", TEXT, *cluster)
    assert "make 8,388,608 slots; a placement takes at most 65,536" in line


def test_traffic_takes_at_most_512_slots(capsys) -> None:
    cluster = ["--gpus", "128", "--gpus-per-node", "8", "--redundant", "632", "--placement", "traffic"]
    line = refused(capsys, "ep", "--model", MODEL, "--text", TEXT, *cluster)
    assert "placement traffic refines 640 slots (E + R)" in line and "at most 512" in line


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["ep", "--gpus", "4", "--gpus-per-node", "2", "--nvlink-gbps", "nan"], "(--nvlink-gbps, GB/s) must"),
        (
            ["ep", "--gpus", "4", "--gpus-per-node", "2", "--internode-gbps", "inf"],
            "finite number > 0, got inf",
        ),
        (
            ["ep", "--gpus", "4", "--gpus-per-node", "2", "--gpu-tflops", "nan"],
            "(--gpu-tflops, TFLOP/s) must",
        ),
        (["offload", "--cache", "2", "--bandwidth", "inf"], "--bandwidth must be a finite number > 0 GB/s"),
        (["offload", "--cache", "2", "--step-time", "inf"], "--step-time must be a finite number >= 0"),
        (["ep", "--gpus", "4", "--gpus-per-node", "2", "--redundant", "-4"], "--redundant must be >= 0"),
    ],
)
def test_non_finite_rates_are_refused_before_the_model_loads(capsys, tmp_path, flags, message) -> None:
    line = refused(capsys, flags[0], "--model", str(tmp_path / "no-such-model"), "--text", TEXT, *flags[1:])
    assert message in line and "no-such-model" not in line


def test_eight_experts_and_eight_slots_on_sixteen_gpus(capsys) -> None:
    from moeviz.whatif.ep import EPConfig, simulate_ep

    cluster = ["--gpus", "16", "--gpus-per-node", "8", "--redundant", "8", "--placement", "eplb"]
    code, out, _ = run(capsys, "ep", "--model", MODEL, "--text", TEXT, *cluster, "--format", "json")
    assert code == 0
    got = json.loads(out)
    routes = routes_from_trace(moeviz.capture(moeviz.load_model(MODEL), TEXT))
    want = simulate_ep(routes, EPConfig(gpus=16, gpus_per_node=8, redundant=8, placement="eplb"))
    assert [row["gpu_load"] for row in got["layers"]] == want.gpu_load.tolist()
    assert all(len(row["gpu_load"]) == 16 for row in got["layers"])


# ---- non-finite router scores ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nan_model(tmp_path_factory):
    """A tiny mixtral whose last MoE layer's router has a NaN weight; the warning `capture` gives on it."""
    folder = save_nan_router_model(tmp_path_factory.mktemp("nan_router"))
    trace = moeviz.capture(moeviz.load_model(str(folder)), token_ids=[[5, 6, 7, 8]])
    message = routing_warning(trace.layers)
    assert message is not None and "layer 1" in message
    return folder, trace, f"moeviz: warning: {message}"


def warnings_of(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("moeviz: warning:")]


def test_a_fresh_capture_with_nan_routing_warns(capsys, nan_model) -> None:
    folder, _, warning = nan_model
    code, out, lines = run(capsys, "capacity", "--model", str(folder), "--token-ids", "5,6,7,8")
    assert code == 0 and warnings_of(lines) == [warning] and "not finite" not in out


def test_a_trace_file_with_nan_routing_warns(capsys, nan_model, tmp_path) -> None:
    folder, trace, warning = nan_model
    path = tmp_path / "nan.parquet"
    trace.to_parquet(path)
    for command in (["capacity"], ["offload", "--cache", "2"]):
        code, _, lines = run(capsys, command[0], "--model", str(folder), "--trace", str(path), *command[1:])
        assert code == 0 and warnings_of(lines) == [warning], command


def test_a_store_with_nan_routing_warns(capsys, nan_model, tmp_path) -> None:
    from moeviz.store import TraceSettings, write_corpus

    folder, _, warning = nan_model
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "doc.txt").write_text(TEXT * 2, encoding="utf-8")
    store = tmp_path / "store"
    loaded = moeviz.load_model(str(folder))
    write_corpus(loaded, corpus, store, settings=TraceSettings(batch_size=2, chunk_tokens=32), progress=False)
    code, _, lines = run(capsys, "capacity", "--model", str(folder), "--store", str(store))
    assert code == 0 and warnings_of(lines) == [warning]


def test_finite_routing_does_not_warn(capsys, trace_file) -> None:
    path, _ = trace_file
    code, _, lines = run(capsys, "capacity", "--model", MODEL, "--trace", str(path))
    assert code == 0 and warnings_of(lines) == []
