"""The Attention page at scale (Streamlit AppTest, a random DeepSeek-V3-shaped model: 61 attention layers)
summarises only the layers its head grid shows, and the window the grid moves to when asked; the head map's
own layer is summarised for its metrics. Counted by wrapping `AttentionCapture.token_statistics` (a call
that finds its statistics cached computes nothing and is not counted)."""

from __future__ import annotations

import pytest

from moeviz.attention import AttentionCapture
from tests.support.app import app_test_env, run_page
from tests.support.scale_models import SHAPES, with_tokenizer

PROMPT = "Attention at scale: which of the sixty-one layers does the page summarise when it opens?"


@pytest.fixture
def computed(tiny_model_dir, monkeypatch) -> list[int]:
    """The layers whose statistics are computed (not found cached), in call order, on the app's default
    model: the DeepSeek-V3 shape."""
    folder = with_tokenizer(tiny_model_dir("deepseek_v3", **SHAPES["deepseek-v3"]))
    app_test_env(monkeypatch)
    monkeypatch.setenv("MOEVIZ_DEFAULT_MODEL", str(folder))
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(folder.parent))
    layers: list[int] = []
    real = AttentionCapture.token_statistics

    def counted(self, layer, window, global_tokens, geometry=None):
        if not self.has_statistics(layer, window, global_tokens):
            layers.append(int(layer))
        return real(self, layer, window, global_tokens, geometry)

    monkeypatch.setattr(AttentionCapture, "token_statistics", counted)
    return layers


def grid_layers(at) -> set[int]:
    """The layers of the head grid's entropy heatmap."""
    import pyarrow as pa

    chart = next(c for c in at.get("vega_lite_chart") if "Entropy (nats)" in c.proto.spec)
    (dataset,) = chart.proto.datasets
    return {int(row["layer"]) for row in pa.ipc.open_stream(dataset.data.data).read_all().to_pylist()}


def test_attention_page_summarises_only_the_layers_shown(computed: list[int]) -> None:
    at = run_page("pages/attention.py", timeout_s=300, prompt=PROMPT)
    slider = at.select_slider(key="attention_grid_from")
    layers = list(range(61))  # every block of this shape has softmax attention
    window = len(layers) - len(slider.options) + 1
    shown = layers[:window]
    assert window < len(layers)
    # the grid's layers, each computed once for the grid and once for the KV what-if (its own window), and
    # nothing else (the map's layer 0 is among them)
    assert sorted(computed) == sorted(shown * 2)
    assert grid_layers(at) == set(shown)
    # the KV what-if (another window and global size: statistics of their own) covers the same layers
    computed.clear()
    slider.set_value(layers[20]).run()
    assert not at.exception
    assert sorted(computed) == sorted(layers[20 : 20 + window] * 2), computed
    assert grid_layers(at) == set(layers[20 : 20 + window])
