"""Engine diff and routing replay on the sample models (moeviz.analysis.engine_diff,
moeviz.interventions.replay, `moeviz diff --replay`): the same engine twice → 0; bf16 vs fp32 captures of
the same ids → the differing (token, layer) are exactly those an independent numpy top-k of each side's own
logits says, and they sit in the lowest router-margin quartile; replaying a model's own routing changes
nothing bit for bit; replaying the bf16 routing in the fp32 model moves its log-probs toward the bf16 ones.
The hand-made known answers are in tests/unit/test_engine_diff.py."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import moeviz
from moeviz.analysis.engine_diff import engine_diff
from moeviz.capture.forward import capture
from moeviz.interventions.replay import forced_logits, replay, replay_rule
from moeviz.trace.records import absent
from tests.support.cli import REPO, run_cli

TEXT = REPO / "sample_models" / "eval" / "bible_en.txt"
TOKENS = 512  # bf16 flips 8 of 2,048 (token, layer) of this text on mixtral-healthy


@pytest.fixture(scope="module")
def fp32():
    return moeviz.load_model("sample:mixtral-healthy", dtype="float32")


@pytest.fixture(scope="module")
def bf16():
    return moeviz.load_model("sample:mixtral-healthy", dtype="bfloat16")


@pytest.fixture(scope="module")
def ids(fp32):
    return list(fp32.tokenizer(TEXT.read_text())["input_ids"][:TOKENS])


@pytest.fixture(scope="module")
def captures(fp32, bf16, ids):
    """(bf16 capture, fp32 capture) of the same ids."""
    return capture(bf16, token_ids=[ids]), capture(fp32, token_ids=[ids])


def _topk_sets(logits: np.ndarray, dispatched: np.ndarray) -> tuple[list[frozenset[int]], int]:
    """Each row's k largest logits (softmax is monotone), recomputed in numpy, and how many rows tie at the
    k-th place (bf16 logits do): there the top-k is no function of the logits, so the dispatched set is
    taken once checked to be one of the valid top-k sets."""
    k = dispatched.shape[1]
    values = logits.astype(np.float64)
    order = np.argsort(-values, axis=1, kind="stable")
    ranked = np.take_along_axis(values, order, axis=1)
    sets, ties = [], 0
    for i, row in enumerate(order):
        if ranked[i, k - 1] > ranked[i, k]:
            sets.append(frozenset(int(e) for e in row[:k]))
            continue
        ties += 1
        chosen = frozenset(int(e) for e in dispatched[i])
        above = {int(e) for e in np.flatnonzero(values[i] > ranked[i, k - 1])}
        at_least = {int(e) for e in np.flatnonzero(values[i] >= ranked[i, k - 1])}
        assert above <= chosen <= at_least, (i, chosen, values[i])
        sets.append(chosen)
    return sets, ties


def test_same_engine_twice_is_exactly_zero(fp32, ids, captures):
    again = capture(fp32, token_ids=[ids])
    d = engine_diff(captures[1], again)
    assert d.identical and d.same_source and not d.nondeterministic
    assert d.mismatched == 0 and d.router_mismatch == 0.0 and d.tokens_any_layer == 0.0
    assert d.layers["logits_equal"].all() and (d.layers["kl"] == 0).all() and (d.layers["tv"] == 0).all()


def test_bf16_vs_fp32_flips_equal_an_independent_recomputation(captures):
    a, b = captures
    d = engine_diff(a, b)
    assert not d.identical and not d.nondeterministic  # another dtype: an expected difference
    expected = set()
    for x, y in zip(a.layers, b.layers, strict=True):
        (sets_a, _), (sets_b, ties_b) = _topk_sets(x.logits, x.experts), _topk_sets(y.logits, y.experts)
        assert ties_b == 0  # fp32 logits do not tie here
        # the recomputation agrees with what each model dispatched (no tie decided otherwise) …
        assert sets_a == [frozenset(map(int, r)) for r in x.experts]
        assert sets_b == [frozenset(map(int, r)) for r in y.experts]
        # … and its set differences are the flips
        expected |= {(int(x.token_rows[i]), x.layer) for i in range(len(sets_a)) if sets_a[i] != sets_b[i]}
    rows = d.differing_frame()
    assert len(expected) >= 5
    assert set(zip(rows["row"].tolist(), rows["layer"].tolist(), strict=True)) == expected
    assert d.mismatched == len(expected)
    assert d.router_mismatch == pytest.approx(len(expected) / (TOKENS * len(a.layers)))


def test_flips_sit_in_the_lowest_margin_quartile(captures):
    a, b = captures
    d = engine_diff(a, b)
    assert d.margin_side == "b"
    lowest = set()
    for y in b.layers:  # B's margin by hand: 2nd best − 3rd best softmax probability (top-2 router)
        p = np.exp(y.logits.astype(np.float64) - y.logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        top = -np.sort(-p, axis=1)
        margin = top[:, y.k - 1] - top[:, y.k]
        quarter = np.argsort(margin, kind="stable")[: len(margin) // 4]
        lowest |= {(int(y.token_rows[i]), y.layer) for i in quarter}
    rows = d.differing_frame()
    flips = set(zip(rows["row"].tolist(), rows["layer"].tolist(), strict=True))
    assert flips and flips <= lowest
    q = d.margin_quartile_frame()
    assert q.loc[q["quartile"] == 1, "mismatched"].item() == d.mismatched


def test_replaying_a_models_own_routing_changes_nothing(fp32, ids, captures):
    own = captures[1]
    forced = {i: own.layer(site.layer, site.site).experts for i, site in enumerate(fp32.sites)}
    logits, changed = forced_logits(fp32, ids, forced)
    with torch.inference_mode():
        plain = fp32.model(input_ids=torch.tensor([ids])).logits[0]
    assert changed == 0 and torch.equal(logits, plain)
    result = replay(fp32, own, infer_model=fp32)
    assert result.mode == "gap" and result.pairs_replayed == 0
    assert (result.tokens["delta"] == 0).all() and (result.tokens["delta_before"] == 0).all()
    assert result.after["k3_kl"] == 0.0


@pytest.mark.parametrize("sample", ["mixtral-healthy", "deepseek-v3-bias"])
def test_replay_gates_follow_the_family_rule(sample, fp32):
    """On the model's own sets the replay gate equals the weights the model applied (softmax renormalised
    over S; DeepSeek-V3: σ renormalised × routed_scaling_factor, bias not included)."""
    loaded = fp32 if sample == "mixtral-healthy" else moeviz.load_model(f"sample:{sample}", dtype="float32")
    trace = capture(loaded, "In the beginning God created the heavens and the earth.")
    for site in loaded.sites:
        layer = trace.layer(site.layer, site.site)
        rule = replay_rule(loaded, site)
        gates = rule.weights(torch.tensor(layer.logits), torch.tensor(layer.experts, dtype=torch.long))
        np.testing.assert_allclose(gates.numpy(), layer.weights, rtol=1e-6, atol=1e-7)
    assert rule.score_fn == ("sigmoid" if sample == "deepseek-v3-bias" else "softmax") and rule.renormalise


def test_replaying_bf16_routing_moves_fp32_toward_bf16(fp32, bf16, captures):
    a, _ = captures
    result = replay(fp32, a, infer_model=bf16)
    assert result.mode == "gap" and result.pairs_replayed > 0
    before, after = result.before, result.after
    assert after["k3_kl"] < before["k3_kl"]
    # before the first flip the fp32 model runs exactly as it did: replay changes no prediction there
    first = min(int(a.tokens["pos"].iloc[r]) for r in engine_diff(a, captures[1]).differing_frame()["row"])
    early = result.tokens["pos"] < first
    assert early.any()
    np.testing.assert_array_equal(
        result.tokens.loc[early, "logprob_replay"], result.tokens.loc[early, "logprob_own"]
    )


def test_replay_of_an_import_without_ids_reports_the_shift(fp32, captures):
    a, b = captures
    n = len(a.tokens) - 1  # an engine never routes the last token, and this import knows no ids
    rows = np.arange(n)
    layers = [
        dataclasses.replace(
            r,
            token_rows=rows,
            experts=r.experts[:n].astype(np.int16),
            logits=absent(n, r.num_experts),
            weights=absent(n, r.k),
            has_logits=False,
            has_weights=False,
            decision_source="vllm-routed",
        )
        for r in a.layers
    ]
    tokens = a.tokens.iloc[:n].assign(token_id=-1)
    imported = dataclasses.replace(a, tokens=tokens, layers=layers)
    d = engine_diff(imported, b)
    assert d.aligned_by == "position" and d.tokens == n
    result = replay(fp32, imported, ids_from=b)
    assert result.mode == "shift" and result.before is None and result.pairs_replayed > 0
    own, rep = result.tokens["logprob_own"], result.tokens["logprob_replay"]
    np.testing.assert_array_equal(result.tokens["delta"], (own - rep).to_numpy())
    assert result.tokens["next_id"].tolist() == b.tokens["token_id"].tolist()[1:n]


def test_cli_diff_replay(tmp_path, capsys, captures):
    a, b = captures
    pa, pb = a.to_parquet(tmp_path / "bf16.parquet"), b.to_parquet(tmp_path / "fp32.parquet")
    result = run_cli(
        capsys, "diff", str(pa), str(pb), "--model", "sample:mixtral-healthy", "--replay", "--format", "json"
    )
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    rep = payload["replay"]
    assert rep["mode"] == "gap" and "bfloat16" in rep["reference"]
    assert {"mean_delta", "k3_kl", "extreme_fraction"} <= set(rep)
    assert rep["k3_kl"] < rep["before"]["k3_kl"]
    assert payload["mismatched"] == engine_diff(a, b).mismatched
    text = run_cli(capsys, "diff", str(pa), str(pb), "--model", "sample:mixtral-healthy", "--replay")
    assert text.code == 0 and "after replay" in text.out and "before replay" in text.out
