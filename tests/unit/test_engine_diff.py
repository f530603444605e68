"""Engine diff (moeviz.analysis.engine_diff) on hand-made routings whose answers are known, and the `moeviz
diff` command on trace files (no model): identical → 0, one flipped slot → 1/(T·L), Jaccard, sets vs
slot order, dropped slots, alignment by ids and by position, the refusals, margins, positions, KL/TV and
the log-prob gap. The same on sample models, and the replay: tests/models/test_engine_diff_models.py."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from moeviz.analysis.engine_diff import engine_diff, logprob_gap, set_overlap
from moeviz.errors import InputError
from moeviz.trace.records import absent
from tests.support.cli import run_cli
from tests.support.traces import make_layer, make_trace, random_sets


def _copy(trace):
    """An independent copy (new arrays): the diff must not rely on object identity."""
    layers = [
        dataclasses.replace(
            r, experts=r.experts.copy(), logits=r.logits.copy(), token_rows=r.token_rows.copy()
        )
        for r in trace.layers
    ]
    return dataclasses.replace(trace, tokens=trace.tokens.copy(), layers=layers)


def _imported(layer, ranked=True):
    """The layer as an engine import holds it: no logits, no weights."""
    n = len(layer.token_rows)
    return dataclasses.replace(
        layer,
        logits=absent(n, layer.num_experts),
        weights=absent(n, layer.k),
        has_logits=False,
        has_weights=False,
        ranked=ranked,
        decision_source="vllm-routed",
    )


def _random_trace(seed=0, tokens=12, layers=3, experts=8, k=2):
    rng = np.random.default_rng(seed)
    return make_trace([random_sets(rng, tokens, experts, k) for _ in range(layers)], experts)


# ---- known answers -----------------------------------------------------------------------------------------
def test_identical_routings_give_exactly_zero_and_say_so():
    a = _random_trace()
    d = engine_diff(a, _copy(a))
    assert d.identical and not d.nondeterministic and d.same_source
    assert d.mismatched == 0 and d.router_mismatch == 0.0 and d.top1_mismatch == 0.0 and d.jaccard == 1.0
    assert d.tokens_any_layer == 0.0 and d.routers_per_token_mean == 0.0
    assert (d.layers[["router_mismatch", "top1_mismatch", "kl", "tv"]].to_numpy() == 0).all()
    assert d.differing_frame().empty
    assert d.tokens == 12 and d.pairs == 36 and d.aligned_by == "token_ids"


def test_one_flipped_slot_is_one_over_tokens_times_layers():
    t, n_layers, e = 5, 3, 8
    experts = [np.array([[0, 1], [2, 3], [4, 5], [6, 7], [1, 2]]) for _ in range(n_layers)]
    a = make_trace(experts, e)
    flipped = [x.copy() for x in experts]
    flipped[1][3, 1] = 0  # token 3, layer 1: {6, 7} -> {6, 0}
    b = make_trace(flipped, e)
    d = engine_diff(a, b)
    assert d.router_mismatch == pytest.approx(1 / (t * n_layers))
    assert d.layers["router_mismatch"].tolist() == pytest.approx([0, 1 / t, 0])
    assert d.tokens_any_layer == pytest.approx(1 / t)
    assert d.routers_per_token_mean == pytest.approx(1 / t)
    assert d.routers_frame()["tokens"].tolist() == [4, 1, 0, 0]
    assert d.layers["jaccard"].tolist() == pytest.approx([1, (4 + 1 / 3) / 5, 1])  # |{6}| / |{0, 6, 7}|
    assert d.layers["top1_mismatch"].tolist() == [0, 0, 0]  # slot 0 kept its expert
    rows = d.differing_frame()
    assert rows[["row", "pos", "layer", "experts_a", "experts_b", "only_a", "only_b"]].to_dict("records") == [
        {"row": 3, "pos": 3, "layer": 1, "experts_a": "6,7", "experts_b": "0,6", "only_a": "7", "only_b": "0"}
    ]
    assert not d.identical and d.nondeterministic  # both name the same source: non-determinism
    b.model = dataclasses.replace(b.model, dtype="bfloat16")
    assert not engine_diff(a, b).nondeterministic  # another dtype: an expected difference


def test_jaccard_and_top1_by_hand():
    a = make_trace([np.array([[0, 1, 2]] * 4)], 8)
    b = make_trace([np.array([[0, 1, 2], [0, 1, 3], [3, 4, 5], [2, 1, 0]])], 8)
    d = engine_diff(a, b)
    assert d.jaccard == pytest.approx((1 + 2 / 4 + 0 + 1) / 4)
    assert d.router_mismatch == pytest.approx(2 / 4)
    assert d.top1_mismatch == pytest.approx(2 / 4)  # rows 2 (0 vs 3) and 3 (0 vs 2)
    assert not d.identical  # same sets in row 3, another top-1: not identical


def test_sets_not_slot_order():
    a = _random_trace(seed=1, k=3)
    rng = np.random.default_rng(2)
    permuted = []
    for r in a.layers:
        order = np.argsort(rng.random(r.experts.shape), axis=1)
        permuted.append(dataclasses.replace(r, experts=np.take_along_axis(r.experts, order, axis=1)))
    unranked = dataclasses.replace(a, layers=[_imported(r, ranked=False) for r in permuted])
    d = engine_diff(a, unranked)
    assert d.router_mismatch == 0.0 and d.jaccard == 1.0 and d.identical
    assert d.layers["top1_mismatch"].isna().all() and math.isnan(d.top1_mismatch)
    # the same permutation claimed as ranked: sets still agree, the top-1 differs where slot 0 moved
    ranked = dataclasses.replace(a, layers=[_imported(r, ranked=True) for r in permuted])
    d = engine_diff(a, ranked)
    moved = sum(
        int((x.experts[:, 0] != y.experts[:, 0]).sum()) for x, y in zip(a.layers, permuted, strict=True)
    )
    assert moved > 0
    assert d.router_mismatch == 0.0 and d.top1_mismatch == pytest.approx(moved / d.pairs)


def test_dropped_slots_belong_to_no_set():
    a = make_trace([np.array([[0, -1], [0, -1], [-1, -1], [0, 1]])], 4)
    b = make_trace([np.array([[0, -1], [0, 1], [-1, -1], [1, 0]])], 4)
    d = engine_diff(a, b)
    assert d.layers["mismatched"].tolist() == [1]  # only row 1: {0} vs {0, 1}
    assert d.jaccard == pytest.approx((1 + 1 / 2 + 1 + 1) / 4)
    assert d.differing_frame()["row"].tolist() == [1]


def test_set_overlap_matches_python_sets():
    rng = np.random.default_rng(3)
    n, e = 301, 16
    ea = random_sets(rng, n, e, 4).astype(np.int16)
    eb = random_sets(rng, n, e, 3)  # another k and dtype
    ea[rng.random((n, 4)) < 0.1] = -1
    eb[rng.random((n, 3)) < 0.1] = -1
    expected = [len({x for x in r if x >= 0} & {y for y in s if y >= 0}) for r, s in zip(ea, eb, strict=True)]
    assert set_overlap(ea, eb, chunk=7).tolist() == expected  # chunk boundaries inside the rows


# ---- alignment and refusals --------------------------------------------------------------------------------
def test_different_token_ids_are_refused_at_the_first_differing_position():
    experts = [np.tile([[0, 1]], (8, 1))]
    a = make_trace(experts, 4, seq_lengths=[4, 4], token_ids=np.arange(8))
    ids = np.arange(8)
    ids[[6, 7]] = [60, 70]  # seq 1, positions 2 and 3
    b = make_trace(experts, 4, seq_lengths=[4, 4], token_ids=ids)
    with pytest.raises(InputError, match=r"\('input', 1, 2\) the token_id is 6 in the first and 60"):
        engine_diff(a, b)
    # the other path (B lacks a token): the same message
    short = make_trace([np.tile([[0, 1]], (7, 1))], 4, seq_lengths=[4, 3], token_ids=ids[:7])
    with pytest.raises(InputError, match=r"\('input', 1, 2\) the token_id is 6 in the first and 60"):
        engine_diff(a, short)


def test_unknown_ids_align_by_position_and_say_so():
    a = make_trace([np.array([[0, 1], [1, 2], [2, 3], [3, 0]])], 4, token_ids=[5, 6, 7, 8])
    # an import without ids: token_id −1, and the last token (never run) missing
    b = make_trace([np.array([[0, 1], [1, 3], [2, 3]])], 4, token_ids=[-1, -1, -1])
    d = engine_diff(a, b)
    assert d.aligned_by == "position"
    assert d.tokens == 3 and d.pairs == 3 and d.mismatched == 1
    assert d.routers_differing.tolist() == [0, 1, 0, -1]  # the last token is not paired
    assert any("position only" in n for n in d.notes) and any("no counterpart" in n for n in d.notes)
    # ids known where both give them must still agree
    c = make_trace([np.array([[0, 1], [1, 3], [2, 3]])], 4, token_ids=[-1, 9, -1])
    with pytest.raises(InputError, match=r"\('input', 0, 1\) the token_id is 6 in the first and 9"):
        engine_diff(a, c)


def test_no_common_layer_is_refused():
    a = make_trace([np.array([[0, 1]])], 4)
    b = dataclasses.replace(a, layers=[dataclasses.replace(a.layers[0], layer=5)])
    with pytest.raises(InputError, match="no MoE layer in common"):
        engine_diff(a, b)


# ---- margins, positions, distributions ---------------------------------------------------------------------
def test_mismatch_by_margin_quartile_names_the_low_margin_tokens():
    # 8 tokens, 4 experts, top-1 of B's logits; the margin of token t is t/8 (expert 0 over expert 1)
    gaps = np.arange(8) / 8 + 0.01
    logits_b = np.stack([gaps, np.zeros(8), np.full(8, -5.0), np.full(8, -5.0)], axis=1)
    b_layer = make_layer(np.zeros((8, 1), int), 4, logits_b, score_fn="sigmoid")
    a_experts = np.zeros((8, 1), int)
    a_experts[[0, 1]] = 1  # A flips the two tokens of smallest margin
    a = make_trace([_imported(make_layer(a_experts, 4))], 4)
    b = make_trace([b_layer], 4)
    d = engine_diff(a, b)
    assert d.margin_side == "b"
    q = d.margin_quartile_frame()
    assert q["mismatched"].tolist() == [2, 0, 0, 0] and q["pairs"].tolist() == [2, 2, 2, 2]
    rows = d.differing_frame()
    assert rows["row"].tolist() == [0, 1]
    sigma = 1 / (1 + np.exp(-gaps[:2]))
    assert rows["margin"].to_numpy() == pytest.approx(
        sigma - 0.5, abs=1e-6
    )  # σ(gap) − σ(0): B's margin, fp32
    # only A has logits: A's margins; neither: no quartiles
    assert engine_diff(b, a).margin_side == "a"
    none = engine_diff(a, a)
    assert none.margin_side is None and none.margin_quartile_frame().empty


def test_mismatch_by_position():
    experts = np.tile([[0, 1]], (8, 1))
    a = make_trace([experts, experts], 4, seq_lengths=[4, 4])
    flipped = experts.copy()
    flipped[[2, 6], 1] = 3  # position 2 of both sequences, layer 0 only
    b = make_trace([flipped, experts], 4, seq_lengths=[4, 4])
    d = engine_diff(a, b)
    pos = d.position_frame()
    assert pos["pos_start"].tolist() == [0, 1, 2, 3] and d.position_bin == 1
    assert pos["pairs"].tolist() == [4, 4, 4, 4] and pos["mismatched"].tolist() == [0, 0, 2, 0]
    heat = d.layer_position_frame()
    assert heat.loc[heat["mismatched"] > 0, ["layer", "pos_start", "router_mismatch"]].values.tolist() == [
        [0, 2, 1.0]
    ]


@pytest.mark.parametrize(
    ("score_fn", "p_b"),
    [("softmax", (0.75, 0.25)), ("sigmoid", (0.6, 0.4))],  # sigmoid: (σ(ln 3), σ(0)) = (.75, .5) normalised
)
def test_router_kl_and_tv_by_hand(score_fn, p_b):
    a = make_trace([make_layer([[0]], 2, [[0.0, 0.0]], score_fn=score_fn)], 2)
    b = make_trace([make_layer([[0]], 2, [[math.log(3), 0.0]], score_fn=score_fn)], 2)
    d = engine_diff(a, b)
    kl = 0.5 * math.log(0.5 / p_b[0]) + 0.5 * math.log(0.5 / p_b[1])
    assert d.layers["kl"].iloc[0] == pytest.approx(kl, rel=1e-5)  # fp32 scores
    assert d.layers["tv"].iloc[0] == pytest.approx(abs(0.5 - p_b[0]), rel=1e-5)
    assert d.router_mismatch == 0 and not d.identical  # same sets, other logits
    assert d.layers["logits_equal"].tolist() == [False]


def test_logprob_gap_by_hand():
    delta = np.array([0.0, math.log(2) + 0.1, -1.0, 0.5])
    gap = logprob_gap(delta)
    assert gap["mean_delta"] == pytest.approx((0 + math.log(2) + 0.1 - 1 + 0.5) / 4)
    k3 = [math.exp(x) - 1 - x for x in delta]
    assert gap["k3_kl"] == pytest.approx(sum(k3) / 4)
    assert gap["extreme_fraction"] == 0.5  # ln 2 + 0.1 and −1
    assert math.isnan(logprob_gap(np.zeros(0))["k3_kl"])


def test_margin_functions_moved_keep_their_old_path_and_diff_needs_no_torch():
    from moeviz.analysis import margins
    from moeviz.whatif import quant

    assert quant.router_margin is margins.router_margin and quant.margin_quartiles is margins.margin_quartiles
    code = "import sys, moeviz.analysis.engine_diff; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---- the command -------------------------------------------------------------------------------------------
REQUIRED = {"tokens", "layers", "tokens_any_layer", "routers_per_token_mean", "by_margin_quartile", "replay"}


def test_cli_json_text_and_exit_codes(tmp_path, capsys):
    a = _random_trace(seed=4)
    b = _copy(a)
    b.layers[2].experts[5] = [e for e in range(8) if e not in set(a.layers[2].experts[5])][:2]
    b = dataclasses.replace(b, layers=[_imported(r, ranked=False) for r in b.layers])
    pa, pb = a.to_parquet(tmp_path / "a.parquet"), b.to_parquet(tmp_path / "b.parquet")
    result = run_cli(capsys, "diff", str(pa), str(pb), "--format", "json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert set(payload) >= REQUIRED and payload["replay"] is None
    assert payload["tokens"] == 12 and payload["router_mismatch"] == pytest.approx(1 / 36)
    assert [r["router_mismatch"] for r in payload["layers"]] == pytest.approx([0, 0, 1 / 12])
    for row in payload["layers"]:
        assert {"layer", "router_mismatch", "top1_mismatch", "jaccard", "kl", "tv"} <= set(row)
        assert row["top1_mismatch"] is None and row["kl"] is None  # B unranked, without logits: NaN → null
    assert payload["by_margin_quartile"][0]["quartile"] == 1 and payload["margin_side"] == "a"
    assert payload["identical"] is False
    text = run_cli(capsys, "diff", str(pa), str(pb))
    assert text.code == 0 and "1 of 36 (token, layer) pairs choose different experts" in text.out
    same = run_cli(capsys, "diff", str(pa), str(pa), "--fail-on-mismatch")
    assert same.code == 0 and "identical" in same.out
    assert run_cli(capsys, "diff", str(pa), str(pb), "--fail-on-mismatch").code == 3


def test_cli_refusals(tmp_path, capsys):
    a = make_trace([np.array([[0, 1], [1, 2]])], 4, token_ids=[1, 2])
    b = make_trace([np.array([[0, 1], [1, 2]])], 4, token_ids=[1, 3])
    pa, pb = a.to_parquet(tmp_path / "a.parquet"), b.to_parquet(tmp_path / "b.parquet")
    result = run_cli(capsys, "diff", str(pa), str(pb))
    assert result.code == 2
    result.one_line("different tokens", "('input', 0, 1)")
    result = run_cli(capsys, "diff", str(pa), str(pa), "--replay")
    assert result.code == 2
    result.one_line("--replay runs the model")
    result = run_cli(capsys, "diff", str(pa), str(tmp_path / "missing.parquet"))
    assert result.code == 2
    result.one_line("missing.parquet does not exist")
    from moeviz.trace import ExpertLoad

    load = ExpertLoad(model=a.model, counts=np.ones((1, 1, 4), np.int64), layers=[0], top_k=2, source="stat")
    counts = load.to_parquet(tmp_path / "counts.parquet")
    result = run_cli(capsys, "diff", str(pa), str(counts))
    assert result.code == 2
    result.one_line("expert counts", "not per-token routing")


def test_token_frame_is_the_token_strip():
    a = make_trace([np.array([[0, 1], [1, 2], [2, 3]])] * 2, 4)
    b = make_trace([np.array([[0, 1], [1, 3], [2, 3]]), np.array([[0, 1], [1, 3], [2, 0]])], 4)
    frame = engine_diff(a, b).token_frame()
    assert isinstance(frame, pd.DataFrame) and frame["routers_differing"].tolist() == [0, 2, 1]
