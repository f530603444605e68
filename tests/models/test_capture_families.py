"""For every supported family: save a tiny random model, load it through moeviz, capture a padded batch,
and compare with an independent re-implementation of the family's routing rule
(tests/support/reference_routing.py).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import moeviz
from moeviz import cli
from moeviz.testing.tiny_models import SEQ2SEQ, VOCAB
from moeviz.trace import Trace
from tests.support.reference_routing import RULE_FAMILIES, canonical_order, reference_routing

SEQS = [list(range(3, 12)), [40, 41, 42, 43, 44]]  # 9 and 5 tokens: the second is right-padded
# Families with a balancing bias, and the capacity-limited ones: each must show its special behaviour.
BIASED = {"deepseek_v3", "glm4_moe", "kimi_linear", "ernie4_5_moe"}


def _forward_kwargs(loaded, seqs):
    """The exact batch capture() builds: right padding with the config's pad id; seq2seq decoders are fed
    the text shifted right behind the start token."""
    width = max(map(len, seqs))
    pad = loaded.model.config.pad_token_id
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, seq in enumerate(seqs):
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = 1
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if loaded.is_encoder_decoder:
        dec = torch.full_like(ids, pad)
        dec[:, 0] = loaded.model.config.decoder_start_token_id
        dec[:, 1:] = ids[:, :-1]
        dec[mask == 0] = pad
        kwargs.update(decoder_input_ids=dec, decoder_attention_mask=mask)
    return kwargs, width


@pytest.mark.parametrize("family", RULE_FAMILIES)
def test_capture_equals_reference_rule(tiny_model_dir, family):
    overrides = {"expert_capacity": 3} if family == "switch_transformers" else {}
    loaded = moeviz.load_model(tiny_model_dir(family, **overrides))
    trace = moeviz.capture(loaded, token_ids=SEQS)
    kwargs, width = _forward_kwargs(loaded, SEQS)
    reference = reference_routing(loaded.model, family, **kwargs)
    assert sorted(reference) == sorted(trace.layer_keys)
    for routing in trace.layers:
        ref = reference[routing.key]
        tokens = trace.tokens.iloc[routing.token_rows]
        flat = tokens.seq.to_numpy() * width + tokens.pos.to_numpy()  # row in the [B·S] the router saw
        assert len(flat) == sum(map(len, SEQS)), "padding must be masked out"
        ref_experts, ref_weights = canonical_order(ref.experts[flat], ref.weights[flat])
        np.testing.assert_array_equal(routing.experts, ref_experts, err_msg=f"{family} {routing.key}")
        np.testing.assert_allclose(routing.weights, ref_weights, atol=1e-6, err_msg=f"{family} {routing.key}")
        np.testing.assert_allclose(routing.logits, ref.logits[flat], atol=1e-5)
        if family in BIASED:
            assert routing.bias is not None and np.abs(routing.bias).max() > 0
            unbiased = np.sort(np.argsort(-routing.scores, axis=1)[:, : routing.k], axis=1)
            assert (unbiased != np.sort(routing.experts, axis=1)).any(axis=1).any(), "bias never mattered"
    if family in ("switch_transformers", "nllb-moe"):
        assert any((r.experts == -1).any() for r in trace.layers), "capacity should drop some tokens"


def test_group_limited_routing_binds(tiny_model_dir):
    """DeepSeek-V3 with 4 groups, best 2 kept: some decisions differ from plain top-k on biased scores."""
    loaded = moeviz.load_model(tiny_model_dir("deepseek_v3"))
    trace = moeviz.capture(loaded, token_ids=SEQS)
    config = loaded.model.config
    assert (config.n_group, config.topk_group) == (4, 2)
    differs = 0
    for routing in trace.layers:
        plain = np.sort(np.argsort(-routing.selection_scores, axis=1)[:, : routing.k], axis=1)
        differs += (plain != np.sort(routing.experts, axis=1)).any(axis=1).sum()
    assert differs > 0


@pytest.mark.parametrize("family", RULE_FAMILIES)
def test_cli_capture_on_every_family(tiny_model_dir, tmp_path, family):
    out = tmp_path / f"{family}.parquet"
    ids = ",".join(str(i) for i in range(3, min(VOCAB, 15)))
    assert (
        cli.main(["capture", "--model", str(tiny_model_dir(family)), "--token-ids", ids, "--out", str(out)])
        == 0
    )
    trace = Trace.from_parquet(out)
    frame = trace.routing_frame()
    streams = 2 if family in SEQ2SEQ else 1
    assert len(trace.tokens) == 12 * streams
    assert frame.groupby(["site", "layer"]).size().min() >= 12
    # the file holds what the library captures of the same ids (the same code path: bitwise)
    loaded = moeviz.load_model(tiny_model_dir(family))
    want = moeviz.capture(loaded, token_ids=[list(range(3, min(VOCAB, 15)))])
    pd.testing.assert_frame_equal(frame, want.routing_frame())
    for got, ref in zip(trace.layers, want.layers, strict=True):
        np.testing.assert_array_equal(got.logits, ref.logits)
