"""`moeviz trace` as a real process: interrupted by a real signal, resumed, equal to an uninterrupted run;
`moeviz report --checkpoints` on the sample series."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeviz.cli import main
from moeviz.samples import eval_dir
from moeviz.store import StoreQuery, list_runs

REPO = Path(__file__).resolve().parents[1]
SERIES = REPO / "sample_models" / "mixtral-healthy-series"
ARGS = ["--batch-size", "8", "--chunk-tokens", "256", "--max-batches", "24"]


def _trace_cmd(store: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "moeviz.cli", "trace", "--model", "sample:mixtral-healthy",
            "--corpus", str(eval_dir()), "--out", str(store), *ARGS, *extra]  # fmt: skip


def _rows(store: Path):
    return StoreQuery(store).sql(
        "SELECT batch, doc, domain, seq, pos, token_id, layer, rank, expert, weight, score, lse FROM rows "
        "ORDER BY seq, pos, layer, rank"
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    store = tmp_path_factory.mktemp("full") / "store"
    assert main(["trace", "--model", "sample:mixtral-healthy", "--corpus", str(eval_dir()), "--out",
                 str(store), "--quiet", *ARGS]) == 0  # fmt: skip
    return store


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_killed_trace_resumes_to_exactly_the_uninterrupted_rows(uninterrupted, tmp_path, sig):
    store = tmp_path / "store"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        _trace_cmd(store), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        manifest = next(iter(store.glob("model=*/checkpoint=*/manifest.jsonl")), None)
        if manifest is not None and manifest.read_text().count("\n") >= 3:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the trace finished before it could be interrupted"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    run = list_runs(store)[0]
    assert not run.complete and 3 <= len(run.parts) < 24, len(run.parts)
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and b"--resume" in err
    # without --resume the partial run is refused (exit 2), with --resume it completes
    if sig == signal.SIGKILL:
        again = subprocess.run(_trace_cmd(store, "--quiet"), cwd=REPO, env=env, capture_output=True)
        assert again.returncode == 2 and b"--resume" in again.stderr
    resumed = subprocess.run(_trace_cmd(store, "--quiet", "--resume"), cwd=REPO, env=env, capture_output=True)
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    assert list_runs(store)[0].complete
    got, want = _rows(store), _rows(uninterrupted)
    assert len(got) == len(want) > 0
    assert got.equals(want)


def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys):
    store = tmp_path / "store"
    code = main(["trace", "--model", "sample:mixtral-healthy", "--corpus", str(tmp_path / "missing"),
                 "--out", str(store)])  # fmt: skip
    assert code == 2 and not store.exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"no_text": 1}\n')
    code = main(["trace", "--model", "sample:mixtral-healthy", "--corpus", str(bad), "--out", str(store),
                 "--quiet"])  # fmt: skip
    assert code == 2 and "line 2" in capsys.readouterr().err
    assert not any(store.rglob("*.parquet"))
    code = main(["trace", "--model", "sample:mixtral-healthy", "--corpus", str(eval_dir()), "--out",
                 str(store), "--batch-size", "0"])  # fmt: skip
    assert code == 2


def test_jsonl_corpus_with_domains(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        '{"text": "def f(x):\\n    return x + 1\\n", "domain": "python"}\n'
        '{"text": "In the beginning God created the heaven and the earth."}\n'
    )
    store = tmp_path / "store"
    assert main(["trace", "--model", "sample:mixtral-healthy", "--corpus", str(corpus), "--out", str(store),
                 "--quiet", "--confidence"]) == 0  # fmt: skip
    frame = StoreQuery(store).sql(
        "SELECT domain, doc, count(*) AS n, count(entropy) AS e FROM rows GROUP BY ALL"
    )
    assert set(frame["domain"]) == {"python", ""}
    assert (frame["e"] * 2 == frame["n"]).all()  # per-token confidence on the rank-0 row (k = 2)


def test_report_checkpoints_prints_a_timeline(tmp_path, capsys):
    series = ",".join(str(SERIES / name) for name in ("step-00000", "step-00100", "step-01000"))
    store = tmp_path / "store"
    code = main(["report", "--checkpoints", series, "--corpus", str(eval_dir()), "--store", str(store),
                 "--batch-size", "8", "--chunk-tokens", "128", "--max-batches", "3"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "router saturation vs final" in out and "first checkpoint past a collapse threshold" in out
    final_line = next(line for line in out.splitlines() if line.startswith("step-01000"))
    assert final_line.split()[1:] == ["1.000"] * 4
    assert [r.checkpoint for r in list_runs(store)] == ["step-00000", "step-00100", "step-01000"]
    code = main(["report", "--checkpoints", str(SERIES / "step-00000"), "--corpus", str(eval_dir())])
    assert code == 2


def test_report_and_trace_read_a_jsonl_corpus_as_its_folder(tmp_path, capsys):
    """One corpus reader: the same documents as a folder and as JSONL give the same report and the same
    stored rows."""
    docs = [("code", "def f(x):\n    return x + 1\n" * 12), ("prose", "The cat sat on the mat. " * 20)]
    folder = tmp_path / "folder"
    for domain, text in docs:
        (folder / domain).mkdir(parents=True)
        (folder / domain / "a.txt").write_text(text)
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text, "domain": domain}) + "\n" for domain, text in docs))
    reports, rows = [], []
    for corpus in (folder, jsonl):
        args = ["--model", "sample:mixtral-healthy", "--corpus", str(corpus), "--chunk-tokens", "64"]
        assert main(["report", *args, "--format", "json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
        store = tmp_path / f"store-{corpus.stem}"
        assert main(["trace", *args, "--out", str(store), "--quiet"]) == 0
        assert "complete" in capsys.readouterr().out
        rows.append(_rows(store))
    assert reports[0] == reports[1] and reports[0]["tokens"] > 100
    assert len(rows[0]) > 0 and rows[0].equals(rows[1])
    assert set(rows[0]["domain"]) == {"code", "prose"}
