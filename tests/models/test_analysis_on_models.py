"""moeviz.analysis on real captures (tiny random models and the bundled samples): the balancing losses equal
transformers', a real balancing bias is read back, and the structure, comparison, specialisation and
collapse frames equal direct counts over the captured routing. The hand-computed cases are in
tests/unit/test_analysis_*.py."""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict

import numpy as np
import pytest

import moeviz
from moeviz.analysis import collapse_report, confidence_frame, loss_frame
from moeviz.analysis.balance import balance_from_counts
from moeviz.analysis.collapse import NOT_ENOUGH_TOKENS, CollapseThresholds, Verdict, judge_layer
from moeviz.analysis.compare import expert_drift_frame, routing_agreement_frame, saturation_timeline
from moeviz.analysis.losses import aux_loss_topk_pooled, loss_stats
from moeviz.analysis.specialisation import expert_domain_specialisation, vocabulary_specialisation_frame
from moeviz.analysis.structure import (
    coactivation_matrix,
    path_frame,
    repetition_frame,
    transition_frame,
)
from moeviz.trace import Trace
from tests.support.traces import expert_sets


def _by_row(routing) -> dict[int, int]:
    """token row -> index into the layer's arrays."""
    return {int(r): i for i, r in enumerate(routing.token_rows)}


def _next_rows(trace: Trace) -> dict[int, int]:
    """row -> row of the next token of the same sequence and stream (the pairs repetition counts)."""
    t = trace.tokens
    index = {
        (s, st, p): row for row, (s, st, p) in enumerate(zip(t["seq"], t["stream"], t["pos"], strict=True))
    }
    return {
        row: index[(s, st, p + 1)]
        for row, (s, st, p) in enumerate(zip(t["seq"], t["stream"], t["pos"], strict=True))
        if (s, st, p + 1) in index
    }


# ---- balancing losses and bias ----------------------------------------------------------------------------
def _hf_aux(logits_list, num_experts, top_k):
    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    gate = tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in logits_list)
    return float(load_balancing_loss_func(gate, num_experts, top_k))


@pytest.fixture(scope="module")
def one_layer_trace(tiny_model_dir):
    loaded = moeviz.load_model(str(tiny_model_dir("mixtral", num_hidden_layers=1)))
    ids = np.random.default_rng(0).integers(3, 128, size=(2, 40)).tolist()
    return moeviz.capture(loaded, token_ids=ids)


@pytest.fixture(scope="module")
def sample_trace(sample_model):
    return moeviz.capture(sample_model, ["The quick brown fox jumps over the lazy dog.", "In the beginning"])


@pytest.mark.parametrize("which", ["one_layer_trace", "sample_trace"])
def test_aux_loss_equals_transformers(which, request):
    trace: Trace = request.getfixturevalue(which)
    e = trace.layers[0].num_experts
    assert trace.layers[0].k == 2 and (which == "one_layer_trace") == (len(trace.layers) == 1)
    for routing in trace.layers:
        stats = loss_stats(routing)
        assert stats.aux_loss_top1 == pytest.approx(_hf_aux([routing.logits], e, 1), rel=1e-5)
        assert stats.aux_loss_topk == pytest.approx(_hf_aux([routing.logits], e, 2), rel=1e-5)
        assert stats.aux_loss_dispatched == pytest.approx(stats.aux_loss_topk, rel=1e-6)  # no bias, no drops
    # transformers pools every layer's rows into one f and one P
    pooled_logits = [r.logits for r in trace.layers]
    for k in (1, 2):
        assert aux_loss_topk_pooled(trace.layers, k) == pytest.approx(_hf_aux(pooled_logits, e, k), rel=1e-5)
    if len(trace.layers) > 1:  # pooled is not the mean of per-layer losses
        per_layer = np.mean([loss_stats(r).aux_loss_topk for r in trace.layers])
        assert aux_loss_topk_pooled(trace.layers) != pytest.approx(per_layer, rel=1e-6)


def test_bias_stats_of_a_real_biased_router(tiny_model_dir):
    loaded = moeviz.load_model(str(tiny_model_dir("deepseek_v3")))
    trace = moeviz.capture(loaded, token_ids=[list(range(3, 43))])
    buffers = [b for name, b in loaded.model.named_buffers() if name.endswith("e_score_correction_bias")]
    assert len(buffers) == len(trace.layers) > 0
    frame = loss_frame(trace)
    for (_, row), buffer in zip(frame.iterrows(), buffers, strict=True):
        b = buffer.double()
        assert row["has_bias"]
        assert row["bias_std"] == pytest.approx(float(b.std(unbiased=False)), rel=1e-5)
        assert row["bias_max_abs"] == pytest.approx(float(b.abs().max()), rel=1e-5)
        assert row["bias_range"] == pytest.approx(float(b.max() - b.min()), rel=1e-5)
    conf = confidence_frame(trace)
    # unbiased overlap = |top-k of the unbiased scores ∩ the dispatched set| / k, per token
    for routing in trace.layers:
        rows = conf[(conf["layer"] == routing.layer) & (conf["site"] == routing.site)]
        top = np.argsort(-routing.scores.astype(np.float64), axis=1, kind="stable")[:, : routing.k]
        want = [
            len(set(t) & s) / routing.k
            for t, s in zip(top.tolist(), expert_sets(routing.experts), strict=True)
        ]
        np.testing.assert_allclose(rows["unbiased_overlap"].to_numpy(), want)
    assert conf["margin_selection"].notna().all()  # every router here has a bias


