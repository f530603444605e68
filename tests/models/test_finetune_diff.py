"""Base vs fine-tuned on the same tokens (moeviz.analysis.finetune_diff, `moeviz finetune-diff`): every number
against a direct computation from the two traces, the adapter file and peft's own merge."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import moeviz
from moeviz.analysis.collapse import collapse_report
from moeviz.analysis.finetune_diff import finetune_diff, load_shift_frame, router_weights
from moeviz.errors import InputError
from tests.support.adapters import FAMILY, save_adapter

TOKENS = [[(7 * i + 3) % 120 + 3 for i in range(96)], [(11 * i + 5) % 120 + 3 for i in range(96)]]
RANK, ALPHA = 4, 8


@pytest.fixture(scope="module")
def sides(tiny_model_dir, tmp_path_factory):
    """(base dir, adapter dir, base trace, tuned trace, base router weights, tuned router weights)."""
    base_dir = tiny_model_dir(FAMILY)
    adapter = save_adapter(tmp_path_factory.mktemp("ft") / "lora", rank=RANK, seed=3)
    base = moeviz.load_model(base_dir, dtype="float32")
    tuned = moeviz.load_model(base_dir, dtype="float32", adapter=adapter)
    traces = moeviz.capture(base, token_ids=TOKENS), moeviz.capture(tuned, token_ids=TOKENS)
    return base_dir, adapter, *traces, router_weights(base), router_weights(tuned)


@pytest.fixture(scope="module")
def result(sides):
    _, _, base, tuned, wb, wt = sides
    return finetune_diff(base, tuned, base_weights=wb, tuned_weights=wt, draws=2000)


def hand_shares(experts: np.ndarray, num_experts: int) -> np.ndarray:
    counts = np.zeros(num_experts)
    for row in experts:
        for e in row:
            if e >= 0:
                counts[e] += 1
    return counts / experts.size


def test_load_shift_and_mismatch_equal_a_direct_comparison(sides, result) -> None:
    _, _, base, tuned, _, _ = sides
    shift = result.load_shift
    for x, y in zip(base.layers, tuned.layers, strict=True):  # one forward each: the same rows
        rows = shift[shift["layer"] == x.layer]
        share_base, share_tuned = hand_shares(x.experts, x.num_experts), hand_shares(y.experts, y.num_experts)
        np.testing.assert_allclose(rows["share_base"], share_base)
        np.testing.assert_allclose(rows["share_tuned"], share_tuned)
        np.testing.assert_allclose(rows["shift"], share_tuned - share_base)
        differ = [set(a) != set(b) for a, b in zip(x.experts.tolist(), y.experts.tolist(), strict=True)]
        layer = result.routing.layers.set_index("layer").loc[x.layer]
        assert layer["mismatched"] == sum(differ) > 0
        assert layer["router_mismatch"] == pytest.approx(np.mean(differ))
    assert not result.routing.nondeterministic  # the adapter makes it another source, not noise


def test_the_bands_are_a_paired_bootstrap(sides, result) -> None:
    """The band edges against a paired bootstrap by hand (the same resampled tokens on both sides)."""
    _, _, base, tuned, _, _ = sides
    rng = np.random.default_rng(7)
    draws, level = 2000, result.level
    for x, y in zip(base.layers, tuned.layers, strict=True):
        n, e = len(x.experts), x.num_experts
        picks = rng.integers(0, n, size=(draws, n))
        spread = (
            np.stack([hand_counts(y.experts[p], e) - hand_counts(x.experts[p], e) for p in picks])
            / x.experts.size
        )
        low, high = np.quantile(spread, [(1 - level) / 2, (1 + level) / 2], axis=0)
        rows = result.load_shift[result.load_shift["layer"] == x.layer]
        np.testing.assert_allclose(rows["shift_low"], low, atol=0.006)
        np.testing.assert_allclose(rows["shift_high"], high, atol=0.006)
        np.testing.assert_array_equal(rows["moved"], (rows["shift_low"] > 0) | (rows["shift_high"] < 0))


def hand_counts(experts: np.ndarray, num_experts: int) -> np.ndarray:
    return np.bincount(experts[experts >= 0], minlength=num_experts)


def test_balance_before_and_after(sides, result) -> None:
    _, _, base, tuned, _, _ = sides
    assert result.verdict_base == collapse_report(base).verdict
    assert result.verdict_tuned == collapse_report(tuned).verdict
    assert result.degraded == (result.verdict_tuned > result.verdict_base)
    for x, y in zip(base.layers, tuned.layers, strict=True):
        row = result.balance.set_index("layer").loc[x.layer]
        assert row["max_share_base"] == pytest.approx(hand_shares(x.experts, x.num_experts).max())
        assert row["max_share_tuned"] == pytest.approx(hand_shares(y.experts, y.num_experts).max())


def test_the_router_delta_is_the_lora_update(sides, result) -> None:
    """‖ΔW‖ of each router equals torch.linalg.norm of (alpha/r)·B·A read from the adapter file, and of
    W_merged − W_base from peft's own merge; its rank is the adapter's."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base_dir, adapter, *_ = sides
    stored = load_file(adapter / "adapter_model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    before = {i: layer.mlp.gate.weight.detach().clone() for i, layer in enumerate(base.model.layers)}
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    delta = result.router_delta.set_index("layer")
    assert len(delta) == len(before)
    for i, w0 in before.items():
        prefix = f"base_model.model.model.layers.{i}.mlp.gate"
        update = (ALPHA / RANK) * stored[f"{prefix}.lora_B.weight"] @ stored[f"{prefix}.lora_A.weight"]
        assert delta.loc[i, "norm"] == pytest.approx(float(torch.linalg.norm(update)), rel=1e-5)
        merged_delta = merged.model.layers[i].mlp.gate.weight.detach().double() - w0.double()
        assert delta.loc[i, "norm"] == pytest.approx(float(torch.linalg.norm(merged_delta)), rel=1e-12)
        assert delta.loc[i, "relative"] == pytest.approx(delta.loc[i, "norm"] / float(torch.linalg.norm(w0)))
        assert delta.loc[i, "rank"] == RANK


def test_an_unchanged_router_has_no_delta_and_no_shift(sides) -> None:
    from moeviz.analysis.finetune_diff import router_delta_frame

    _, _, base, _, wb, _ = sides
    frame = router_delta_frame(wb, wb)
    assert (frame["norm"] == 0).all() and (frame["rank"] == 0).all()
    shift = load_shift_frame(base, base, draws=200)
    assert (shift["shift"] == 0).all() and not shift["moved"].any()
    assert (shift["shift_low"] == 0).all() and (shift["shift_high"] == 0).all()  # paired: no spread at all


def test_traces_of_other_tokens_are_refused(sides) -> None:
    base_dir, _, base, *_ = sides
    other = moeviz.capture(moeviz.load_model(base_dir, dtype="float32"), token_ids=[TOKENS[0][::-1]])
    with pytest.raises(InputError, match="cannot diff these routings"):
        finetune_diff(base, other)


def test_the_command_prints_the_same_numbers(sides, result, capsys) -> None:
    from moeviz.cli import main

    base_dir, adapter, *_ = sides
    ids = ",".join(map(str, TOKENS[0]))
    argv = ["finetune-diff", "--model", str(base_dir), "--adapter", str(adapter), "--token-ids", ids]
    assert main([*argv, "--format", "json", "--draws", "50"]) == 0
    payload = json.loads(capsys.readouterr().out)
    one = finetune_diff(
        *(
            moeviz.capture(moeviz.load_model(base_dir, **kw), token_ids=[TOKENS[0]])
            for kw in ({}, {"adapter": adapter})
        ),
        draws=50,
    )
    assert payload["routing"]["router_mismatch"] == pytest.approx(one.routing.router_mismatch)
    assert [r["shift"] for r in payload["load_shift"]] == pytest.approx(one.load_shift["shift"].tolist())
    norms = [r["norm"] for r in payload["router_delta"]]
    assert norms == pytest.approx(result.router_delta["norm"].tolist())
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "router_delta" in text and f"LoRA r={RANK}" in text and "balance:" in text
    assert main(["finetune-diff", "--model", str(base_dir), "--token-ids", ids]) == 2
    assert "give --adapter DIR" in capsys.readouterr().err


# ---- per domain: which experts took it ---------------------------------------------------------------
DOMAINS = ["code", "prose"]  # the domain of each sequence of TOKENS


def dispatch_table(trace) -> pd.DataFrame:
    """One row per dispatched slot: layer, domain, expert (written apart from moeviz, from the trace's
    arrays and its tokens' seq)."""
    seqs = trace.tokens["seq"].to_numpy()
    parts = []
    for routing in trace.layers:
        k = routing.experts.shape[1]
        parts.append(
            pd.DataFrame(
                {
                    "layer": routing.layer,
                    "token": np.repeat(routing.token_rows, k),
                    "domain": [DOMAINS[s] for s in np.repeat(seqs[routing.token_rows], k)],
                    "expert": routing.experts.reshape(-1),
                }
            )
        )
    table = pd.concat(parts, ignore_index=True)
    return table[table["expert"] >= 0]


def groupby_shares(trace) -> pd.Series:
    """share of (layer, domain, expert) = its slots / the domain's slots at that layer, by groupby."""
    table = dispatch_table(trace)
    counts = table.groupby(["layer", "domain", "expert"]).size()
    return counts / counts.groupby(level=["layer", "domain"]).transform("sum")


@pytest.fixture(scope="module")
def by_domain(sides):
    _, _, base, tuned, wb, wt = sides
    return finetune_diff(base, tuned, base_weights=wb, tuned_weights=wt, seq_domains=DOMAINS, draws=2000)


def test_domain_shares_equal_a_groupby_of_the_dispatch(sides, by_domain) -> None:
    _, _, base, tuned, _, _ = sides
    frame = by_domain.domain_shift.set_index(["layer", "domain", "expert"])
    before, after = groupby_shares(base), groupby_shares(tuned)
    full = pd.MultiIndex.from_product(
        [[r.layer for r in base.layers], DOMAINS, range(base.layers[0].num_experts)],
        names=["layer", "domain", "expert"],
    )
    assert frame.index.sort_values().equals(full)
    before, after = before.reindex(full, fill_value=0.0), after.reindex(full, fill_value=0.0)
    np.testing.assert_allclose(frame.loc[full, "share_base"], before)
    np.testing.assert_allclose(frame.loc[full, "share_tuned"], after)
    np.testing.assert_allclose(frame.loc[full, "shift"], after - before)
    assert (frame["tokens"] == 96).all()  # one sequence of 96 tokens per domain
    assert frame["shift"].abs().max() > 0  # the adapter moved something


def test_domain_bands_are_a_paired_bootstrap_over_the_domains_tokens(sides, by_domain) -> None:
    _, _, base, tuned, _, _ = sides
    rng = np.random.default_rng(11)
    draws, level = 2000, by_domain.level
    seqs = base.tokens["seq"].to_numpy()
    for x, y in zip(base.layers, tuned.layers, strict=True):
        e = x.num_experts
        for d, name in enumerate(DOMAINS):
            rows = np.flatnonzero(seqs[x.token_rows] == d)
            picks = rows[rng.integers(0, len(rows), size=(draws, len(rows)))]
            spread = []
            for p in picks:
                cb, ca = hand_counts(y.experts[p], e), hand_counts(x.experts[p], e)
                spread.append(cb / cb.sum() - ca / ca.sum())
            low, high = np.quantile(np.stack(spread), [(1 - level) / 2, (1 + level) / 2], axis=0)
            shift = by_domain.domain_shift
            got = shift[(shift["layer"] == x.layer) & (shift["domain"] == name)]
            np.testing.assert_allclose(got["shift_low"], low, atol=0.012)
            np.testing.assert_allclose(got["shift_high"], high, atol=0.012)
            np.testing.assert_array_equal(got["took"], (got["shift_low"] > 0) & (got["shift"] > 0))
            np.testing.assert_array_equal(got["left"], got["shift_high"] < 0)
    took = by_domain.took_domains()
    assert len(took) == int(by_domain.domain_shift["took"].sum()) and (took["shift"] > 0).all()


def test_specialisation_before_and_after_by_hand(sides, by_domain) -> None:
    """ds = max_e #{t ∈ D : e ∈ S_t} / #{t ∈ D} of each trace, by groupby over unique (token, expert)."""
    _, _, base, tuned, _, _ = sides
    spec = by_domain.specialisation.set_index(["layer", "domain"])
    for side, trace in (("base", base), ("tuned", tuned)):
        table = dispatch_table(trace).drop_duplicates(["layer", "token", "expert"])
        per = table.groupby(["layer", "domain", "expert"]).size() / 96
        ds = per.groupby(level=["layer", "domain"]).max()
        top = per.groupby(level=["layer", "domain"]).idxmax().map(lambda key: key[2])
        np.testing.assert_allclose(spec.loc[ds.index, f"ds_{side}"], ds)
        assert spec.loc[top.index, f"top_expert_{side}"].tolist() == top.tolist()
    np.testing.assert_allclose(spec["ds_change"], spec["ds_tuned"] - spec["ds_base"])
    took = by_domain.domain_shift.groupby(["layer", "domain"])["took"].sum()
    assert spec.loc[took.index, "took"].tolist() == took.tolist()
    k, e = base.layers[0].k, base.layers[0].num_experts
    assert (spec["baseline"] == k / e).all()


def test_no_change_pair_takes_no_domain(sides) -> None:
    """Base vs base: every shift 0 and every band [0, 0]. Base vs its own routing shuffled within each
    domain (the same per-domain counts, other tokens): shift 0, bands with a spread that still hold 0."""
    import dataclasses

    from moeviz.analysis.finetune_diff import domain_shift_frame

    _, _, base, _, _, _ = sides
    same = domain_shift_frame(base, base, DOMAINS, draws=300)
    assert (same["shift"] == 0).all() and not same["took"].any() and not same["left"].any()
    assert (same["shift_low"] == 0).all() and (same["shift_high"] == 0).all()
    rng = np.random.default_rng(5)
    seqs = base.tokens["seq"].to_numpy()
    layers = []
    for routing in base.layers:
        order = np.arange(len(routing.experts))
        for d in range(len(DOMAINS)):
            rows = np.flatnonzero(seqs[routing.token_rows] == d)
            order[rows] = rng.permutation(rows)
        layers.append(dataclasses.replace(routing, experts=routing.experts[order]))
    shuffled = dataclasses.replace(base, layers=layers)
    frame = domain_shift_frame(base, shuffled, DOMAINS, draws=500)
    np.testing.assert_allclose(frame["shift"], 0, atol=1e-12)
    assert ((frame["shift_low"] <= 0) & (frame["shift_high"] >= 0)).all()
    assert (frame["shift_high"] - frame["shift_low"]).max() > 0  # a real spread, not a degenerate band
    assert not frame["took"].any()


def test_too_few_domain_labels_are_refused(sides) -> None:
    _, _, base, tuned, _, _ = sides
    with pytest.raises(InputError, match="cannot label the tokens by domain"):
        finetune_diff(base, tuned, seq_domains=["code"])


@pytest.fixture(scope="module")
def with_tokenizer(tiny_model_dir, tmp_path_factory):
    """(base folder with the mixtral sample's tokenizer, a LoRA adapter over it)."""
    import shutil

    from moeviz.models.loading import sample_models_dir

    base_dir = tiny_model_dir(FAMILY, vocab_size=2048)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(sample_models_dir() / "mixtral-healthy" / name, base_dir / name)
    adapter = save_adapter(tmp_path_factory.mktemp("ft") / "lora", rank=RANK, seed=3, vocab_size=2048)
    return base_dir, adapter


def test_the_command_on_a_corpus_prints_the_domain_frame(with_tokenizer, tmp_path, capsys) -> None:
    """`finetune-diff --corpus`: the JSON's domain frames equal finetune_diff on the corpus's windows
    captured here (cut by the corpus reader and the tokenizer directly)."""
    from moeviz.cli import main
    from moeviz.corpus import chunk_token_ids, read_corpus

    base_dir, adapter = with_tokenizer
    corpus = tmp_path / "corpus.jsonl"
    texts = {"code": "def f(x):\n    return x * 2\n" * 12, "prose": "The cat sat on the mat today. " * 12}
    corpus.write_text("".join(json.dumps({"domain": d, "text": t}) + "\n" for d, t in texts.items()))
    argv = ["finetune-diff", "--model", str(base_dir), "--adapter", str(adapter), "--corpus", str(corpus)]
    common = ["--chunk-tokens", "64", "--draws", "200", "--shuffles", "20"]
    assert main([*argv, *common, "--format", "json"]) == 0
    payload = json.loads(capsys.readouterr().out)

    base = moeviz.load_model(base_dir)
    windows, labels = [], []
    for doc in read_corpus(corpus):
        chunks = chunk_token_ids(base.tokenizer(doc.text)["input_ids"], 64)
        windows += chunks
        labels += [doc.domain] * len(chunks)
    tuned = moeviz.load_model(base_dir, adapter=adapter)
    traces = [moeviz.capture(m, token_ids=windows) for m in (base, tuned)]
    direct = finetune_diff(*traces, seq_domains=labels, draws=200, shuffles=20)
    got = pd.DataFrame(payload["domain_shift"])
    for column in ("share_base", "share_tuned", "shift", "shift_low", "shift_high"):
        np.testing.assert_allclose(got[column], direct.domain_shift[column], atol=1e-12)
    assert got["took"].tolist() == direct.domain_shift["took"].tolist()
    spec = pd.DataFrame(payload["specialisation"])
    np.testing.assert_allclose(spec["ds_base"], direct.specialisation["ds_base"])
    np.testing.assert_allclose(spec["ds_tuned"], direct.specialisation["ds_tuned"])
    assert set(spec["domain"]) == set(texts)

    assert main([*argv, *common]) == 0
    text = capsys.readouterr().out
    assert "took the domain" in text and "specialisation per domain" in text
    assert main([*argv, "--max-chunks", "0"]) == 2
    assert "--max-chunks must be >= 1" in capsys.readouterr().err


def test_the_snippet_gives_the_sections_numbers(with_tokenizer) -> None:
    """`snippets.finetune_view` run as code: `diff` and `by_domain` equal finetune_diff of captures made
    here (the evaluation corpus one capture per domain, labelled by `eval_batch`)."""
    from moeviz.samples import DOMAINS, eval_batch
    from moeviz.snippets import SnippetInput, finetune_view

    base_dir, adapter = with_tokenizer
    text = "def f(x):\n    return x * 2\n"
    code = finetune_view(
        SnippetInput(str(base_dir), text=text),
        SnippetInput(str(base_dir), text=text, load_kwargs={"adapter": str(adapter)}),
        domains=True,
    )
    names: dict = {}
    exec(code, names)
    base, tuned = moeviz.load_model(base_dir), moeviz.load_model(base_dir, adapter=adapter)
    weights = {"base_weights": router_weights(base), "tuned_weights": router_weights(tuned)}
    diff = finetune_diff(moeviz.capture(base, text), moeviz.capture(tuned, text), **weights)
    pd.testing.assert_frame_equal(names["diff"].load_shift, diff.load_shift)
    pd.testing.assert_frame_equal(names["diff"].router_delta, diff.router_delta)
    batch = eval_batch(base)
    windows = [[i for i, d in zip(batch.token_ids, batch.domains, strict=True) if d == x] for x in DOMAINS]
    corpus = [moeviz.Trace.concat([moeviz.capture(m, token_ids=w) for w in windows]) for m in (base, tuned)]
    by_domain = finetune_diff(*corpus, seq_domains=batch.domains, **weights)
    pd.testing.assert_frame_equal(names["by_domain"].domain_shift, by_domain.domain_shift)
    pd.testing.assert_frame_equal(names["by_domain"].specialisation, by_domain.specialisation)
