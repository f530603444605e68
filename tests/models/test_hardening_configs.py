"""Hostile config.json files are refused with one ModelSourceError line naming the field, before transformers
reads the config (its strict validation raised tracebacks: a string, float, boolean or null for an integer
field, a string `rope_parameters`, 10^5-deep JSON, a zero or negative context length); what transformers
still refuses is put into one such line; a FIFO config.json is "not a regular file", not a missing one; a
good config still loads the same weights transformers itself loads."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import moeviz
from moeviz import cli
from moeviz.errors import InvalidConfigError, ModelSourceError, NotAModelFolderError

DEEP = 100_000


def _config(**changes):
    def damage(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))

    return damage


def _raw(text: str):
    return lambda folder: (folder / "config.json").write_text(text)


def _deep_field(folder: Path) -> None:
    config = (folder / "config.json").read_text().rstrip().removesuffix("}")
    (folder / "config.json").write_text(config + ', "extra": ' + "[" * DEEP + "]" * DEEP + "}")


# name: (damage, the line's expected text: the field and the value as the file spells it)
HOSTILE = {
    "layers as a string": (_config(num_hidden_layers="2"), r'num_hidden_layers must be .* got "2"'),
    "layers as a float": (_config(num_hidden_layers=2.0), r"num_hidden_layers .* got 2\.0 \(a float\)"),
    "layers as a fraction": (_config(num_hidden_layers=2.5), r"num_hidden_layers .* got 2\.5"),
    "layers as a boolean": (_config(num_hidden_layers=True), r"num_hidden_layers .* got true \(a boolean\)"),
    "layers null": (_config(num_hidden_layers=None), r"num_hidden_layers must be a positive .* got null"),
    "hidden_size null": (_config(hidden_size=None), r"hidden_size must be a positive integer, got null"),
    "vocab_size as a float": (_config(vocab_size=128.0), r"vocab_size .* got 128\.0"),
    "heads as a string": (_config(num_attention_heads="4"), r'num_attention_heads .* got "4"'),
    "kv heads null": (_config(num_key_value_heads=None), r"num_key_value_heads .* got null"),
    "experts as a string": (_config(num_local_experts="8"), r'num_local_experts .* got "8"'),
    "experts null": (_config(num_local_experts=None), r"num_local_experts .* got null"),
    "top-k as a boolean": (_config(num_experts_per_tok=True), r"num_experts_per_tok .* got true"),
    "top-k null": (_config(num_experts_per_tok=None), r"num_experts_per_tok .* got null"),
    "context 0": (_config(max_position_embeddings=0), r"max_position_embeddings .* got 0$"),
    "context -1": (_config(max_position_embeddings=-1), r"max_position_embeddings .* got -1$"),
    "context as a string": (_config(max_position_embeddings="64"), r'max_position_embeddings .* got "64"'),
    "head_dim -1": (_config(head_dim=-1), r"head_dim must be an integer >= 0, got -1"),
    "rope_parameters a string": (_config(rope_parameters="abc"), r'rope_parameters must be an .*"abc"'),
    "rope_parameters a list": (_config(rope_parameters=[1, 2]), r"rope_parameters must be an .*\[1, 2\]"),
    "rope_theta a string": (
        _config(rope_parameters={"rope_type": "default", "rope_theta": "x"}),
        r'rope_parameters\.rope_theta must be a finite number, got "x"',
    ),
    "model_type a number": (_config(model_type=5), r"model_type must be a string, got 5"),
    "architectures a number": (_config(architectures=5), r"architectures must be a list of class names"),
    "a sub-config's size": (_config(text_config={"hidden_size": "x"}), r'text_config\.hidden_size .*"x"'),
    "10^5 nested arrays": (_raw("[" * DEEP + "]" * DEEP), r"nests deeper than 32 levels"),
    "10^5 nested arrays in a field": (_deep_field, r"nests deeper than 32 levels"),
}  # fmt: skip
# Fields moeviz does not check itself: transformers' strict validation refuses them, in one line.
REFUSED_BY_TRANSFORMERS = {
    "rms_norm_eps a string": (_config(rms_norm_eps="x"), "rms_norm_eps", "expected float, got str"),
    "tie_word_embeddings a string": (
        _config(tie_word_embeddings="yes"),
        "tie_word_embeddings",
        "expected bool",
    ),
}


@pytest.fixture
def copy_of_tiny(tiny_model_dir, tmp_path):
    def make(damage) -> Path:
        folder = shutil.copytree(tiny_model_dir("mixtral"), tmp_path / "m")
        damage(folder)
        return folder

    return make


@pytest.fixture
def transformers_never_reads_the_config(monkeypatch):
    """AutoConfig.from_pretrained and the config classes' from_dict fail the test if called."""
    from transformers import AutoConfig, PretrainedConfig

    def called(*args, **kwargs):
        raise AssertionError("transformers read the config before moeviz refused it")

    monkeypatch.setattr(AutoConfig, "from_pretrained", called)
    monkeypatch.setattr(PretrainedConfig, "from_dict", called)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_config_is_one_line_naming_the_field_before_transformers(
    copy_of_tiny, name, transformers_never_reads_the_config
):
    damage, expected = HOSTILE[name]
    with pytest.raises(InvalidConfigError, match=expected) as info:
        moeviz.load_model(copy_of_tiny(damage))
    assert "\n" not in str(info.value)
    assert "/config.json" in str(info.value)


