"""The Learn page's fine-tuning step (Streamlit AppTest) on the run shipped in sample_models/finetune-modes:
its curves are the shipped numbers, its table's verdicts follow the Lab's rule recomputed here by hand from
the shipped curves and balance, and its "what to notice" line follows the data (a copy of the run with one
mode's numbers changed changes the line and the table); a missing run leaves the step with a message, and
a link to the step opens it with a snippet that reads the same run."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from moeviz.models.loading import sample_models_dir
from tests.support.app import APP, open_snippets, run_page
from tests.support.learn import PAGE, _app_env, chart_rows  # noqa: F401  (_app_env: an autouse fixture)

SHIPPED = sample_models_dir() / "finetune-modes"
LABELS = {"router": "router only", "experts": "experts only", "lora": "LoRA", "full": "full"}


def notice(at: AppTest) -> str:
    (line,) = [i.value for i in at.info if "What to notice" in i.value]
    return line


def shipped_copy(tmp_path, monkeypatch) -> tuple:
    """A sample folder whose finetune-modes is a copy (the models linked), set as MOEVIZ_SAMPLE_MODELS →
    (the copy's finetune-modes folder, its curves, its balance)."""
    root = tmp_path / "samples"
    root.mkdir()
    for entry in sample_models_dir().iterdir():
        if entry.name != "finetune-modes":
            (root / entry.name).symlink_to(entry)
    folder = root / "finetune-modes"
    shutil.copytree(SHIPPED, folder)
    monkeypatch.setenv("MOEVIZ_SAMPLE_MODELS", str(root))
    return folder, pd.read_parquet(folder / "curves.parquet"), pd.read_parquet(folder / "balance.parquet")


def verdicts_by_hand(curves: pd.DataFrame, balance: pd.DataFrame, meta: dict) -> dict[str, tuple]:
    """{label: (adapted, forgot, kept balance)} from the first and last evaluated step of each mode: the new
    loss fell by ≥ adapted_drop, the old rose by > forgot_rise, no layer's max share rose by more than
    balance_slack / E."""
    t, out = meta["thresholds"], {}
    for mode, rows in curves.groupby("mode"):
        rows = rows.dropna(subset=["new_loss"]).sort_values("step")
        first, last = rows.iloc[0], rows.iloc[-1]
        layers = balance[balance["mode"] == mode]
        before = layers[layers["step"] == first["step"]].sort_values("layer")["max_share"].to_numpy()
        after = layers[layers["step"] == last["step"]].sort_values("layer")["max_share"].to_numpy()
        out[LABELS[mode]] = (
            "yes" if first["new_loss"] - last["new_loss"] >= t["adapted_drop"] else "no",
            "yes" if last["old_loss"] - first["old_loss"] > t["forgot_rise"] else "no",
            "yes" if np.all(after - before <= t["balance_slack"] / meta["experts"]) else "no",
        )
    return out


def table_verdicts(at: AppTest) -> dict[str, tuple]:
    (table,) = [t.value for t in at.dataframe if "adapted" in t.value.columns]
    return {r["mode"]: (r["adapted"], r["forgot"], r["kept balance"]) for r in table.to_dict("records")}


def test_the_step_draws_the_shipped_curves_and_the_labs_verdicts() -> None:
    curves = pd.read_parquet(SHIPPED / "curves.parquet")
    balance = pd.read_parquet(SHIPPED / "balance.parquet")
    meta = json.loads((SHIPPED / "run.json").read_text())
    at = run_page(PAGE, learn_step="finetune")
    assert [h.value for h in at.subheader if h.value.startswith("8 ·")], [h.value for h in at.subheader]
    line = notice(at)
    for title, metric in (("New-domain loss", "new_loss"), ("Router mismatch", "router_mismatch")):
        rows = chart_rows(at, title).sort_values(["run", "step"]).reset_index(drop=True)
        expected = (
            curves.assign(run=curves["mode"].map(LABELS))
            .dropna(subset=[metric])
            .sort_values(["run", "step"])
            .reset_index(drop=True)
        )
        assert rows["run"].tolist() == expected["run"].tolist()
        np.testing.assert_array_equal(rows["step"], expected["step"])
        np.testing.assert_array_equal(rows["value"], expected[metric])
    verdicts = verdicts_by_hand(curves, balance, meta)
    assert table_verdicts(at) == verdicts
    # the notice names each mode with its own numbers: (new-domain change / old-domain change)
    for mode, label in LABELS.items():
        rows = curves[curves["mode"] == mode].sort_values("step")
        new = rows["new_loss"].iloc[-1] - rows["new_loss"].iloc[0]
        old = rows["old_loss"].iloc[-1] - rows["old_loss"].iloc[0]
        shown = f"{label} ({new:+.3f} / {old:+.3f})".replace("-", "−")
        assert shown in line or shown[0].upper() + shown[1:] in line, (shown, line)
    if all(kept == "yes" for *_, kept in verdicts.values()):
        assert "Every mode kept the load balanced" in line


def test_the_notice_and_the_table_follow_the_shipped_numbers(tmp_path, monkeypatch) -> None:
    folder, curves, balance = shipped_copy(tmp_path, monkeypatch)
    before = run_page(PAGE, learn_step="finetune")
    line = notice(before)
    assert table_verdicts(before)["router only"][0] == "no" and "router only (" in line
    assert "barely moved either loss" in line and "Every mode kept the load balanced" in line
    # router only's new-domain loss now falls by 0.1 nats at its last step; full's layer 0 overloads
    last = curves["step"].max()
    router_end = (curves["mode"] == "router") & (curves["step"] == last)
    first_loss = curves.loc[(curves["mode"] == "router") & (curves["step"] == 0), "new_loss"].iloc[0]
    curves.loc[router_end, "new_loss"] = first_loss - 0.1
    curves.to_parquet(folder / "curves.parquet", index=False)
    full_end = (balance["mode"] == "full") & (balance["step"] == last) & (balance["layer"] == 0)
    balance.loc[full_end, "max_share"] = 0.6
    balance.to_parquet(folder / "balance.parquet", index=False)

    after = run_page(PAGE, learn_step="finetune")
    line = notice(after)
    verdicts = table_verdicts(after)
    assert verdicts["router only"][0] == "yes" and verdicts["full"][2] == "no"
    assert "router only (−0.100 / " in line and "Every mode kept the load balanced" not in line
    assert "Full lost balance" in line and "→ 60.0%" in line
    meta = json.loads((folder / "run.json").read_text())
    assert verdicts == verdicts_by_hand(curves, balance, meta)


def test_a_missing_run_leaves_a_message_and_the_other_steps(tmp_path, monkeypatch) -> None:
    folder, *_ = shipped_copy(tmp_path, monkeypatch)
    (folder / "curves.parquet").unlink()
    at = run_page(PAGE, learn_step="finetune")
    assert any("scripts/samples/finetune_modes.py" in i.value for i in at.info)
    assert not at.get("vega_lite_chart") and not [i for i in at.info if "What to notice" in i.value]
    at.button(key="learn_next").click().run()
    assert at.session_state["learn_step"] == "deployment" and not at.exception


def test_a_link_to_the_step_opens_it_and_its_snippet_reads_the_same_run() -> None:
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.query_params.update({"step": "finetune"})
    at.switch_page(PAGE).run()
    assert not at.exception and at.session_state["learn_step"] == "finetune"
    [code] = [c.value for c in open_snippets(at).code]
    names: dict = {}
    exec(compile(code, "<snippet>", "exec"), names)
    pd.testing.assert_frame_equal(names["curves"], pd.read_parquet(SHIPPED / "curves.parquet"))
    summary = names["summary"].set_index("mode")  # the label; "run" holds the key
    assert {run: (r["adapted"], r["forgot"], r["kept balance"]) for run, r in summary.iterrows()} == (
        table_verdicts(at)
    )
    at.button(key="learn_next").click().run()  # the URL follows the step bar
    assert str(at.query_params["step"]).strip("[]'") == "deployment"


@pytest.mark.parametrize("projector", [False, True])
def test_the_step_renders_in_both_layouts(projector: bool) -> None:
    """On a projector the notice keeps its first sentence (which modes adapted, which forgot) and the
    caption goes behind "Details"; otherwise both are shown whole."""
    at = run_page(PAGE, learn_step="finetune", projector_layout=projector)
    assert len(at.get("vega_lite_chart")) == 4
    line = notice(at)
    assert "adapted" in line and ("routing decisions" in line) != projector
    captions = [c.value for c in at.caption if "Recipe:" in c.value]
    in_details = [e for e in at.expander if e.label == "Details" and e.caption]
    assert (bool(in_details) and bool(captions)) if projector else (captions and not in_details)
