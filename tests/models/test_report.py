"""`moeviz report`: the per-layer numbers, the verdict, the output formats and the exit codes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import moeviz
from moeviz import cli
from moeviz.models.loading import DEFAULT_SAMPLE as MODEL
from moeviz.report import LAYER_KEYS

REQUIRED = [
    "layer",
    "aux_loss_topk",
    "z_loss",
    "load_entropy",
    "max_share",
    "dead_fraction",
    "max_vio",
    "cv",
    "verdict",
]


def report_json(capsys, *args) -> tuple[int, dict]:
    code = cli.main(["report", *args, "--format", "json"])
    return code, json.loads(capsys.readouterr().out)


def test_json_numbers_match_independent_computations(tiny_model_dir, capsys):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    folder = tiny_model_dir("mixtral")
    ids = list(range(3, 120))
    code, out = report_json(capsys, "--model", str(folder), "--token-ids", ",".join(map(str, ids)))
    assert code == 0
    trace = moeviz.capture(moeviz.load_model(folder), token_ids=[ids])
    assert [row["layer"] for row in out["layers"]] == [r.layer for r in trace.layers]
    for row, routing in zip(out["layers"], trace.layers, strict=True):
        assert set(REQUIRED) <= set(row) and set(LAYER_KEYS) <= set(row)
        expected_aux = load_balancing_loss_func((torch.from_numpy(routing.logits),), routing.num_experts, 2)
        assert row["aux_loss_topk"] == pytest.approx(float(expected_aux), rel=1e-5)
        assert row["aux_loss_megatron"] == pytest.approx(float(expected_aux) / 2, rel=1e-5)
        lse = np.log(np.exp(routing.logits.astype(np.float64)).sum(1))
        assert row["z_loss"] == pytest.approx(float((lse**2).mean()), rel=1e-5)
        counts = np.bincount(routing.experts.ravel(), minlength=routing.num_experts)
        share = counts / counts.sum()
        nz = share[share > 0]
        assert row["load_entropy"] == pytest.approx(-(nz * np.log(nz)).sum() / np.log(8), abs=1e-6)
        assert row["max_share"] == pytest.approx(share.max(), abs=1e-9)
        assert row["dead_fraction"] == pytest.approx((counts == 0).mean())
        assert row["max_vio"] == pytest.approx(counts.max() / counts.mean() - 1)
        assert row["cv"] == pytest.approx(counts.std() / counts.mean())


@pytest.fixture
def collapsed_model(tiny_model_dir, tmp_path):
    """DeepSeek-V3 whose balancing bias forces experts 0 and 1 (group 0) for every token."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_model_dir("deepseek_v3"), tmp_path / "collapsed")
    tensors = load_file(folder / "model.safetensors")
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.tensor([100.0, 100.0] + [0.0] * 6)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_fail_on_gates_the_exit_code(collapsed_model, capsys):
    ids = ",".join(str(i) for i in range(3, 100))
    code, out = report_json(capsys, "--model", str(collapsed_model), "--token-ids", ids)
    assert code == 0 and out["verdict"] == "collapsed"
    assert all(row["dead_fraction"] == 0.75 and row["verdict"] == "collapsed" for row in out["layers"])
    assert any("6 of 8 experts received no token" in reason for reason in out["reasons"])
    assert (
        cli.main(["report", "--model", str(collapsed_model), "--token-ids", ids, "--fail-on", "collapsed"])
        == 3
    )
    assert (
        cli.main(["report", "--model", str(collapsed_model), "--token-ids", ids, "--fail-on", "warning"]) == 3
    )


def test_healthy_model_passes_the_gate(tiny_model_dir, capsys):
    ids = ",".join(str(i) for i in range(3, 127)) + "," + ",".join(str(i) for i in range(126, 2, -1))
    code = cli.main(
        ["report", "--model", str(tiny_model_dir("olmoe")), "--token-ids", ids, "--fail-on", "collapsed"]
    )
    out = capsys.readouterr().out
    assert code == 0 and "collapsed" not in out.splitlines()[0].lower()
    # the verdict printed is the library's on the same tokens
    from moeviz.analysis import collapse_report

    trace = moeviz.capture(
        moeviz.load_model(tiny_model_dir("olmoe")), token_ids=[[int(i) for i in ids.split(",")]]
    )
    verdict = collapse_report(trace).verdict
    assert f"verdict: {str(verdict).upper()}" in out.splitlines()[0] and str(verdict) != "collapsed"


def test_corpus_report_with_domains(capsys, tmp_path):
    for domain, text in [
        ("code", "def f(x):\n    return x + 1\n" * 40),
        ("prose", "The cat sat on the mat. " * 60),
    ]:
        (tmp_path / domain).mkdir()
        (tmp_path / domain / "a.txt").write_text(text)
    code, out = report_json(capsys, "--model", MODEL, "--corpus", str(tmp_path), "--chunk-tokens", "64")
    assert code == 0
    assert all("specialised_domains" in row for row in out["layers"])
    # every token of both files, as the sample's tokenizer reads them (no special tokens in a chunk)
    tokenizer = moeviz.load_model(MODEL).tokenizer
    want = sum(
        len(tokenizer((tmp_path / d / "a.txt").read_text(), add_special_tokens=False)["input_ids"])
        for d in ("code", "prose")
    )
    assert out["tokens"] == want > 500


def test_text_and_markdown_formats(capsys):
    assert cli.main(["report", "--model", MODEL, "--text", "hello world, hello moe"]) == 0
    text = capsys.readouterr().out
    assert "verdict" in text and "load_entropy" in text
    assert cli.main(["report", "--model", MODEL, "--text", "hi there", "--format", "markdown"]) == 0
    assert "| layer | site | verdict |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--corpus", "/no/such/dir"], "does not exist"),
        (["--text", "hi", "--devices", "3"], "split evenly over the devices"),
        (["--text", "hi", "--chunk-tokens", "0"], "--chunk-tokens must be >= 1"),
    ],
)
def test_bad_report_input(capsys, args, message):
    assert cli.main(["report", "--model", MODEL, *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_report_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", "--model", "m", "--text", "x", "--fail-on", "sometimes"])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err
