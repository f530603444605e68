"""Every MoE model type transformers 5.24 ships: the family table covers it, and a tiny model of it (its
config class, routing features kept: `moeviz.testing.zoo_configs`) loads through moeviz and is
captured exactly.

"Exactly" is checked against an independent forward pre-hook on the model's own experts modules (found by
class name, not by moeviz's site discovery): the experts each token was dispatched to, pass by pass for a
looped block. The facts (MoE and hash-routed blocks, routed and zero-computation experts, k, score
function, bias, shared experts, the captured sub-model) are checked against `tests/support/family_facts.py`,
read by hand from each family's modelling code. The families with a hand-written routing rule are checked
against it in `test_capture_families.py`.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import moeviz
from moeviz.errors import UnsupportedModelError
from moeviz.models.config_keys import layer_index
from moeviz.models.families import FAMILIES, SUBMODELS
from moeviz.testing.zoo_configs import ZOO_CONFIGS
from tests.support.family_facts import FACTS

SEQS = [list(range(3, 60)), [60, 61, 62, 63, 64]]  # 57 and 5 tokens: the second is right-padded
ZOO = sorted(ZOO_CONFIGS)
REFUSED = sorted(t for t in ZOO if FAMILIES[t].support == "refused")
CAPTURED = sorted(t for t in ZOO if t not in REFUSED)
# sub-configs of composites that are neither text models nor routed by text (vision, audio, speech output)
NOT_TEXT = re.compile(r"_(vision|audio|encoder|vision_model|vision_encoder|sam_vision_model|audio_encoder)$")
NOT_TEXT_TYPES = {
    "qwen3_omni_moe_talker_text": "Qwen3-Omni's talker turns the thinker's states into speech",
    "qwen3_omni_moe_talker_code_predictor": "Qwen3-Omni's speech codec predictor",
}


def _moe_model_types() -> set[str]:
    """Model types whose transformers modelling code has a router or fused experts (read from the source)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    root = Path(transformers.__file__).parent / "models"
    moe_dirs = {
        path.parent.name
        for path in root.glob("*/modeling_*.py")
        if re.search(r"router_logits|class \w+Experts\(", path.read_text(encoding="utf-8"))
    }
    return {t for t in CONFIG_MAPPING_NAMES if model_type_to_module_name(t) in moe_dirs}


def test_the_family_table_covers_every_moe_model_type_transformers_ships():
    moe_types = {t for t in _moe_model_types() if not NOT_TEXT.search(t) and t not in NOT_TEXT_TYPES}
    missing = sorted(moe_types - set(FAMILIES))
    assert not missing, f"model types with MoE code but no family row: {missing}"
    assert len(moe_types) >= 103  # transformers 5.24
    # every checkpoint type in the table has a tiny model here or in the 21 of tiny_models
    from moeviz.testing.tiny_models import FAMILIES as TINY

    untested = sorted(set(FAMILIES) - set(TINY) - set(SUBMODELS))
    assert not untested, f"family rows without a tiny model: {untested}"


def _independent_dispatch(model: torch.nn.Module, family: str):
    """Pre-hooks on every routed-experts module of `model` (by class name: `…Experts`, not shared ones;
    Doge's `down_embed` lookup), recording the expert ids [N, k] each call received: {module path: [ids]}."""
    seen: dict[str, list[np.ndarray]] = {}

    def hook(name):
        def record(module, args, kwargs):
            values = list(args) + list(kwargs.values())
            if family == "doge":  # down_embed(indices [N, k])
                seen.setdefault(name, []).append(values[0].reshape(-1, values[0].shape[-1]).numpy().copy())
                return
            if len(values) < 3:  # Llama 4's experts get the pre-scaled hidden states alone
                return
            index, weights = values[1], values[2]
            ids = index.reshape(-1, index.shape[-1]).numpy().copy()
            if family == "zaya":  # the skip class reaches the experts as expert 0 with weight 0
                w = weights.reshape(ids.shape).detach().numpy()
                ids[(ids == 0) & (w == 0)] = -2  # resolved to the skip id below
            seen.setdefault(name, []).append(ids)

        return record

    handles = []
    for name, module in model.named_modules():
        routed = type(module).__name__.endswith("Experts") and "shared" not in name.rsplit(".", 1)[-1]
        if routed or (family == "doge" and name.endswith("mlp.down_embed")):
            handles.append(module.register_forward_pre_hook(hook(name), with_kwargs=True))
    return seen, handles


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@pytest.mark.parametrize("family", CAPTURED)
def test_every_family_is_captured_exactly_with_its_facts(tiny_model_dir, family):
    facts = FACTS[family]
    loaded = moeviz.load_model(tiny_model_dir(family))
    seen, handles = _independent_dispatch(loaded.model, family)
    try:
        trace = moeviz.capture(loaded, token_ids=SEQS)
    finally:
        for handle in handles:
            handle.remove()
    width = max(map(len, SEQS))

    blocks = {}
    for routing in trace.layers:
        blocks.setdefault(layer_index(routing.module.removeprefix(facts.text_model)), []).append(routing)
    assert sorted(blocks) == sorted(facts.moe + facts.hashed), "MoE blocks"
    assert sorted(b for b, rs in blocks.items() if rs[0].hash_routed) == sorted(facts.hashed), (
        "hash-routed blocks"
    )
    for block, occurrences in blocks.items():
        assert [r.loop_pass for r in occurrences] == list(range(len(occurrences)))
        assert len(occurrences) in (1, facts.passes), f"block {block}: {len(occurrences)} passes"
        for routing in occurrences:
            where = f"{family} block {block} pass {routing.loop_pass}"
            assert routing.routed_experts == facts.experts, where
            assert routing.zero_experts == facts.zero, where
            assert routing.k == facts.k, where
            assert routing.score_fn == facts.score, where
            assert (routing.bias is not None) == (facts.bias and not routing.hash_routed), where
            assert routing.shared_experts == facts.shared, where
            expected_source = "router_output" if FAMILIES[family].support == "router output" else "dispatch"
            assert routing.decision_source == expected_source, where
            if family == "llama4":  # its experts never see the routing: test_capture_families checks it
                continue
            # the dispatch, against the experts module's own arguments (rows the router saw, padding out)
            experts_module = routing.module.rsplit(".", 1)[0]
            if family == "doge":
                calls = seen[f"{routing.module}.down_embed"]
            else:
                (calls,) = [v for n, v in seen.items() if n.rsplit(".", 1)[0] == experts_module]
            want = calls[routing.loop_pass]
            want = np.where(want == -2, routing.num_experts - 1, want)
            tokens = trace.tokens.iloc[routing.token_rows]
            flat = tokens.seq.to_numpy() * width + tokens.pos.to_numpy()
            np.testing.assert_array_equal(
                np.sort(routing.experts, axis=1), np.sort(want[flat], axis=1), err_msg=where
            )
    config = _text_config(loaded.model.config)
    blocks_in_config = getattr(config, "num_layers", None) if family == "longcat_flash" else None
    blocks_in_config = blocks_in_config or config.num_hidden_layers
    looped = sum(len(rs) - 1 for rs in blocks.values())
    assert trace.model.num_layers == blocks_in_config + looped
    assert loaded.max_length == config.max_position_embeddings
    assert trace.model.language_model.split(" ")[0] == facts.text_model
    if facts.zero:
        assert any((r.experts >= r.routed_experts).any() for r in trace.layers), (
            "no token chose a zero expert"
        )