# ---- collapse ---------------------------------------------------------------------------------------------
def test_real_sample_model_verdict_is_consistent(sample_model):
    trace = moeviz.capture(sample_model, "The quick brown fox jumps over the lazy dog. " * 4)
    report = collapse_report(trace)
    assert len(report.layers) == len(trace.layers)
    assert report.verdict == max(lv.verdict for lv in report.layers)
    for lv, routing in zip(report.layers, trace.layers, strict=True):
        assert (lv.layer, lv.site) == (routing.layer, routing.site)
        assert lv.bias is None
        # the z-loss the verdict reads is mean (logsumexp of the logits)² (float64 here)
        x = routing.logits.astype(np.float64)
        m = x.max(axis=1, keepdims=True)
        lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
        assert lv.z_loss == pytest.approx(float((lse**2).mean()), rel=1e-5)


# ---- the uniform-routing null on short pieces of the held-out slices --------------------------------------
PIECES = (16, 32, 64, 128, 256, 512)


def _piece_verdicts(name: str, windows_per_domain: int = 2) -> dict[int, list[tuple[Verdict, str]]]:
    """Capture the first 512-token windows of every evaluation slice in one forward, cut each window's
    routing into pieces of every length in PIECES and judge every piece as its own text:
    length → [(verdict, status)]."""
    from moeviz.samples import eval_batch

    loaded = moeviz.load_model(f"sample:{name}")
    batch = eval_batch(loaded, chunks=windows_per_domain, length=512)
    trace = moeviz.capture(loaded, token_ids=batch.token_ids)
    seq = trace.tokens["seq"].to_numpy()
    out: dict[int, list[tuple[Verdict, str]]] = {}
    for length in PIECES:
        per_layer = []
        for routing in trace.layers:
            assert (np.diff(seq[routing.token_rows]) >= 0).all()  # rows in sequence order
            experts = routing.experts.reshape(-1, length, routing.k)  # [pieces, length, k]
            per_layer.append((routing, experts))
        results = []
        for i in range(per_layer[0][1].shape[0]):
            layer_verdicts = []
            for routing, experts in per_layer:
                piece = experts[i]
                counts = np.bincount(piece[piece >= 0], minlength=routing.num_experts)
                stats = balance_from_counts(counts, length, routing.k, int((piece < 0).sum()))
                layer_verdicts.append(
                    judge_layer(
                        routing.layer,
                        routing.site,
                        stats,
                        0.0,
                        None,
                        layers=len(trace.layers),
                        sequence_lengths=[length],
                    )
                )
            verdict = max(lv.verdict for lv in layer_verdicts)
            judged = any(lv.status == "judged" for lv in layer_verdicts)
            results.append((verdict, "judged" if judged else "not enough tokens"))
        out[length] = results
    return out


def test_healthy_sample_false_alarms_stay_within_the_level_on_short_pieces():
    alpha = CollapseThresholds().alpha
    healthy = _piece_verdicts("mixtral-healthy")
    alarms = judged = 0
    for length, results in healthy.items():
        if length < 20:  # fewer than 5 fair-share slots per expert (E = 8, k = 2)
            assert {status for _, status in results} == {"not enough tokens"}
            continue
        assert {status for _, status in results} == {"judged"}
        alarms += sum(v >= Verdict.WARNING for v, _ in results)
        judged += len(results)
    assert alarms / judged <= alpha, f"{alarms} false alarms in {judged} pieces"
    collapsed = _piece_verdicts("mixtral-collapsed")
    for length, results in collapsed.items():
        if length >= 128:
            assert all(v is Verdict.COLLAPSED for v, _ in results), length


