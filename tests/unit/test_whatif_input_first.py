"""`moeviz whatif` refuses an unusable prompt (an empty --text, an oversized or missing --text-file, empty
--token-ids) before it loads the model, as `moeviz capture` does: the model is never loaded (the loader
fails the test if called), and a model folder that does not exist is not what the message is about."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeviz import cli

SIMULATORS = {
    "ep": ["--gpus", "2", "--gpus-per-node", "2"],
    "offload": ["--cache", "2"],
    "capacity": [],
    "quant": [],
}


@pytest.fixture
def loader_fails(monkeypatch):
    import moeviz.models
    import moeviz.models.loading

    def called(*args, **kwargs):
        raise AssertionError("the model was loaded before the prompt was checked")

    monkeypatch.setattr(moeviz.models, "load_model", called)
    monkeypatch.setattr(moeviz.models.loading, "load_model", called)


def _big_file(tmp_path: Path) -> Path:
    path = tmp_path / "big.txt"
    with path.open("wb") as handle:
        handle.truncate(50 * 10**6)  # 50 MB, sparse: nothing is written
    return path


def _prompts(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """name: (the prompt flags, the message's expected text)"""
    return {
        "empty --text": (["--text", "   "], "--text is empty"),
        "50 MB --text-file": (["--text-file", str(_big_file(tmp_path))], "MiB, over the 16 MiB limit"),
        "missing --text-file": (["--text-file", str(tmp_path / "nope.txt")], "does not exist"),
        "empty --token-ids": (["--token-ids", ","], "--token-ids is empty"),
    }


@pytest.mark.parametrize("simulator", list(SIMULATORS))
@pytest.mark.parametrize(
    "prompt", ["empty --text", "50 MB --text-file", "missing --text-file", "empty --token-ids"]
)
def test_prompt_is_refused_before_the_model_loads(simulator, prompt, tmp_path, capsys, loader_fails):
    flags, expected = _prompts(tmp_path)[prompt]
    missing_model = str(tmp_path / "no-such-model")
    args = ["whatif", simulator, "--model", missing_model, *flags, *SIMULATORS[simulator]]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("moeviz whatif")]  # a progress bar
    assert len(lines) == 1 and lines[0].startswith("moeviz: error:"), err
    assert expected in lines[0] and "no-such-model" not in lines[0], lines[0]


def test_a_sample_with_an_empty_prompt_is_refused_unloaded(capsys, loader_fails):
    assert cli.main(["whatif", "capacity", "--model", "sample:mixtral-healthy", "--text", ""]) == 2
    assert "--text is empty" in capsys.readouterr().err
