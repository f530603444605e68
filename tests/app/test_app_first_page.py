"""A new server's first page: on a new install it draws the example routing bundled with the sample
(`moeviz.models.bundled_examples`); for a model without one, the first run captures the example prompt and
keeps its routing on disk (`moeviz.trace.kept`), and a later server draws from that file. Both without torch
or transformers, with the same charts a capture draws: here they cannot be imported at all, and only the
token's attention row, which waits for them, fails. Each "server" is a fresh Python process running the
app once (AppTest): the pytest process has torch."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.app import APP, APP_DIR, REPO

RUN_ONCE = """
import json, sys
import pyarrow as pa
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers'):
            raise ImportError(name + ' is blocked by the test')
if sys.argv[2] == "no-torch":
    sys.meta_path.insert(0, NoTorch())
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(sys.argv[1], default_timeout=120).run()
charts = []
for chart in at.get("vega_lite_chart"):  # its spec (datasets named by position, not content) and rows
    spec, rows = chart.proto.spec, []
    for i, dataset in enumerate(chart.proto.datasets):
        spec = spec.replace(dataset.name, f"dataset-{i}")
        rows.append(pa.ipc.open_stream(dataset.data.data).read_all().to_pylist())
    charts.append([spec, rows])
print(json.dumps({
    "exceptions": [e.value for e in at.exception],
    "errors": [e.value for e in at.error],
    "captions": [c.value for c in at.caption],
    "charts": charts,
    "torch": "torch" in sys.modules,
    "transformers": "transformers" in sys.modules,
}))
"""


def run_app_once(cache_dir, torch: str, samples=None) -> dict:
    """The app's first run in a new process: keeping in `cache_dir` ("" off), the sample models of `samples`
    (None: the repository's), torch importable or not (`torch` "torch" or "no-torch")."""
    env = {**os.environ, "MOEVIZ_CACHE_DIR": str(cache_dir), "PYTHONPATH": f"{APP_DIR}{os.pathsep}{REPO}"}
    for name in ("MOEVIZ_MODEL_DIRS", "MOEVIZ_DEFAULT_MODEL", "MOEVIZ_SAMPLE_MODELS"):
        env.pop(name, None)
    if samples is not None:
        env["MOEVIZ_SAMPLE_MODELS"] = str(samples)
    done = subprocess.run(
        [sys.executable, "-c", RUN_ONCE, str(APP), torch],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["errors"], result
    return result


@pytest.fixture
def unbundled(tmp_path):
    """The default sample and the evaluation slices without a bundled example (a model of the user's)."""
    root = tmp_path / "samples"
    for name in ("mixtral-healthy", "eval"):
        shutil.copytree(REPO / "sample_models" / name, root / name)
    return root


def same(a, b, rel: float = 0.0, abs_: float = 0.0) -> bool:
    """Whether two of `run_app_once`'s values are equal, floats within `rel` and `abs_` (NaN equal to NaN)."""
    if isinstance(a, float) and isinstance(b, (float, int)):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=abs_)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y, rel, abs_) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], rel, abs_) for k in a)
    return a == b


def attention_row(charts: list) -> list:
    (attention,) = [c for c in charts if "Attention of" in c[0]]
    return attention


def test_a_new_install_draws_the_bundled_example_without_torch(tmp_path):
    captured = run_app_once("", "torch")  # keeping off: nothing read from disk, the example captured
    assert captured["torch"] and captured["transformers"]
    cache = tmp_path / "cache"
    bundled = run_app_once(cache, "no-torch")
    assert not bundled["torch"] and not bundled["transformers"]
    # every chart but the attention row: the same specs and data, the scores within float32's rounding
    # (the bundled file was captured on another machine, maybe of another vector width)
    attention = attention_row(captured["charts"])
    assert same(bundled["charts"], [c for c in captured["charts"] if c is not attention], 1e-5, 1e-6)
    assert bundled["exceptions"] == ["torch is blocked by the test"]  # the row, waiting for the import
    assert not (cache / "traces").exists()  # read from the package, nothing kept


def test_a_new_server_draws_the_kept_example_without_torch(tmp_path, unbundled):
    cache = tmp_path / "cache"
    first = run_app_once(cache, "torch", unbundled)  # nothing kept yet: loads the sample, captures, keeps
    assert not first["exceptions"]
    assert first["torch"] and first["transformers"]
    (kept,) = (cache / "traces").iterdir()
    assert kept.suffix == ".parquet"

    later = run_app_once(cache, "no-torch", unbundled)
    assert not later["torch"] and not later["transformers"]
    # every chart but the attention row, the same specs and data, bit for bit (kept on this machine)
    attention = attention_row(first["charts"])
    assert same(later["charts"], [c for c in first["charts"] if c is not attention])
    assert later["exceptions"] == ["torch is blocked by the test"]  # the row, waiting for the import
    assert [p.name for p in (cache / "traces").iterdir()] == [kept.name]  # read, not written again


def test_an_edited_model_is_captured_again(tmp_path, unbundled):
    """A kept file is for the model folder's files as they were: after one changes (the sample's config
    touched), the next server captures again, under another key, instead of drawing the old file."""
    cache = tmp_path / "cache"
    run_app_once(cache, "torch", unbundled)
    (first,) = (cache / "traces").iterdir()
    os.utime(first, ns=(0, 0))  # older than the next one
    config = unbundled / "mixtral-healthy" / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000))  # the model "changed"
    second = run_app_once(cache, "torch", unbundled)
    assert second["torch"]  # captured again
    assert len(list((cache / "traces").iterdir())) == 2
