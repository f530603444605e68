"""Bundled example traces (`moeviz.models.bundled_examples`) on a sample folder of their own: one reads back
bit for bit under the key it was written with, its key follows the files' content (not their times), the text,
the options, the versions and the machine, and anything else — another folder, keeping turned off, a damaged
file or manifest — reads as nothing bundled, never as an error, leaving the package's files in place."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from moeviz.models import bundled_examples as bundled
from tests.support.traces import assert_traces_equal, make_trace, random_layer

TEXT = "The example."
OPTIONS = "sample:tiny"


@pytest.fixture
def samples(tmp_path, monkeypatch):
    """A sample-models folder with one sample, `tiny`, and keeping on."""
    root = tmp_path / "samples"
    (root / "tiny").mkdir(parents=True)
    (root / "tiny" / "config.json").write_text('{"model_type": "mixtral"}')
    (root / "tiny" / "model.safetensors").write_bytes(b"\0" * 64)
    monkeypatch.setenv("MOEVIZ_SAMPLE_MODELS", str(root))
    monkeypatch.setenv("MOEVIZ_CACHE_DIR", str(tmp_path / "cache"))
    return root


def _trace():
    rng = np.random.default_rng(0)
    return make_trace([random_layer(rng, 12, 8, 2) for _ in range(3)])


def test_a_bundled_trace_reads_back_bitwise_under_its_key(samples):
    trace = _trace()
    path = bundled.bundle_trace(samples / "tiny", TEXT, OPTIONS, trace)
    assert path == samples / "examples" / "tiny.parquet"
    assert_traces_equal(bundled.bundled_trace(samples / "tiny", TEXT, OPTIONS), trace)
    entry = json.loads((samples / "examples" / "manifest.json").read_text())["tiny"]
    assert entry["key"] == bundled.content_key(samples / "tiny", TEXT, OPTIONS)
    assert [name for name, _, _ in entry["facts"]["files"]] == ["config.json", "model.safetensors"]
    assert not [p for p in (samples / "examples").iterdir() if p.name.startswith(".")]  # no partial left


def test_the_key_follows_the_content_not_the_times(samples):
    bundled.bundle_trace(samples / "tiny", TEXT, OPTIONS, _trace())
    weights = samples / "tiny" / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a fresh clone: new times, same bytes
    assert bundled.bundled_trace(samples / "tiny", TEXT, OPTIONS) is not None
    weights.write_bytes(b"\1" + b"\0" * 63)  # the same size, other bytes
    assert bundled.bundled_trace(samples / "tiny", TEXT, OPTIONS) is None


@pytest.mark.parametrize("other", ["text", "options", "versions", "machine"])
def test_another_text_options_version_or_machine_reads_as_none(samples, monkeypatch, other):
    bundled.bundle_trace(samples / "tiny", TEXT, OPTIONS, _trace())
    text, options = TEXT, OPTIONS
    if other == "text":
        text = TEXT + " "
    elif other == "options":
        options = OPTIONS + ' ⚙ {"dtype": "bfloat16"}'  # the app's model key of a bfloat16 load
    elif other == "versions":
        monkeypatch.setattr(bundled, "installed", lambda name: "0.0.1")
    else:
        monkeypatch.setattr(bundled.platform, "machine", lambda: "arm64")
    assert bundled.bundled_trace(samples / "tiny", text, options) is None


def test_only_a_sample_folder_with_keeping_on_reads_one(samples, tmp_path, monkeypatch):
    bundled.bundle_trace(samples / "tiny", TEXT, OPTIONS, _trace())
    elsewhere = tmp_path / "tiny"  # the same name and files, not in the samples folder
    elsewhere.mkdir()
    for path in (samples / "tiny").iterdir():
        (elsewhere / path.name).write_bytes(path.read_bytes())
    assert bundled.bundled_trace(elsewhere, TEXT, OPTIONS) is None
    with pytest.raises(ValueError, match="not a bundled sample model"):
        bundled.bundle_trace(elsewhere, TEXT, OPTIONS, _trace())
    monkeypatch.setenv("MOEVIZ_CACHE_DIR", "")  # keeping turned off: every example captured
    assert bundled.bundled_trace(samples / "tiny", TEXT, OPTIONS) is None


@pytest.mark.parametrize("damaged", ["parquet", "manifest", "entry"])
def test_a_damaged_file_or_manifest_reads_as_none_and_stays(samples, damaged):
    bundled.bundle_trace(samples / "tiny", TEXT, OPTIONS, _trace())
    target = samples / "examples" / ("tiny.parquet" if damaged == "parquet" else "manifest.json")
    if damaged == "entry":
        target.write_text(json.dumps({"tiny": ["not", "an", "entry"]}))
    else:
        target.write_bytes(target.read_bytes()[:100])
    assert bundled.bundled_trace(samples / "tiny", TEXT, OPTIONS) is None
    assert target.exists()
