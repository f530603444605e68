"""Capture the example prompt with each bundled sample model as the app does and write its routing to
sample_models/examples/ (`moeviz.models.bundled_examples`): the app's first page on a new install is
drawn from it.

Run it after a sample's files, the example prompt, the trace format or the pinned torch or transformers
change: tests/models/test_bundled_examples.py fails until then. `--check` writes nothing and exits 1 when a
bundled example is missing, was made from other files or versions, or differs from what the code captures
now.

    .venv/bin/python scripts/samples/bundle_examples.py [--check]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One thread: the suite's summation order (tests/conftest.py), the same on every machine of one vector width;
# more threads split sums differently (3.5e-7 apart in a logit measured between 1 and 2 here).
os.environ["OMP_NUM_THREADS"] = "1"
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "app"))  # the app's capture, exactly: components.trace_cache (no Streamlit)

from components.trace_cache import capture_for_app  # noqa: E402

import moeviz  # noqa: E402
from moeviz.models.bundled_examples import bundle_trace, bundled_trace  # noqa: E402
from moeviz.models.sources import SAMPLE_PREFIX, list_samples, resolve_source  # noqa: E402
from moeviz.samples import EXAMPLE_PROMPT  # noqa: E402


def bundled_samples() -> list[str]:
    """The samples the app can open on: the top-level folders (a series' checkpoints are not bundled)."""
    return [name for name in list_samples() if "/" not in name]


def captured_now(source: str) -> moeviz.Trace:
    """The app's capture of the example prompt by `source`, routing only (what it keeps)."""
    return dataclasses.replace(capture_for_app(moeviz.load_model(source), EXAMPLE_PROMPT), attention=None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args()
    os.environ.pop("MOEVIZ_CACHE_DIR", None)  # keeping on: `bundled_trace` reads only then
    stale = []
    for name in bundled_samples():
        source = SAMPLE_PREFIX + name
        folder = resolve_source(source)
        trace = captured_now(source)
        if args.check:
            shipped = bundled_trace(folder, EXAMPLE_PROMPT, options=source)
            same = shipped is not None and shipped.routing_frame().equals(trace.routing_frame())
            print(f"{name}: {'up to date' if same else 'missing or stale'}")
            stale += [] if same else [name]
        else:
            print(f"{name}: {bundle_trace(folder, EXAMPLE_PROMPT, source, trace).relative_to(REPO)}")
    if stale:
        script = Path(__file__).relative_to(REPO)
        print(f"run `python {script}` to bundle: {', '.join(stale)}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
