"""`moeviz trace --model RUN --base MODEL`: a fine-tune's checkpoint series of PEFT adapters traced into a
store, each adapter merged into the base and recorded in its run, the base alone as checkpoint "base".

Oracle: the adapter merged by peft itself (`PeftModel.from_pretrained(...).merge_and_unload()`), saved as a
full checkpoint and traced as one model. `--base` for anything but a series is a usage error."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeviz.cli import main
from moeviz.models.loading import sample_models_dir
from moeviz.store import StoreQuery, TraceSettings, list_runs
from moeviz.store.checkpoints import BASE_LABEL
from moeviz.store.writer import write_corpus
from tests.support.adapters import adapter_run_fixtures, merge_as_full_checkpoint

DECLARED = "/elsewhere/models/mixtral-healthy"  # the base the adapters name: not on this machine
FLAGS = ["--batch-size", "2", "--chunk-tokens", "64", "--max-batches", "1", "--quiet"]
ROWS = "SELECT seq, pos, token_id, layer, rank, expert, weight FROM rows ORDER BY seq, pos, layer, rank"


base, run = adapter_run_fixtures([5, 20], DECLARED)


def test_trace_merges_each_adapter_of_the_series_into_the_base(run, base, corpus, tmp_path, capsys):
    store = tmp_path / "store"
    trace = ["trace", "--model", str(run), "--corpus", str(corpus), "--out", str(store), *FLAGS]
    assert main(trace) == 2  # the base the adapters name is not here
    assert "give the base model" in capsys.readouterr().err and not store.exists()
    assert main([*trace, "--base", "sample:mixtral-healthy", "--dtype", "float32"]) == 0
    configs = {r.checkpoint: r.config for r in list_runs(store)}
    assert sorted(configs) == sorted([BASE_LABEL, "checkpoint-5", "checkpoint-20"])
    assert {r.model for r in list_runs(store)} == {"run"}
    assert "adapter" not in configs[BASE_LABEL]
    for label in ("checkpoint-5", "checkpoint-20"):
        adapter = json.loads(configs[label]["adapter"])
        assert adapter["path"] == str(run / label) and adapter["base_model"] == DECLARED
        assert configs[label]["source"] == str(base)
        assert configs[label]["checkpoint_index"] == ["checkpoint-5", "checkpoint-20"].index(label) + 1

    # checkpoint-20 routes as peft's own merge of it, traced as one full model
    merged = merge_as_full_checkpoint(base, run / "checkpoint-20", tmp_path / "merged")
    import moeviz

    settings = TraceSettings(batch_size=2, chunk_tokens=64, max_batches=1)
    write_corpus(moeviz.load_model(merged), corpus, tmp_path / "oracle", settings=settings, progress=False)
    got = StoreQuery(store, checkpoint=["checkpoint-20"]).sql(ROWS)
    want = StoreQuery(tmp_path / "oracle").sql(ROWS)
    assert len(got) == len(want) > 0
    np.testing.assert_array_equal(got["expert"], want["expert"])
    np.testing.assert_allclose(got["weight"], want["weight"], rtol=0, atol=1e-6)
    # not vacuous: the adapter moved the routing away from the base's
    base_rows = StoreQuery(store, checkpoint=[BASE_LABEL]).sql(ROWS)
    assert (base_rows["expert"].to_numpy() != got["expert"].to_numpy()).any()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--model", "sample:mixtral-healthy", "--corpus", "c"],
            "--base only applies to a series of adapters",
        ),
        (["--model", "m", "--import", "vllm", "f.json"], "--base does not apply to --import"),
    ],
)
def test_base_for_anything_but_a_series_is_a_usage_error(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["trace", *args, "--out", str(tmp_path / "store"), "--base", "sample:mixtral-healthy"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "usage: moeviz trace" in err
    error = [line for line in err.splitlines() if "error:" in line]
    assert len(error) == 1 and message in error[0]
    assert not (tmp_path / "store").exists()


def test_base_for_a_series_of_full_checkpoints_is_refused(corpus, tmp_path, capsys):
    series = sample_models_dir() / "mixtral-healthy-series"
    code = main(["trace", "--model", str(series), "--corpus", str(corpus), "--out", str(tmp_path / "s"),
                 "--base", "sample:mixtral-healthy", *FLAGS])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "only to a series of adapters" in err and len(err.strip().splitlines()) == 1