def test_report_gate_knows_the_sample_size(capsys):
    from moeviz import cli
    from moeviz.samples import eval_dir

    healthy = ["report", "--model", "sample:mixtral-healthy", "--fail-on", "warning", "--text"]
    # 14 tokens: below 5 fair-share slots per expert, the load is not judged at all
    assert cli.main([*healthy, "The old man walked along the river."]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(f"verdict: HEALTHY (load {NOT_ENOUGH_TOKENS})")
    # 31 tokens (the 28-token case): every layer trips a threshold, none is significant for one text
    text = "In the beginning God created the heaven and the earth. And the earth was without form, and void."
    assert cli.main([*healthy, text]) == 0
    out = capsys.readouterr().out
    assert "verdict: HEALTHY" in out and "not significant: one expert" in out
    # a longer text of the collapsed sample still fails the gate
    long_text = (eval_dir() / "english.txt").read_text(encoding="utf-8")[:700]  # 242 tokens
    collapsed = [
        "report",
        "--model",
        "sample:mixtral-collapsed",
        "--text",
        long_text,
        "--fail-on",
        "collapsed",
    ]
    assert cli.main(collapsed) == cli.EXIT_VERDICT
    assert "verdict: COLLAPSED" in capsys.readouterr().out


# ---- structure --------------------------------------------------------------------------------------------
def test_structure_on_a_real_capture(sample_model):
    trace = moeviz.capture(sample_model, ["The cat sat on the mat. The cat sat.", "def f(x): return x"])
    nxt = _next_rows(trace)
    rep = repetition_frame(trace, shuffles=5).set_index(["site", "layer"])
    assert len(rep) == len(trace.layers)
    for routing in trace.layers:
        # repetition: over consecutive tokens of a sequence, counted directly
        at, sets = _by_row(routing), expert_sets(routing.experts)
        pairs = [(at[a], at[b]) for a, b in nxt.items() if a in at and b in at]
        row = rep.loc[(routing.site, routing.layer)]
        assert row["pairs"] == len(pairs) > 0
        top = routing.experts[:, 0]
        assert row["top1_repeat"] == pytest.approx(np.mean([top[a] == top[b] for a, b in pairs]))
        assert row["overlap_repeat"] == pytest.approx(np.mean([bool(sets[a] & sets[b]) for a, b in pairs]))
        # co-activation: P(j ∈ S | i ∈ S), counted directly
        e = routing.num_experts
        uses = Counter(i for s in sets for i in s)
        both = Counter((i, j) for s in sets for i in s for j in s)
        want = np.array([[both[i, j] / uses[i] if uses[i] else np.nan for j in range(e)] for i in range(e)])
        np.testing.assert_allclose(coactivation_matrix(routing), want)
    tr = transition_frame(trace)
    sums = tr.groupby(["layer", "expert"])["probability"].sum(min_count=1).dropna()
    np.testing.assert_allclose(sums, trace.layers[0].k, rtol=1e-9)
    # top-1 paths through every layer: the most common tuples of top-1 experts, counted directly
    layers = sorted(trace.layers, key=lambda r: r.layer)
    paths = path_frame(trace, top_n=3)
    rows = sorted(set.intersection(*(set(_by_row(r)) for r in layers)))
    counts = Counter(tuple(int(r.experts[_by_row(r)[row], 0]) for r in layers) for row in rows)
    assert paths["tokens"].iloc[0] == len(rows) == len(trace.tokens)
    assert paths["count"].tolist() == [c for _, c in counts.most_common(3)]
    assert all(counts[p] == c for p, c in zip(paths["path"], paths["count"], strict=True))


def test_encoder_decoder_with_capacity_drops(tiny_model_dir):
    from moeviz.analysis import expert_domain_specialisation, routing_agreement_frame
    from moeviz.analysis.specialisation import vocabulary_specialisation_frame

    loaded = moeviz.load_model(tiny_model_dir("switch_transformers", expert_capacity=2))
    trace = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8, 9, 5, 6], [10, 11, 5]], generate=2)
    assert any((r.experts < 0).any() for r in trace.layers)
    rep = repetition_frame(trace, shuffles=3)
    assert set(rep["site"]) == {"encoder", "decoder"} and (rep["pairs"] > 0).all()
    tr = transition_frame(trace)
    assert set(tr["site"]) == {"encoder", "decoder"}
    assert (tr.groupby(["site", "layer", "expert"])["probability"].sum() <= 1 + 1e-9).all()  # k = 1
    # transitions between consecutive layers of a site, counted directly (dropped tokens route nowhere)
    for site in ("encoder", "decoder"):
        layers = sorted((r for r in trace.layers if r.site == site), key=lambda r: r.layer)
        for src, dst in itertools.pairwise(layers):
            a, b = _by_row(src), _by_row(dst)
            joint, count = Counter(), Counter()
            for row in a.keys() & b.keys():
                i, j = int(src.experts[a[row], 0]), int(dst.experts[b[row], 0])
                if i >= 0:
                    count[i] += 1
                    joint[i, j] += j >= 0
            got = tr[(tr["site"] == site) & (tr["layer"] == src.layer)].set_index(["expert", "next_expert"])
            for (i, j), p in got["probability"].dropna().items():
                assert p == pytest.approx(joint[i, j] / count[i]), (site, src.layer, i, j)
    paths = path_frame(trace)
    assert paths.groupby("site")["count"].sum().le(paths.groupby("site")["tokens"].first()).all()
    assert any("drop" in label for label in paths["label"])
    assert len(vocabulary_specialisation_frame(trace, min_count=2)) == 3 * len(trace.layers)
    assert len(expert_domain_specialisation(trace, ["a", "b"], shuffles=5).summary) == 2 * len(trace.layers)
    same = routing_agreement_frame(trace, trace)
    assert same[["saturation_topk", "saturation_top1", "jaccard"]].eq(1.0).all(None)