@pytest.mark.parametrize("name", list(REFUSED_BY_TRANSFORMERS))
def test_what_transformers_refuses_is_one_line_naming_the_field(copy_of_tiny, name):
    damage, field, cause = REFUSED_BY_TRANSFORMERS[name]
    with pytest.raises(ModelSourceError) as info:
        moeviz.load_model(copy_of_tiny(damage))
    message = str(info.value)
    assert "\n" not in message and f"field '{field}'" in message and cause in message, message


@pytest.mark.parametrize("name", ["layers as a string", "10^5 nested arrays", "rope_parameters a string"])
def test_hostile_config_exits_2_with_one_line(copy_of_tiny, name, tmp_path, capsys):
    folder = copy_of_tiny(HOSTILE[name][0])
    capsys.readouterr()  # building the tiny model (the first time in this worker) writes a progress bar
    args = ["capture", "--model", str(folder), "--token-ids", "3,4,5", "--out", str(tmp_path / "t.parquet")]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("moeviz capture")]  # the progress bar
    assert len(lines) == 1 and lines[0].startswith("moeviz: error:"), err
    assert "Traceback" not in err


def test_fifo_config_is_not_a_regular_file_not_a_missing_one(copy_of_tiny):
    """A FIFO named config.json is there: the message says what it is (nothing opens it: it would block)."""
    folder = copy_of_tiny(lambda f: (f / "config.json").unlink())
    os.mkfifo(folder / "config.json")
    with pytest.raises(NotAModelFolderError, match=r"config\.json is not a regular file") as info:
        moeviz.load_model(folder)
    assert "no config.json" not in str(info.value)


def test_config_over_the_size_limit_is_refused_unread(copy_of_tiny, monkeypatch):
    from moeviz.models import config_check

    monkeypatch.setattr(config_check, "CONFIG_MAX_BYTES", 1000)
    folder = copy_of_tiny(_config(padding="x" * 2000))
    with pytest.raises(InvalidConfigError, match=r"config\.json is 0\.0 MiB; a model config is under"):
        moeviz.load_model(folder)


def test_good_config_loads_what_transformers_loads(tiny_model_dir):
    """The checks refuse nothing real: the tiny model loads through moeviz with the very tensors
    transformers' own from_pretrained reads from the folder, and computes the same logits."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("mixtral")
    loaded = moeviz.load_model(folder, dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True
    ).eval()
    ours, theirs = loaded.model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, reference(ids).logits)


def test_every_sample_config_passes_the_checks():
    """The bundled samples' configs (and their series' checkpoints) pass, as transformers reads them."""
    from moeviz.models.checks import read_config
    from moeviz.models.loading import list_samples, sample_models_dir

    names = list_samples()
    assert names
    for name in names:
        config = read_config(sample_models_dir() / name, trust_remote_code=False)
        raw = json.loads((sample_models_dir() / name / "config.json").read_text())
        assert config.num_hidden_layers == raw["num_hidden_layers"]
