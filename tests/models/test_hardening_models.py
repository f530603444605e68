"""Damaged or hostile model folders are refused with one clear line: the library raises a
`ModelSourceError` naming what is wrong, the CLI exits 2 with one line on stderr and no traceback, and
nothing blocks or runs for minutes. A FIFO as the weights, in a subprocess:
tests/system/test_fifo_weights.py."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

import moeviz
from moeviz import cli
from moeviz.errors import CorruptWeightsError, InvalidConfigError, ModelSourceError


def _split(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _write(path: Path, header: dict | list | bytes, body: bytes, length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + body)


def _edit_header(folder: Path, edit) -> None:
    weights = folder / "model.safetensors"
    header, body = _split(weights)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    edit(header, names, len(body))
    _write(weights, header, body)


def _overlap(header, names, size):
    same = [n for n in names if header[n]["shape"] == header[names[0]]["shape"]]
    header[same[1]]["data_offsets"] = list(header[same[0]]["data_offsets"])


def _past_end(header, names, size):
    start, end = header[names[-1]]["data_offsets"]
    header[names[-1]]["data_offsets"] = [size + 8, size + 8 + end - start]


def _huge_shape(header, names, size):
    header[names[0]]["shape"] = [10**12, 10**12]


def _unknown_dtype(header, names, size):
    header[names[0]]["dtype"] = "F128"


def _entry_not_dict(header, names, size):
    header[names[0]] = 5


def _raw_weights(raw: bytes, length: int | None = None):
    def damage(folder: Path) -> None:
        _write(folder / "model.safetensors", raw, b"\0" * 64, length)

    return damage


def _header_edit(edit):
    return lambda folder: _edit_header(folder, edit)


def _config(**changes):
    def damage(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))

    return damage


def _text(name: str, text: str):
    return lambda folder: (folder / name).write_text(text)


DAMAGES = {
    "overlapping offsets": (_header_edit(_overlap), "overlap"),
    "offsets past the end": (_header_edit(_past_end), "past the end of the file"),
    "shape and span disagree": (_header_edit(_huge_shape), r"shape \[1000000000000, 1000000000000\]"),
    "unknown dtype": (_header_edit(_unknown_dtype), "unknown dtype 'F128'"),
    "entry not a dict": (_header_edit(_entry_not_dict), "malformed header entry"),
    "header not a dict": (_raw_weights(b"[1, 2, 3]"), "header is not a JSON object"),
    "header not JSON": (_raw_weights(b"{garbage header}"), "corrupt header"),
    "header length too large": (_raw_weights(b"{}", length=2**62), "header length invalid"),
    "tokenizer.json malformed": (_text("tokenizer.json", "{not json"), "tokenizer"),
    "config.json not JSON": (_text("config.json", "{not json"), "not valid JSON"),
    "config.json not a dict": (_text("config.json", "[1, 2]"), "not a JSON object"),
    "hidden_size 0": (_config(hidden_size=0), "hidden_size must be a positive integer, got 0"),
    "negative intermediate_size": (_config(intermediate_size=-4), "intermediate_size must be a positive"),
    "top-k 0": (_config(num_experts_per_tok=0), r"top-k \(num_experts_per_tok\) must be 1 … 8 .*got 0"),
    "top-k above E": (_config(num_experts_per_tok=9), r"must be 1 … 8 .*got 9"),
    "no experts": (_config(num_local_experts=0), "num_local_experts must be a positive integer, got 0"),
    "more experts than the weights": (_config(num_local_experts=64), "64 experts .* weights hold 8"),
}


@pytest.fixture
def damaged(tiny_model_dir, tmp_path):
    """`damaged(name)` → a copy of the tiny Mixtral with damage `name` applied."""

    def make(name: str) -> Path:
        folder = shutil.copytree(tiny_model_dir("mixtral"), tmp_path / "m")
        DAMAGES[name][0](folder)
        return folder

    return make


@pytest.mark.parametrize("name", list(DAMAGES))
def test_damaged_folder_is_a_model_source_error(damaged, name):
    with pytest.raises(ModelSourceError, match=DAMAGES[name][1]) as info:
        moeviz.load_model(damaged(name))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", list(DAMAGES))
def test_damaged_folder_exits_2_with_one_line(damaged, name, tmp_path, capsys):
    folder = damaged(name)
    capsys.readouterr()  # building the tiny model (the first time in this worker) writes a progress bar
    args = ["capture", "--model", str(folder), "--token-ids", "3,4,5", "--out", str(tmp_path / "t.parquet")]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("moeviz capture")]  # the progress bar
    assert len(lines) == 1 and lines[0].startswith("moeviz: error:"), err
    assert "Traceback" not in err


def test_header_bytes_of_a_non_model_file_are_never_echoed(tiny_model_dir, tmp_path):
    """A secret file in place of the weights: the message must not carry its first 8 bytes."""
    folder = shutil.copytree(tiny_model_dir("mixtral"), tmp_path / "m")
    secret = b"hunter2-SECRET-TOKEN\n"
    (folder / "model.safetensors").write_bytes(secret)
    with pytest.raises(CorruptWeightsError, match="not a safetensors file: header length invalid") as info:
        moeviz.load_model(folder)
    leaked = str(struct.unpack("<Q", secret[:8])[0])
    assert leaked not in str(info.value) and "hunter2" not in str(info.value)


def test_tokenizer_of_a_sample_still_loads(tmp_path):
    """The tokenizer wrapping does not refuse a good tokenizer."""
    from tokenizers import Tokenizer

    from moeviz.models.loading import sample_models_dir

    loaded = moeviz.load_model("sample:mixtral-healthy")
    text = "In the beginning God created the heaven and the earth."
    # the same ids as the tokenizer file read directly (special tokens aside)
    plain = (
        Tokenizer.from_file(str(sample_models_dir() / "mixtral-healthy" / "tokenizer.json"))
        .encode(text, add_special_tokens=False)
        .ids
    )
    assert loaded.tokenizer(text, add_special_tokens=False)["input_ids"] == plain
    assert loaded.tokenizer.decode(plain).strip() == text


def test_index_shard_outside_the_folder_is_refused(tiny_model_dir, tmp_path):
    """A shard index may only name files of the folder itself (no `../`, no absolute paths)."""
    folder = shutil.copytree(tiny_model_dir("mixtral"), tmp_path / "m")
    outside = tmp_path / "outside.safetensors"
    shutil.copy(folder / "model.safetensors", outside)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    header, _ = _split(folder / "model-00001-of-00001.safetensors")
    weight_map = {k: "../outside.safetensors" for k in header if k != "__metadata__"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CorruptWeightsError, match=r"model\.safetensors\.index\.json names shard"):
        moeviz.load_model(folder)


def test_config_with_100000_layers_is_refused_before_building_the_model(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Building a skeleton of 100,000 layers would take minutes: the config is checked against the weights'
    headers first, and the model is never built."""
    from moeviz.models import loading

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the config was checked against the weights")

    monkeypatch.setattr(loading, "_plan", refuse)
    folder = shutil.copytree(tiny_model_dir("mixtral"), tmp_path / "m")
    _config(num_hidden_layers=100_000)(folder)
    with pytest.raises(InvalidConfigError, match="declares 100000 layers but the weights hold 2"):
        moeviz.load_model(folder)


def test_a_load_parses_each_header_once_and_sees_an_in_place_edit(tiny_model_dir, tmp_path):
    from moeviz.models import safetensors_headers

    folder = shutil.copytree(tiny_model_dir("mixtral"), tmp_path / "m")
    safetensors_headers._parse_header.cache_clear()
    moeviz.load_model(folder, progress=lambda done, total: None)  # as the app and CLI load (with progress)
    info = safetensors_headers._parse_header.cache_info()
    assert info.misses == len(list(folder.glob("*.safetensors")))  # one parse per file ...
    assert info.hits >= 1  # ... however many times the load reads it (validation, progress)
    # The same file rewritten in place at the same size (same inode, maybe the same mtime tick) is reread.
    _edit_header(folder, _overlap)
    with pytest.raises(ModelSourceError, match="overlap"):
        moeviz.load_model(folder)
