"""CLI load flags (--dtype, --device, --device-map, --offload-folder, --max-memory) and the load progress."""

from __future__ import annotations

import json

import pytest
import torch

from moeviz import cli
from moeviz.testing.tiny_models import build_tiny_model
from moeviz.trace import Trace


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_bf16")
    build_tiny_model("qwen3_moe").to(torch.bfloat16).save_pretrained(folder)
    return folder


def _capture(folder, out, *flags):
    return cli.main(["capture", "--model", str(folder), "--token-ids", "3,4,5,6", "--out", str(out), *flags])


def test_capture_dtype_and_device_flags(bf16_folder, tmp_path):
    assert _capture(bf16_folder, tmp_path / "auto.parquet") == 0
    assert Trace.from_parquet(tmp_path / "auto.parquet").model.dtype == "bfloat16"
    assert _capture(bf16_folder, tmp_path / "fp32.parquet", "--dtype", "float32", "--device", "cpu") == 0
    model = Trace.from_parquet(tmp_path / "fp32.parquet").model
    assert (model.dtype, model.device) == ("float32", "cpu")


def test_capture_with_a_device_map_and_disk_offload(bf16_folder, tmp_path, capsys):
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}  # fmt: skip
    out = tmp_path / "split.parquet"
    flags = ["--device-map", json.dumps(device_map), "--offload-folder", str(tmp_path / "off")]
    assert _capture(bf16_folder, out, *flags, "--max-memory", "cpu=1GiB") == 0
    assert "disk (1 module)" in Trace.from_parquet(out).model.device


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--offload-folder", "x"], "need --device-map"),
        (["--max-memory", "cpu=1GiB"], "need --device-map"),
        (["--device-map", "auto", "--max-memory", "cpu"], "DEVICE=SIZE"),
        (["--device-map", "{bad"], "not valid JSON"),
        (["--device", "tpu"], "unknown device"),
        (["--device", "cuda:0"], "CUDA"),
    ],
)
def test_bad_load_flags_exit_2(bf16_folder, tmp_path, capsys, flags, message):
    if "cuda" in flags[-1] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "t.parquet"
    assert _capture(bf16_folder, out, *flags) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_bad_dtype_is_a_usage_error(bf16_folder, tmp_path):
    with pytest.raises(SystemExit) as err:
        _capture(bf16_folder, tmp_path / "t.parquet", "--dtype", "int8")
    assert err.value.code == 2


def test_report_takes_load_flags_and_refuses_them_with_checkpoints(bf16_folder, capsys):
    code = cli.main(["report", "--model", str(bf16_folder), "--token-ids", "3,4,5,6", "--dtype", "float32",
                     "--format", "json"])  # fmt: skip
    assert code in (0, 3)
    assert json.loads(capsys.readouterr().out)["layers"]
    with pytest.raises(SystemExit):
        cli.main(["report", "--checkpoints", "a,b", "--corpus", "c", "--dtype", "float32"])
    assert "--dtype only applies to one --model" in capsys.readouterr().err


def test_load_progress_bar_counts_bytes(capsys):
    from moeviz.cli.flags import load_progress

    update = load_progress("loading")
    for done in (0, 512, 2048):
        update(done, 2048)
    assert "loading" in capsys.readouterr().err


def test_checkpoint_series_loads_with_the_given_dtype(corpus, tmp_path):
    """A series traced with dtype=bfloat16 stores exactly what each checkpoint loaded in bf16 routes (and not
    what the float32 load routes): the load options reach every checkpoint."""
    from moeviz.models import load_model
    from moeviz.models.loading import sample_models_dir
    from moeviz.store import StoreQuery, TraceSettings, write_corpus
    from moeviz.store.checkpoints import write_series

    series_dir = sample_models_dir() / "mixtral-healthy-series"
    spec, folder = [series_dir / "step-00000", series_dir / "step-01000"], series_dir / "step-01000"
    settings = TraceSettings(batch_size=2, chunk_tokens=64, max_batches=1)
    rows = (
        "SELECT seq, pos, layer, rank, expert, weight FROM rows WHERE checkpoint = 'step-01000' ORDER BY ALL"
    )
    write_series(spec, corpus, tmp_path / "bf16", settings=settings, progress=False, dtype="bfloat16")
    write_series(spec, corpus, tmp_path / "fp32", settings=settings, progress=False, dtype="float32")
    loaded = load_model(folder, dtype="bfloat16")
    direct_store = tmp_path / "direct"
    write_corpus(loaded, corpus, direct_store, checkpoint="step-01000", settings=settings, progress=False)
    series, direct = StoreQuery(tmp_path / "bf16").sql(rows), StoreQuery(direct_store).sql(rows)
    assert len(series) > 0
    assert series.equals(direct)
    assert not series["weight"].equals(StoreQuery(tmp_path / "fp32").sql(rows)["weight"])


def test_trace_max_memory_needs_a_device_map(corpus, tmp_path, capsys):
    out = tmp_path / "s"
    args = [
        "trace",
        "--model",
        "sample:mixtral-healthy",
        "--corpus",
        str(corpus),
        "--out",
        str(out),
    ]
    assert cli.main([*args, "--max-memory", "cpu=1GiB"]) == 2
    assert "need --device-map" in capsys.readouterr().err
    assert not out.exists()
