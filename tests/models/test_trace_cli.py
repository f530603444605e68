"""`moeviz trace` and `moeviz report` in-process on the sample: bad corpora, a JSONL corpus with domains and
per-token confidence (checked against the router's own scores), one corpus reader for folders and JSONL,
`moeviz report --checkpoints` on the sample series. A real signal to a running trace, and the resume after
it: tests/system/test_cli_process.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import moeviz
from moeviz.cli import main
from moeviz.samples import eval_dir
from moeviz.store import StoreQuery, list_runs

REPO = Path(__file__).resolve().parents[2]
SERIES = REPO / "sample_models" / "mixtral-healthy-series"


def _rows(store: Path):
    return StoreQuery(store).sql(
        "SELECT batch, doc, domain, seq, pos, token_id, layer, rank, expert, weight, score, lse FROM rows "
        "ORDER BY seq, pos, layer, rank"
    )


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
    """Each JSONL line is a document with its domain ("" without one); --confidence stores, on rank-0 rows,
    each token's router entropy and top-k margin, here recomputed from the softmax of the router logits of
    an in-process capture of each document."""
    texts = ["def f(x):\n    return x + 1\n", "In the beginning God created the heaven and the earth."]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        json.dumps({"text": texts[0], "domain": "python"}) + "\n" + json.dumps({"text": texts[1]})
    )
    store = tmp_path / "store"
    assert main(["trace", "--model", "sample:mixtral-healthy", "--corpus", str(corpus), "--out", str(store),
                 "--quiet", "--confidence"]) == 0  # fmt: skip
    frame = StoreQuery(store).sql(
        "SELECT domain, doc, count(*) AS n, count(entropy) AS e FROM rows GROUP BY ALL"
    )
    assert set(frame["domain"]) == {"python", ""}
    assert (frame["e"] * 2 == frame["n"]).all()  # per-token confidence on the rank-0 row (k = 2)
    stored = StoreQuery(store).sql(
        "SELECT doc, pos, token_id, layer, entropy, margin FROM rows WHERE rank = 0 ORDER BY doc, pos, layer"
    )
    loaded = moeviz.load_model("sample:mixtral-healthy")
    for doc, text in enumerate(texts):
        trace = moeviz.capture(loaded, text)
        for routing in trace.layers:
            rows = stored[(stored["doc"] == doc) & (stored["layer"] == routing.layer)]
            assert rows["token_id"].tolist() == trace.tokens.token_id.iloc[routing.token_rows].tolist()
            logits = routing.logits.astype(np.float64)
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            ranked = -np.sort(-p, axis=1)
            entropy = -(p * np.log(p)).sum(axis=1)
            margin = (ranked[:, 1] - ranked[:, 2]) / ranked[:, 1]  # (p_k - p_k+1) / p_k, k = 2
            np.testing.assert_allclose(rows["entropy"], entropy, atol=1e-5)
            np.testing.assert_allclose(rows["margin"], margin, atol=1e-5)


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
