"""Where the pages start at scale, and what About says of a DeepSeek-V3-shaped model (Streamlit AppTest on a
small random model of that shape: 256 experts, top-8 within the best 4 of 8 groups, routed scaling 2.5, a
dense first block), each against the library's own capture of the same text:

- the Why page opens on the prompt's last token and that token's top choice, also after a new prompt or
  after the Routing page's own start on the first token, and keeps a token picked there;
- Routing and Structure open on the layer's busiest expert where the kept one is not the user's choice on
  this model (a dead expert 0 kept from another model), follow the layer with a default, and keep a hand
  choice;
- About shows the group limit and the routed scaling factor per layer, and says that its active count holds
  the input embedding;
- the small ones: the predicted-token metric has no arrow ("↑ same"), dead-expert axes print 0 as "0", the
  binned overview says tokens and bins, not cells.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.support.app import local_tiny_model, run_page
from tests.support.scale_models import SHAPES

TIMEOUT_S = 300
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home."
NEW_TEXT = "Completely different words arrive here now, with another ending!"
# DeepSeek-V3's routing (256 experts, 8 groups, top-8, scaling 2.5), 3 MoE blocks after one dense block
SHAPE = {key: value for key, value in SHAPES["deepseek-v3"].items() if key != "vocab_size"}
SHAPE |= dict(num_hidden_layers=4, first_k_dense_replace=1, routed_scaling_factor=2.5)


@pytest.fixture
def folder(tiny_model_dir, monkeypatch):
    """The DeepSeek-V3-shaped model, the app's default model (a local folder)."""
    return local_tiny_model(tiny_model_dir, monkeypatch, "deepseek_v3", **SHAPE)


def _ok(at) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _capture(folder, text: str):
    import moeviz

    return moeviz.capture(moeviz.load_model(str(folder)), text)


def _top_choice(trace, layer: int, pos: int) -> int:
    """The token's dispatched expert with the largest combination weight at `layer`, from the trace."""
    routing = trace.layer(layer)
    row = list(routing.token_rows).index(int(trace.tokens.index[trace.tokens["pos"] == pos][0]))
    experts, weights = routing.experts[row], routing.weights[row]
    return int(experts[np.argmax(np.where(experts >= 0, weights, -np.inf))])


def _counts(trace, layer: int) -> np.ndarray:
    """Tokens per expert at `layer` (a token counts once per expert it uses)."""
    routing = trace.layer(layer)
    experts = routing.experts[routing.experts >= 0]
    return np.bincount(experts, minlength=routing.num_experts)


def _busiest(trace, layer: int) -> int:
    return int(np.argmax(_counts(trace, layer)))  # ties: the lowest id, as the picker's order has it


def _last_label(trace) -> str:
    from moeviz.charts import token_label

    last = trace.tokens.iloc[-1]
    return token_label(int(last["pos"]), last["token"])


def _submit(at, text: str) -> None:
    at.text_area(key="routing_prompt").input(text)
    (button,) = [b for b in at.get("form_submit_button") if b.label == "Analyse"]
    button.click().run()
    _ok(at)


# ---- where the pickers start ------------------------------------------------------------------------------
def test_why_opens_on_the_last_token_and_its_top_choice_also_after_a_new_prompt(folder) -> None:
    at = run_page("pages/why.py", timeout_s=TIMEOUT_S, prompt=TEXT)
    layer = int(at.select_slider(key="layer_widget").value)
    trace = _capture(folder, TEXT)
    assert at.selectbox(key="token_widget").value == _last_label(trace)
    top = _top_choice(trace, layer, int(trace.tokens["pos"].iloc[-1]))
    assert top != _busiest(trace, layer)  # the layer's busiest would be another expert: the case under test
    assert at.selectbox(key="expert_widget").value == top

    _submit(at, NEW_TEXT)  # the kept token is not among the new prompt's: the last one, not the first
    trace = _capture(folder, NEW_TEXT)
    assert at.selectbox(key="token_widget").value == _last_label(trace)
    expert = at.selectbox(key="expert_widget").value
    assert expert == _top_choice(trace, layer, int(trace.tokens["pos"].iloc[-1]))
    assert _counts(trace, layer)[expert] > 0


