"""`moeviz whatif ep|offload|capacity|quant`: JSON schemas, agreement with the library on the same routes,
--trace equal to --text, and exit 2 with a specific message for bad flags (all in-process)."""

from __future__ import annotations

import json
import math

import pytest

import moeviz
from moeviz import cli
from moeviz.whatif.routes import routes_from_trace

MODEL = "sample:mixtral-healthy"
TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n" * 2
PROMPT = ["--model", MODEL, "--text", TEXT]
EP_FLAGS = ["--gpus", "4", "--gpus-per-node", "2", "--redundant", "4", "--placement", "eplb"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def loaded():
    return moeviz.load_model(MODEL)


@pytest.fixture(scope="module")
def routes(loaded):
    return routes_from_trace(moeviz.capture(loaded, TEXT))


def whatif(capsys, *args: str) -> dict:
    """`moeviz whatif ... --format json` in-process: its parsed stdout (exit 0 asserted)."""
    code = cli.main(["whatif", *args, "--format", "json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def plain(value):
    """A library `to_json()` as the CLI prints it: strict JSON (NaN/inf -> null), numpy -> python."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, str):
        value = value.item()
    return None if isinstance(value, float) and not math.isfinite(value) else value


def check_rows(rows: list[dict], keys: dict[str, type]) -> None:
    for row in rows:
        assert keys.keys() <= row.keys()
        for key, kind in keys.items():
            assert isinstance(row[key], kind) or (kind is float and row[key] is None), (key, row[key])


def test_ep_json_schema_and_library(capsys, loaded, routes):
    from moeviz.whatif.ep import EPConfig, simulate_ep
    from moeviz.whatif.model_size import expert_flops_per_token

    got = whatif(capsys, "ep", *PROMPT, *EP_FLAGS)
    assert {
        "model",
        "tokens",
        "placement",
        "ep_balancedness_over_layers",
        "layers",
        "totals",
        "definition",
    } <= got.keys()
    assert got["model"] == MODEL and got["placement"] == "eplb" and got["tokens"] == routes.tokens
    assert got["same_data"] is True and "same tokens" in got["fit"]
    check_rows(
        got["layers"],
        {
            "layer": int,
            "ep_balancedness": float,
            "gpu_load": list,
            "dispatch_bytes_local": int,
            "dispatch_bytes_intra": int,
            "dispatch_bytes_inter": int,
            "dispatch_bytes_nodedup": int,
        },
    )
    assert [row["layer"] for row in got["layers"]] == [r.layer for r in routes.layers]
    assert all(len(row["gpu_load"]) == 4 for row in got["layers"])
    hidden = loaded.model.config.hidden_size
    config = EPConfig(
        gpus=4,
        gpus_per_node=2,
        redundant=4,
        placement="eplb",
        hidden_size=hidden,
        expert_flops_per_token=expert_flops_per_token(loaded),
    )
    want = plain(simulate_ep(routes, config).to_json())
    assert got["layers"] == want["layers"] and got["totals"] == want["totals"]
    assert got["config"]["hidden_size"] == hidden
    assert all(row["dispatch_bytes_inter"] % (2 * hidden) == 0 for row in got["layers"])  # BF16 messages


def test_ep_fit_fraction_evaluates_out_of_sample(capsys, loaded, routes):
    from dataclasses import replace

    from moeviz.whatif.ep import EPConfig, fit_placement, simulate_ep
    from moeviz.whatif.model_size import expert_flops_per_token

    got = whatif(capsys, "ep", *PROMPT, *EP_FLAGS, "--fit-fraction", "0.5", "--replica", "vllm")
    fit, evaluate, how = routes.split(0.5)
    config = EPConfig(
        gpus=4,
        gpus_per_node=2,
        redundant=4,
        placement="eplb",
        replica="vllm",
        hidden_size=loaded.model.config.hidden_size,
    )
    config = replace(config, expert_flops_per_token=expert_flops_per_token(loaded))
    want = plain(simulate_ep(evaluate, config, fit_placement(fit, config)).to_json())
    assert got["same_data"] is False and got["fit"] == how and got["tokens"] == evaluate.tokens
    assert got["layers"] == want["layers"]


def test_ep_text_names_definition_and_same_data(capsys):
    assert cli.main(["whatif", "ep", *PROMPT, *EP_FLAGS]) == 0
    out = capsys.readouterr().out
    assert "definition: DeepEP dispatch" in out and "same tokens" in out
    assert out.count("\n    ") >= 4  # one table row per MoE layer


def test_offload_json_schema_and_library(capsys, loaded, routes):
    from moeviz.whatif.model_size import expert_bytes
    from moeviz.whatif.offload import POLICIES, simulate_offload

    got = whatif(capsys, "offload", *PROMPT, "--cache", "3", "--policy", "all", "--prefetch")
    keys = {
        "layer": int,
        "policy": str,
        "cache": int,
        "hits": int,
        "misses": int,
        "hit_rate": float,
        "bytes": int,
    }
    check_rows(got["layers"], keys)
    assert len(got["layers"]) == len(routes.layers) * len(POLICIES)
    nbytes = expert_bytes(loaded, "bf16")
    assert got["expert_bytes"] == nbytes
    want = [
        row
        for p in POLICIES
        for row in simulate_offload(routes, 3, p, expert_bytes=nbytes).to_json()["layers"]
    ]
    assert got["layers"] == plain(want)
    assert all(row["bytes"] == row["misses"] * nbytes for row in got["layers"])
    check_rows(got["prefetch"], {"layer": int, "from_layer": int, "recall": float, "tokens": int})
    assert [row["from_layer"] for row in got["prefetch"]] == [r.layer for r in routes.layers[:-1]]


def test_capacity_json_schema_and_library(capsys, routes):
    from moeviz.whatif.capacity import replay_capacity

    got = whatif(capsys, "capacity", *PROMPT, "--cf", "1.0,1.25", "--policy", "position")
    keys = {"layer": int, "cf": float, "policy": str, "capacity": int, "dropped_fraction": float}
    check_rows(got["layers"], keys)
    assert len(got["layers"]) == len(routes.layers) * 2
    assert {row["policy"] for row in got["layers"]} == {"position"}
    assert got["layers"] == plain(replay_capacity(routes, [1.0, 1.25], policy="position").to_json()["layers"])


def test_quant_json_schema_and_library(capsys, loaded, routes):
    from moeviz.whatif.quant import quantisation_flips

    got = whatif(capsys, "quant", *PROMPT, "--dtype", "int4", "--target", "router")
    keys = {"layer": int, "dtype": str, "target": str, "flip_rate": float, "top1_agreement": float}
    check_rows(got["layers"], keys)
    assert len(got["layers"]) == len(routes.layers)
    assert {(row["dtype"], row["target"]) for row in got["layers"]} == {("int4", "router")}
    want = quantisation_flips(loaded, text=TEXT, dtype="int4", target="router").to_json()
    assert got["layers"] == plain(want["layers"])


def test_trace_file_equals_text(capsys, tmp_path):
    out = tmp_path / "t.parquet"
    assert cli.main(["capture", *PROMPT, "--out", str(out)]) == 0
    capsys.readouterr()
    for command in (["ep", *EP_FLAGS], ["capacity", "--cf", "1.0,1.5"]):
        from_text = whatif(capsys, *command[:1], *PROMPT, *command[1:])
        from_trace = whatif(capsys, *command[:1], "--model", MODEL, "--trace", str(out), *command[1:])
        assert from_trace == from_text, command[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["ep", *PROMPT, "--gpus", "4", "--gpus-per-node", "2", "--redundant", "3", "--placement", "eplb"],
            "8 experts + 3 redundant slots do not split evenly over 4 GPUs",
        ),
        (["ep", *PROMPT, "--gpus", "6", "--gpus-per-node", "4"], "multiple of --gpus-per-node"),
        (["ep", *PROMPT, *EP_FLAGS, "--fit-fraction", "1.5"], "--fit-fraction must be between 0 and 1"),
        (["offload", *PROMPT, "--cache", "1"], "cannot hold one token's 2 experts"),
        (["capacity", *PROMPT, "--cf", "1.0,x"], "--cf takes comma-separated numbers"),
        (["capacity", *PROMPT, "--cf", "0"], "must be > 0"),
        (
            ["ep", "--model", MODEL, "--trace", "/no/such.parquet", *EP_FLAGS],
            "--trace /no/such.parquet is not a file",
        ),
    ],
)
def test_bad_values_exit_2_with_one_line(capsys, args, message):
    assert cli.main(["whatif", *args]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("moeviz: error: ") and message in err, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["ep", *PROMPT, "--gpus", "4", "--gpus-per-node", "2", "--placement", "nope"],
            "invalid choice: 'nope'",
        ),
        (["quant", "--model", MODEL, "--trace", "t.parquet"], "quant runs the model on the tokens itself"),
        (["capacity", *PROMPT, "--run-model", "m"], "--run-model only applies to --store"),
        (
            ["capacity", "--model", MODEL, "--trace", "t.parquet", "--generate", "3"],
            "--generate applies to a prompt",
        ),
        (["offload", *PROMPT], "the following arguments are required: --cache"),
    ],
)
def test_bad_flags_are_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["whatif", *args])
    assert exit_.value.code == cli.EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_store_input_equals_library(capsys, loaded, tmp_path):
    from moeviz.store import TraceSettings, write_corpus
    from moeviz.whatif.capacity import replay_capacity
    from moeviz.whatif.routes import routes_from_store

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(2):
        (corpus / f"doc{i}.txt").write_text(TEXT * (i + 1), encoding="utf-8")
    store = tmp_path / "store"
    write_corpus(loaded, corpus, store, settings=TraceSettings(batch_size=2, chunk_tokens=64), progress=False)
    routes = routes_from_store(store)
    got = whatif(capsys, "capacity", "--model", MODEL, "--store", str(store), "--cf", "1.0")
    assert got["layers"] == plain(replay_capacity(routes, [1.0]).to_json()["layers"])
    assert got["tokens"] == routes.tokens and routes.sequences > 1
    ep = whatif(capsys, "ep", "--model", MODEL, "--store", str(store), *EP_FLAGS, "--fit-fraction", "0.5")
    assert "sequences drawn at random" in ep["fit"] and ep["same_data"] is False
