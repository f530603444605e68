"""The model picker's "Adapter folder" (Advanced): a LoRA adapter over the sidebar's model, checked against
the model folders' allowlist, and what the About page shows of it (Streamlit AppTest)."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.support.adapters import save_adapter
from tests.support.app import APP, local_tiny_model, run_page


@pytest.fixture
def model_and_adapter(tiny_model_dir, monkeypatch, tmp_path):
    folder = local_tiny_model(tiny_model_dir, monkeypatch, "qwen3_moe")
    adapter = save_adapter(tmp_path / "lora", vocab_size=2048)  # tmp_path lies inside the allowed root
    return folder, adapter


def test_about_shows_what_the_adapter_targets(model_and_adapter) -> None:
    import moeviz
    from moeviz.models.adapters import AdapterInfo

    folder, adapter = model_and_adapter
    at = run_page("pages/about.py", load_adapter=str(adapter))
    metrics = {m.label: m.value for m in at.metric}
    info = AdapterInfo.from_json(moeviz.load_model(folder, adapter=adapter).info.adapter)
    assert metrics["Rank r"] == str(info.rank) and metrics["Alpha"] == f"{info.alpha:g}"
    assert metrics["Modules adapted"] == str(len(info.adapted))
    caption = " ".join(c.value for c in at.caption)
    assert "parameters mlp.experts.down_proj, mlp.experts.gate_up_proj, mlp.gate.weight" in caption
    assert "modules q_proj, v_proj" in caption and "2 router" in caption and "2 experts" in caption


def test_an_adapter_outside_the_allowed_folders_is_a_message(model_and_adapter, monkeypatch) -> None:
    folder, adapter = model_and_adapter
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(folder))  # the model's folder only: the adapter lies outside
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["load_adapter"] = str(adapter)
    at.switch_page("pages/about.py").run()
    assert not at.exception, [e.value for e in at.exception]
    (error,) = [e.value for e in at.error]
    assert "outside the model folders this server may open" in error