def test_why_after_routing_opens_on_the_last_token_unless_one_was_picked_there(folder) -> None:
    trace = _capture(folder, TEXT)
    at = run_page("pages/routing.py", timeout_s=TIMEOUT_S, prompt=TEXT)
    first = at.selectbox(key="token_widget").value  # Routing's own start: the window's first token
    assert first == at.selectbox(key="token_widget").options[0]
    at.switch_page("pages/why.py").run()
    _ok(at)
    assert at.selectbox(key="token_widget").value == _last_label(trace)  # not Routing's start

    at.switch_page("pages/routing.py").run()
    picked = at.selectbox(key="token_widget").options[3]  # picked by hand on Routing: Why keeps it
    at.selectbox(key="token_widget").set_value(picked).run()
    at.switch_page("pages/why.py").run()
    _ok(at)
    assert at.selectbox(key="token_widget").value == picked
    layer = int(at.select_slider(key="layer_widget").value)
    assert at.selectbox(key="expert_widget").value == _top_choice(trace, layer, 3)


@pytest.mark.parametrize("page", ["routing", "structure"])
@pytest.mark.parametrize("chosen_on", [None, "sample:mixtral-healthy"])
def test_a_dead_expert_kept_from_elsewhere_gives_way_to_the_layers_busiest(folder, page, chosen_on) -> None:
    trace = _capture(folder, TEXT)
    layer = trace.layer_keys[0][1]  # where the layer picker starts
    dead = int(np.flatnonzero(_counts(trace, layer) == 0)[0])
    # kept with no word of where it was chosen, or chosen by hand on another model (an 8-expert sample)
    state = {"prompt": TEXT, "expert": dead}
    if chosen_on is not None:
        state["expert_default"] = (chosen_on, dead, False)
    at = run_page(f"pages/{page}.py", timeout_s=TIMEOUT_S, **state)
    assert at.selectbox(key="expert_widget").value == _busiest(trace, layer)


def test_a_default_follows_the_layer_and_a_hand_choice_stays(folder) -> None:
    trace = _capture(folder, TEXT)
    (_, first), (_, second) = trace.layer_keys[:2]
    assert _busiest(trace, first) != _busiest(trace, second)  # else following the layer shows nothing
    at = run_page("pages/routing.py", timeout_s=TIMEOUT_S, prompt=TEXT)
    assert at.selectbox(key="expert_widget").value == _busiest(trace, first)
    at.select_slider(key="layer_widget").set_value(str(second)).run()
    _ok(at)
    assert at.selectbox(key="expert_widget").value == _busiest(trace, second)  # the default moved on

    mine = int(np.argsort(-_counts(trace, second), kind="stable")[3])  # the fourth busiest, by hand
    at.selectbox(key="expert_widget").set_value(mine).run()
    at.select_slider(key="layer_widget").set_value(str(first)).run()
    _ok(at)
    assert at.selectbox(key="expert_widget").value == mine
    for page in ("structure", "why"):  # and on every page of this model
        at.switch_page(f"pages/{page}.py").run()
        _ok(at)
        assert at.selectbox(key="expert_widget").value == mine


# ---- About ----------------------------------------------------------------------------------------------
def test_about_shows_the_group_limit_and_the_routed_scaling_of_each_layer(folder) -> None:
    config = json.loads((folder / "config.json").read_text())
    at = run_page("pages/about.py", timeout_s=TIMEOUT_S)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Group limit"] == f"best {config['topk_group']} of {config['n_group']} groups"
    assert metrics["Routed scaling"] == f"× {config['routed_scaling_factor']:g}"
    assert metrics["Dense layers"] == ", ".join(map(str, range(config["first_k_dense_replace"])))
    (facts,) = [d.value for d in at.dataframe if "selection" in d.value.columns]
    moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
    assert len(facts) == moe_layers
    assert facts["n_group"].astype(int).eq(config["n_group"]).all()
    assert facts["topk_group"].astype(int).eq(config["topk_group"]).all()
    np.testing.assert_allclose(facts["routed_scaling"].astype(float), config["routed_scaling_factor"])