# ---- checkpoint comparison --------------------------------------------------------------------------------
def test_checkpoints_of_a_real_model(tiny_model_dir):
    ids = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    first = moeviz.capture(moeviz.load_model(tiny_model_dir("mixtral")), token_ids=ids)
    second = moeviz.capture(moeviz.load_model(tiny_model_dir("mixtral", seed=1)), token_ids=ids)
    frame = routing_agreement_frame(first, second).set_index(["site", "layer"])
    assert len(frame) == len(first.layers) and frame["tokens"].eq(9).all()
    drift = expert_drift_frame(first, second)
    for a, b in zip(first.layers, second.layers, strict=True):
        # the same tokens in the same rows: saturation = mean |S_a ∩ S_b| / k (no capacity drops here)
        assert (a.token_rows == b.token_rows).all()
        sa, sb = expert_sets(a.experts), expert_sets(b.experts)
        row = frame.loc[(a.site, a.layer)]
        assert row["saturation_topk"] == pytest.approx(
            np.mean([len(x & y) / b.k for x, y in zip(sa, sb, strict=True)])
        )
        assert row["saturation_top1"] == pytest.approx(np.mean(a.experts[:, 0] == b.experts[:, 0]))
        mine = drift[(drift["layer"] == a.layer) & (drift["site"] == a.site)]
        e = a.num_experts
        np.testing.assert_array_equal(mine["load_a"], np.bincount(a.experts.ravel(), minlength=e))
        np.testing.assert_array_equal(mine["load_b"], np.bincount(b.experts.ravel(), minlength=e))
        kept = [sum(i in x and i in y for x, y in zip(sa, sb, strict=True)) for i in range(e)]
        np.testing.assert_array_equal(mine["kept"], kept)
    timeline = saturation_timeline([first, second])
    assert timeline.query("checkpoint == 1")["saturation_topk"].eq(1.0).all()
    np.testing.assert_allclose(
        timeline.query("checkpoint == 0")["saturation_topk"], frame["saturation_topk"].to_numpy()
    )


# ---- specialisation ---------------------------------------------------------------------------------------
def test_specialisation_on_a_real_capture(sample_model):
    texts = ["the the the the cat cat cat", "def f(x):\n    return x + 1\n", "1 + 2 = 3, 3 + 4 = 7"]
    domains = ["prose", "code", "maths"]
    trace = moeviz.capture(sample_model, texts)
    result = expert_domain_specialisation(trace, domains, shuffles=20)
    assert len(result.summary) == 3 * len(trace.layers)
    # DS(e, d) = share of the domain's tokens that have e in their dispatched set, counted directly
    seq = trace.tokens["seq"].to_numpy()
    experts = result.experts.set_index(["layer", "domain", "expert"])
    for routing in trace.layers:
        tokens_of = Counter(seq[routing.token_rows])
        hits = Counter(
            (int(seq[r]), e)
            for r, s in zip(routing.token_rows, expert_sets(routing.experts), strict=True)
            for e in s
        )
        for (s, e), n in hits.items():
            assert experts.loc[(routing.layer, domains[s], e), "ds"] == pytest.approx(n / tokens_of[s])
    assert result.summary["ds"].between(0, 1).all()
    vocab = vocabulary_specialisation_frame(trace, min_count=2, shuffles=5)
    assert set(vocab["key"]) == {"input", "next", "predicted"}
    # by input id: the mean over ids seen ≥ 2 times of the share of their most common top-1 expert
    ids = trace.tokens["token_id"].to_numpy()
    for routing in trace.layers:
        by_id = defaultdict(list)
        for row, e in zip(routing.token_rows, routing.experts[:, 0], strict=True):
            by_id[int(ids[row])].append(int(e))
        shares = [Counter(v).most_common(1)[0][1] / len(v) for v in by_id.values() if len(v) >= 2]
        got = vocab[(vocab["key"] == "input") & (vocab["layer"] == routing.layer)]["specialisation"]
        assert got.iloc[0] == pytest.approx(np.mean(shares)) if shares else math.isnan(got.iloc[0])