@pytest.mark.parametrize("family", REFUSED)
def test_refused_families_are_refused_with_the_reason(tiny_model_dir, family):
    with pytest.raises(UnsupportedModelError, match=re.escape(FAMILIES[family].note[:40])):
        moeviz.load_model(tiny_model_dir(family))


@pytest.mark.parametrize("sub", ["glm4v_moe_text", "qwen3_vl_moe_text"])
def test_a_submodel_config_alone_is_refused_naming_what_to_load(tmp_path, sub):
    from transformers import AutoConfig

    AutoConfig.for_model(sub, vocab_size=128).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=f"load the {SUBMODELS[sub]} model"):
        moeviz.load_model(tmp_path)


def test_gemma4_scores_are_the_probabilities_its_router_returns(tiny_model_dir):
    """Gemma 4's router returns probabilities where other routers return logits: moeviz records log p, so the
    scores it derives are the router's own probabilities (not a softmax of probabilities)."""
    loaded = moeviz.load_model(tiny_model_dir("gemma4_text"))
    probs = []
    handles = [
        module.register_forward_hook(lambda m, args, out: probs.append(out[0].detach().clone()))
        for name, module in loaded.model.named_modules()
        if type(module).__name__ == "Gemma4TextRouter"
    ]
    try:
        trace = moeviz.capture(loaded, token_ids=[list(range(3, 40))])
    finally:
        for handle in handles:
            handle.remove()
    assert len(probs) == len(trace.layers)
    for routing, p in zip(trace.layers, probs, strict=True):
        np.testing.assert_allclose(
            routing.scores, p.reshape(routing.scores.shape).numpy(), rtol=1e-5, atol=1e-7
        )


def test_a_token_classifier_is_captured_but_refuses_what_needs_next_tokens(tiny_model_dir):
    """OpenAI's privacy filter labels tokens: its routing is captured (checked above), its logits are not
    read as next-token predictions, and generation and counterfactuals are refused in one line."""
    from moeviz.errors import InputError
    from moeviz.interventions import DisableExpert, counterfactual

    loaded = moeviz.load_model(tiny_model_dir("openai_privacy_filter"))
    assert loaded.is_token_classifier
    trace = moeviz.capture(loaded, token_ids=[list(range(3, 20))])
    assert (trace.tokens["predicted_id"] == -1).all()
    with pytest.raises(InputError, match=r"generate needs next-token predictions.*token classifier"):
        moeviz.capture(loaded, token_ids=[[3, 4, 5]], generate=2)
    with pytest.raises(InputError, match="counterfactual routing needs next-token predictions"):
        counterfactual(loaded, token_ids=[3, 4, 5, 6], interventions=[DisableExpert(expert=1, layer=0)])


def test_a_looped_model_captures_with_attention_and_says_which_layers_have_no_map(tiny_model_dir):
    """The app captures attention with the routing: Inkling-2-Loop's attention runs several times per layer
    (its block-attention residuals, the loop's passes), so those layers get no map, with the reason, and the
    routing is captured as without attention."""
    loaded = moeviz.load_model(tiny_model_dir("inkling2_loop_text"))
    ids = [list(range(3, 20))]
    with_attention = moeviz.capture(loaded, token_ids=ids, attention=True)
    assert any("times in one forward" in reason for reason in with_attention.attention.no_map.values())
    plain = moeviz.capture(loaded, token_ids=ids)
    for a, b in zip(with_attention.layers, plain.layers, strict=True):
        np.testing.assert_array_equal(a.experts, b.experts)