def test_about_says_that_the_active_count_holds_the_input_embedding(folder) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert not config.get("tie_word_embeddings")  # an input embedding of its own
    embedding = config["vocab_size"] * config["hidden_size"]
    at = run_page("pages/about.py", timeout_s=TIMEOUT_S)
    active = int({m.label: m.value for m in at.metric}["Active per token"].replace(",", ""))
    (line,) = [
        c.value for c in at.caption if c.value.startswith("Active per token counts the input embedding")
    ]
    assert f"({embedding:,} parameters)" in line and f"without it, {active - embedding:,}." in line


# ---- the small ones ---------------------------------------------------------------------------------------
def test_the_predicted_token_metric_has_no_arrow(folder) -> None:
    from streamlit.proto.Metric_pb2 import Metric

    at = run_page("pages/why.py", timeout_s=TIMEOUT_S, prompt=TEXT)
    at.button(key="why_whatif").click().run()
    _ok(at)
    (metric,) = [m for m in at.metric if m.label == "Predicted next token"]
    assert str(metric.proto.delta) in ("same", "changed")  # a word: no arrow claims it rose
    assert metric.proto.direction == Metric.MetricDirection.NONE


def test_dead_expert_axes_print_zero_as_zero() -> None:
    """Every expert used (0 dead everywhere) made a degenerate axis whose one tick the browser printed as
    "0.000000" (the screenshot check); each dead-expert axis now names a format that prints 0 as "0"."""
    import pandas as pd

    from moeviz.charts.checkpoints import balance_timeline_chart
    from moeviz.charts.lab import lab_metric_chart
    from moeviz.charts.load import balance_chart

    history = pd.DataFrame({"step": range(0, 50, 10), "dead_experts_window_sum": [0] * 5})
    balance = pd.DataFrame({"site": "mlp", "layer": range(3), "experts": 8, "dead_fraction": [0.0] * 3})
    timeline = balance.assign(checkpoint=["a", "b", "c"], order=range(3))
    charts = [
        (lab_metric_chart(history, "dead_experts_window_sum"), "d"),  # whole numbers
        (balance_chart(balance, "dead_fraction"), "~g"),  # trimmed: 0, 0.25, never 0.000000
        (balance_timeline_chart(timeline, "dead_fraction"), "~g"),
    ]
    for chart, expected in charts:
        layers = chart.to_dict()["layer"]
        axes = [
            layer["encoding"]["y"].get("axis", {})
            for layer in layers
            if "y" in layer.get("encoding", {}) and "field" in layer["encoding"]["y"]
        ]
        assert axes and axes[0].get("format") == expected, axes


def test_the_binned_overview_says_tokens_and_bins_not_cells(folder) -> None:
    text = " ".join([TEXT] * 6)  # over the 64-token window at scale: the overview is binned
    trace = _capture(folder, text)
    tokens = len(trace.tokens)
    assert tokens > 64
    at = run_page("pages/routing.py", timeout_s=TIMEOUT_S, prompt=text)
    (chart,) = [c for c in at.get("vega_lite_chart") if "Dispatch over the whole input" in c.proto.spec]
    size = math.ceil(tokens / 50)  # the page's 50 bins at scale
    bins = math.ceil(tokens / size)
    from components.expert_axis import TOP_N  # the axis lists the top-N, the chosen (busiest) among them

    subtitle = json.loads(chart.proto.spec)["title"]["subtitle"]
    assert subtitle.startswith(
        f"{tokens:,} tokens in {bins} bins of {size} · the {TOP_N} busiest experts and "
    )
