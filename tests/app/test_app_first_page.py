"""A new server's first page: the first run captures the example prompt and keeps its routing on disk
(`moeviz.trace.kept`); a later server draws the Routing page from that file without torch or transformers,
with the same charts a capture draws: here they cannot be imported at all, and only the token's attention
row, which waits for them, fails. Each "server" is a fresh Python process running the app once (AppTest):
the pytest process has torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.app import APP, APP_DIR, REPO

RUN_ONCE = """
import hashlib, json, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers'):
            raise ImportError(name + ' is blocked by the test')
if sys.argv[2] == "no-torch":
    sys.meta_path.insert(0, NoTorch())
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(sys.argv[1], default_timeout=120).run()
charts = [
    [c.proto.spec, [hashlib.sha256(d.data.data).hexdigest() for d in c.proto.datasets]]
    for c in at.get("vega_lite_chart")
]
print(json.dumps({
    "exceptions": [e.value for e in at.exception],
    "errors": [e.value for e in at.error],
    "captions": [c.value for c in at.caption],
    "charts": charts,
    "torch": "torch" in sys.modules,
    "transformers": "transformers" in sys.modules,
}))
"""


def run_app_once(cache_dir, torch: str) -> dict:
    env = {**os.environ, "MOEVIZ_CACHE_DIR": str(cache_dir), "PYTHONPATH": f"{APP_DIR}{os.pathsep}{REPO}"}
    for name in ("MOEVIZ_MODEL_DIRS", "MOEVIZ_DEFAULT_MODEL"):
        env.pop(name, None)
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


def test_a_new_server_draws_the_kept_example_without_torch(tmp_path):
    cache = tmp_path / "cache"
    first = run_app_once(cache, "torch")  # nothing kept yet: loads the sample, captures, keeps
    assert not first["exceptions"]
    assert first["torch"] and first["transformers"]
    (kept,) = (cache / "traces").iterdir()
    assert kept.suffix == ".parquet"

    later = run_app_once(cache, "no-torch")
    assert not later["torch"] and not later["transformers"]
    # every chart but the attention row, the same specs and data, bytewise
    (attention,) = [c for c in first["charts"] if "Attention of" in c[0]]
    assert later["charts"] == [c for c in first["charts"] if c is not attention]
    assert later["exceptions"] == ["torch is blocked by the test"]  # the row, waiting for the import
    assert [p.name for p in (cache / "traces").iterdir()] == [kept.name]  # read, not written again


def test_an_edited_model_is_captured_again(tmp_path):
    """A kept file is for the model folder's files as they were: after one changes (the sample's config
    touched), the next server captures again, under another key, instead of drawing the old file."""
    cache = tmp_path / "cache"
    run_app_once(cache, "torch")
    (first,) = (cache / "traces").iterdir()
    os.utime(first, ns=(0, 0))  # older than the next one
    config = REPO / "sample_models" / "mixtral-healthy" / "config.json"
    stat = config.stat()
    try:
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000))  # the model "changed"
        second = run_app_once(cache, "torch")
    finally:
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert second["torch"]  # captured again
    assert len(list((cache / "traces").iterdir())) == 2
