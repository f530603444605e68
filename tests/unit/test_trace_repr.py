"""A Trace's notebook view (`Trace._repr_html_`): its facts are the trace's own, read back from the HTML and
compared with the trace's tables, and nothing a model name or a token holds is rendered as markup."""

from __future__ import annotations

import dataclasses
from html.parser import HTMLParser

import numpy as np

from moeviz.trace import LayerRouting, ModelInfo, Trace
from moeviz.trace.records import absent
from tests.support.traces import make_tokens, routed_layer

SCRIPT = "<script>alert('x')</script>"


class _Cells(HTMLParser):
    """The table rows (th text → td text), the <code> texts and every start tag of an HTML fragment."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, str] = {}
        self.codes: list[str] = []
        self.tags: list[str] = []
        self._open: str | None = None
        self._key = ""
        self._text = ""

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append(tag)
        if tag in ("th", "td", "code"):
            self._open, self._text = tag, ""

    def handle_data(self, data) -> None:
        if self._open:
            self._text += data

    def handle_endtag(self, tag) -> None:
        if tag != self._open:
            return
        if tag == "th":
            self._key = self._text
        elif tag == "td":
            self.rows[self._key] = self._text
        else:
            self.codes.append(self._text)
        self._open = None


def parse(trace: Trace) -> _Cells:
    cells = _Cells()
    cells.feed(trace._repr_html_())
    return cells


def two_sequence_trace(source: str = SCRIPT) -> Trace:
    """Two sequences (5 and 3 tokens, one token an HTML tag), two top-2 softmax layers of 6 experts."""
    tokens = make_tokens([5, 3])
    tokens.loc[1, "token"] = SCRIPT
    rng = np.random.default_rng(0)
    layers = [routed_layer(rng.normal(size=(8, 6)), 2, layer=layer) for layer in (1, 3)]
    info = ModelInfo(source=source, model_type="mixtral", architecture="MixtralForCausalLM", num_layers=4)
    return Trace(model=info, tokens=tokens, layers=layers)


def test_the_view_states_the_traces_own_facts() -> None:
    trace = two_sequence_trace()
    rows = parse(trace).rows
    assert rows["model"] == trace.model.source
    assert rows["tokens"] == str(len(trace.tokens))
    assert rows["sequences"] == str(trace.tokens["seq"].nunique())
    assert rows["MoE layers"] == f"{len(trace.layers)} (blocks 1–3)"
    assert rows["experts"] == str(trace.layers[0].logits.shape[1])
    assert rows["k"] == str(trace.layers[0].experts.shape[1])
    assert rows["score function"] == "softmax"
    assert rows["routing from"] == "capture (dispatch)"
    assert rows["router logits"] == "yes" and rows["combination weights"] == "yes"
    assert rows["attention"] == "not captured"


def test_markup_in_a_model_name_or_a_token_is_text_not_html() -> None:
    trace = two_sequence_trace()
    html = trace._repr_html_()
    assert "<script" not in html
    cells = parse(trace)
    assert "script" not in cells.tags
    assert cells.rows["model"] == SCRIPT  # shown as written, escaped
    first = trace.tokens[trace.tokens["seq"] == 0]["token"].tolist()
    assert cells.codes == first  # the first sequence's tokens, the tag among them as text


def test_an_engine_import_says_so_and_what_it_lacks() -> None:
    trace = two_sequence_trace("a <b>model</b>")
    imported: list[LayerRouting] = []
    for i, routing in enumerate(trace.layers):
        n, e = routing.logits.shape
        imported.append(
            dataclasses.replace(
                routing,
                logits=absent(n, e) if i == 0 else routing.logits,
                has_logits=i != 0,
                decision_source="vllm-routed" if i == 0 else "dispatch",
            )
        )
    rows = parse(dataclasses.replace(trace, layers=imported)).rows
    assert rows["routing from"] == "capture (dispatch), engine import (vllm-routed)"
    assert rows["router logits"] == "1 of 2 layers"
    assert rows["model"] == "a <b>model</b>"


def test_layers_that_differ_list_each_value_and_a_long_sequence_is_cut() -> None:
    tokens = make_tokens([40])
    rng = np.random.default_rng(1)
    layers = [
        routed_layer(rng.normal(size=(40, 4)), 1, layer=0),
        routed_layer(rng.normal(size=(40, 8)), 2, layer=1, score_fn="sigmoid"),
    ]
    info = ModelInfo(source="m", model_type="t", architecture="A", num_layers=2)
    cells = parse(Trace(model=info, tokens=tokens, layers=layers))
    assert cells.rows["experts"] == "4, 8" and cells.rows["k"] == "1, 2"
    assert cells.rows["score function"] == "softmax, sigmoid"
    assert len(cells.codes) < len(tokens) and cells.codes == tokens["token"].head(len(cells.codes)).tolist()


def test_an_empty_trace_has_a_view() -> None:
    info = ModelInfo(source="m", model_type="t", architecture="A", num_layers=0)
    empty = Trace(model=info, tokens=make_tokens([]).astype({"token": str}), layers=[])
    rows = parse(empty).rows
    assert rows["tokens"] == "0" and rows["MoE layers"] == "0" and rows["routing from"] == "–"
    assert rows["experts"] == "–"
