"""A fine-tune's checkpoint series of PEFT adapters (`checkpoint-<step>/` with adapter_config.json, as the HF
Trainer saves them every N steps) in the checkpoint timeline (`moeviz.store.checkpoints`): each adapter merged
into the base given, the base alone as step 0 ("base").

Oracle: the same adapters merged by peft itself (`PeftModel.from_pretrained(...).merge_and_unload()`), saved
as full checkpoint folders and put through the full-checkpoint timeline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from moeviz.errors import CheckpointSeriesError, InputError, ModelSourceError
from moeviz.models.adapters import AdapterInfo
from moeviz.models.loading import sample_models_dir
from moeviz.store import StoreQuery, TraceSettings
from moeviz.store.checkpoints import (
    BASE_LABEL,
    CheckpointTimeline,
    adapter_series_base,
    checkpoint_timeline,
    plan_series,
    resolve_series,
    write_series,
)
from tests.support.adapters import adapter_run_fixtures, merge_as_full_checkpoint, save_adapter_series

STEPS = [5, 10, 20]  # by name, checkpoint-10 < checkpoint-20 < checkpoint-5: the order must be numeric
LABELS = [BASE_LABEL, "checkpoint-5", "checkpoint-10", "checkpoint-20"]
SETTINGS = TraceSettings(batch_size=2, chunk_tokens=64, max_batches=2)
FRAMES = ("saturation", "collapse", "drift", "specialisation", "crossings")
ATOL = 1e-6  # both paths merge the same float32 tensors; summation order may differ in the last bit


base, run = adapter_run_fixtures(STEPS, "/elsewhere/models/mixtral-healthy")


def test_adapter_series_timeline_equals_the_merged_full_checkpoints(run, base, corpus, tmp_path):
    name, checkpoints = resolve_series(run, base)
    assert name == "run" and [label for label, _ in checkpoints] == LABELS
    assert checkpoints[0][1] == base and [p.name for _, p in checkpoints[1:]] == LABELS[1:]

    store = tmp_path / "adapters"
    write_series(run, corpus, store, base=base, settings=SETTINGS, progress=False, dtype="float32")
    adapters = checkpoint_timeline(store, model=name)

    full = tmp_path / "full"
    folders = [Path(shutil.copytree(base, full / BASE_LABEL))]
    folders += [merge_as_full_checkpoint(base, run / label, full / label) for label in LABELS[1:]]
    write_series(folders, corpus, tmp_path / "full-store", model=name, settings=SETTINGS, progress=False)
    merged = checkpoint_timeline(tmp_path / "full-store", model=name)

    assert adapters.checkpoints == merged.checkpoints == LABELS
    for frame in FRAMES:
        pd.testing.assert_frame_equal(
            getattr(adapters, frame), getattr(merged, frame), check_exact=False, rtol=0, atol=ATOL, obj=frame
        )
    _assert_routing_moves(adapters)

    runs = {r.checkpoint: r for r in StoreQuery(store, model=name).runs}
    assert "adapter" not in runs[BASE_LABEL].config  # the base alone
    for label in LABELS[1:]:
        info = AdapterInfo.from_json(runs[label].config["adapter"])
        assert Path(info.path) == run / label and info.base_model == "/elsewhere/models/mixtral-healthy"
        assert runs[label].config["source"] == str(base)


def _assert_routing_moves(timeline: CheckpointTimeline) -> None:
    """The comparison is not vacuous: the adapters change the routing, more at later steps."""
    sat = timeline.saturation.groupby("order")["saturation_topk"].mean()
    assert sat.is_monotonic_increasing and sat.iloc[0] < 0.95 and sat.iloc[-1] == 1.0


def test_a_series_of_adapters_takes_the_base_they_declare_when_it_is_here(tmp_path, base):
    save_adapter_series(tmp_path / "run", base, [2, 4])  # peft records the folder the base loaded from
    assert adapter_series_base(tmp_path / "run") == str(base)
    series = plan_series(tmp_path / "run")
    assert series.base == base
    assert series.load_args(tmp_path / "run" / "checkpoint-4") == {
        "source": base,
        "adapter": tmp_path / "run" / "checkpoint-4",
    }
    assert series.load_args(base) == {"source": base}
    _, without = resolve_series(tmp_path / "run", with_base=False)
    assert [label for label, _ in without] == ["checkpoint-2", "checkpoint-4"]
    # given as A,B: in the order given, not by step
    given = f"{tmp_path / 'run' / 'checkpoint-4'},{tmp_path / 'run' / 'checkpoint-2'}"
    assert [label for label, _ in resolve_series(given)[1]] == [BASE_LABEL, "checkpoint-4", "checkpoint-2"]
    full = sample_models_dir() / "mixtral-healthy-series"
    assert adapter_series_base(full) is None and plan_series(full).base is None


def _refused(spec, base=None, match: str = "", error_class: type = CheckpointSeriesError) -> str:
    """The one-line message of the refusal (a CheckpointSeriesError is an InputError, as before)."""
    assert issubclass(CheckpointSeriesError, InputError)
    with pytest.raises(error_class, match=match) as error:
        resolve_series(spec, base)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_series_that_are_not_one_fine_tune_are_refused(tmp_path, run, base):
    # the declared base is not here and none is given
    _refused(run, None, r"'/elsewhere/models/mixtral-healthy', not a model folder here: give the base")
    # full checkpoints and adapters in one folder, or in one list
    mixed = tmp_path / "mixed"
    shutil.copytree(run / "checkpoint-5", mixed / "checkpoint-5")
    shutil.copytree(sample_models_dir() / "mixtral-healthy-series" / "step-00010", mixed / "step-00010")
    _refused(mixed, base, "holds full checkpoints .* and adapters")
    _refused(f"{mixed / 'step-00010'},{mixed / 'checkpoint-5'}", base, "mixes adapters")
    # adapters of different bases, even with a base given
    other = tmp_path / "other"
    shutil.copytree(run / "checkpoint-5", other / "checkpoint-5")
    shutil.copytree(run / "checkpoint-10", other / "checkpoint-10")
    config = other / "checkpoint-10" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": "org/other"}))
    message = _refused(other, base, "different bases")
    assert "org/other" in message and "mixtral-healthy" in message
    # a base for a series of full checkpoints; an adapter given as the base; an adapter folder with no step
    _refused(sample_models_dir() / "mixtral-healthy-series", base, "only to a series of adapters")
    _refused(run, run / "checkpoint-5", "it has no config.json", ModelSourceError)
    shutil.copytree(run / "checkpoint-5", other / "final")
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": str(base)}))
    _refused(other, base, "'final' has no step number")
    # one adapter folder is not a series
    _refused(run / "checkpoint-5", base, "one adapter, not a series", InputError)


def test_checkpoints_command_takes_the_base_of_an_adapter_series(run, corpus, capsys):
    from moeviz.cli import main

    args = ["checkpoints", str(run), "--corpus", str(corpus), "--max-batches", "1", "--chunk-tokens", "64"]
    assert main([*args, "--base", "sample:mixtral-healthy", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpoints"] == LABELS and out["model"] == "run"
    assert main(args) == 2
    assert "give the base model" in capsys.readouterr().err


def test_the_pages_snippet_traces_the_adapters_over_the_base(run, base):
    """The Checkpoints page's reproducible Python (`snippets.checkpoints_view(..., base=)`) runs and loads
    each adapter over the base: the same checkpoints, and each adapter recorded in its run."""
    from moeviz import snippets

    namespace: dict = {}
    code = snippets.checkpoints_view(str(run), windows=1, window_tokens=64, base="sample:mixtral-healthy")
    exec(compile(code, "<snippet>", "exec"), namespace)
    assert namespace["timeline"].checkpoints == LABELS
    runs = {r.checkpoint: r for r in StoreQuery(namespace["store"], model=namespace["name"]).runs}
    assert Path(AdapterInfo.from_json(runs["checkpoint-20"].config["adapter"]).path) == run / "checkpoint-20"
    _assert_routing_moves(namespace["timeline"])
