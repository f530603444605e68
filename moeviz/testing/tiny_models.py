"""Tiny random-weight MoE models of every supported family, for tests and benchmarks (a public helper).

    from moeviz.testing.tiny_models import FAMILIES, build_tiny_model, save_tiny_model

    model = build_tiny_model("qwen3_moe")              # an nn.Module, in eval mode, seeded
    folder = save_tiny_model("mixtral", tmp_path / "m")  # a Hugging Face folder moeviz.load_model opens

`FAMILIES` lists the model types (`SEQ2SEQ` the encoder-decoders among them); `tiny_config(family,
**overrides)` gives the config alone. The models take token ids below `VOCAB` and ship no tokenizer. Each
config is small (2-4 layers, 4-8 experts) and its routing is non-degenerate: routers and balancing biases
are randomised after construction (several families zero-initialise them, which makes routing trivial).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from moeviz.testing.zoo_configs import ZOO_AUTO, ZOO_CONFIGS, ZOO_RANDOMISE

VOCAB = 128
HIDDEN = 64

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

# model_type -> config overrides. Kept to 2-4 layers, 4-8 experts.
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "minimax": dict(
        num_hidden_layers=2,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        block_size=16,
    ),
    "qwen2_moe": dict(
        num_hidden_layers=2,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        num_hidden_layers=2,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        norm_topk_prob=True,
    ),
    "qwen3_next": dict(
        num_hidden_layers=4,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        norm_topk_prob=True,
    ),
    "olmoe": dict(num_hidden_layers=2, intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "hunyuan_v1_moe": dict(num_hidden_layers=2, intermediate_size=32, num_experts=8, moe_topk=2, head_dim=16),
    "jamba": dict(
        num_hidden_layers=4,
        intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
    ),
    "deepseek_v2": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,  # MLA: one latent KV per head
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=1,  # v2 scores a group by its max: with topk_group >= k the limit never binds
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
    "deepseek_v3": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,  # MLA: one latent KV per head
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        norm_topk_prob=True,
    ),
    "glm4_moe": dict(
        num_hidden_layers=3,
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.8,
        first_k_dense_replace=1,
        head_dim=16,
        norm_topk_prob=True,
    ),
    "kimi_linear": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,  # MLA: one latent KV per head
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        num_expert_group=2,
        topk_group=1,
        routed_scaling_factor=2.0,
        first_k_dense_replace=1,
        head_dim=16,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        mla_use_nope=True,
        moe_renormalize=True,
        linear_attn_config={
            "kda_layers": [1, 2],
            "full_attn_layers": [3],
            "head_dim": 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        },
    ),
    "ernie4_5_moe": dict(
        num_hidden_layers=2,
        intermediate_size=64,
        moe_intermediate_size=32,
        moe_num_experts=8,
        moe_k=2,
        moe_layer_start_index=0,
        moe_num_shared_experts=0,
        head_dim=16,
    ),
    "gpt_oss": dict(
        num_hidden_layers=2,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "granitemoe": dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "phimoe": dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "dbrx": dict(
        n_layers=2,
        d_model=HIDDEN,
        n_heads=4,
        max_seq_len=512,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2},
    ),
    "llama4_text": dict(
        num_hidden_layers=2,
        intermediate_size=32,
        intermediate_size_mlp=64,
        num_local_experts=8,
        num_experts_per_tok=1,
        head_dim=16,
        interleave_moe_layer_step=1,
        attention_chunk_size=8,
    ),
    "jetmoe": dict(
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        kv_channels=16,
        intermediate_size=32,
    ),
    "switch_transformers": dict(
        d_model=HIDDEN,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        num_experts=4,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        expert_capacity=4,
        decoder_start_token_id=0,
    ),
    "nllb-moe": dict(
        d_model=HIDDEN,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_experts=4,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        expert_capacity=8,
        moe_eval_capacity_token_fraction=0.5,  # eval capacity = ceil(0.5·N): some tokens are dropped
        decoder_start_token_id=2,
    ),
}

FAMILIES = tuple(FAMILY_CONFIGS) + tuple(t for t in ZOO_CONFIGS if t not in FAMILY_CONFIGS)
SEQ2SEQ = {"switch_transformers", "nllb-moe"}
# the common vocabulary, special tokens and context every zoo config (and each text config in it) gets
_ZOO_COMMON = {
    k: v for k, v in _COMMON.items() if k not in ("hidden_size", "num_attention_heads", "num_key_value_heads")
}


def tiny_config(family: str, **overrides: Any):
    from transformers import AutoConfig

    if family in ZOO_CONFIGS:
        return AutoConfig.for_model(family, **{**_with_common(ZOO_CONFIGS[family]), **overrides})
    kwargs = dict(_COMMON)
    if family in ("dbrx",):
        kwargs = {
            k: v
            for k, v in kwargs.items()
            if k
            not in ("hidden_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
        }
    if family in SEQ2SEQ:
        kwargs = {
            k: v
            for k, v in kwargs.items()
            if k not in ("hidden_size", "num_attention_heads", "num_key_value_heads")
        }
    kwargs.update(FAMILY_CONFIGS[family])
    kwargs.update(overrides)
    return AutoConfig.for_model(family, **kwargs)


def _with_common(config: dict[str, Any]) -> dict[str, Any]:
    """A zoo config with `_ZOO_COMMON` added to it and to every text config nested in it (a config given
    its own value keeps it)."""
    out = {**_ZOO_COMMON, **config}
    for key, value in config.items():
        if isinstance(value, dict) and key in ("text_config", "thinker_config", "talker_config"):
            out[key] = _with_common(value)
    return out


def randomise_routing(model: torch.nn.Module, seed: int = 0, extra: tuple[str, ...] = ()) -> None:
    """Give routers and balancing biases non-trivial values (several families zero-init them); `extra`:
    more name substrings of a family's router or bias tensors. Scales inside a router (Gemma 4's
    `per_expert_scale`, Inkling's `global_scale`) are left alone: a negative one flips the weights. A hash
    router's token-id table (`tid2eid` [V, k]) gets k distinct random experts per token id."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Balancing biases are buffers in some families (deepseek_v3, glm4_moe, kimi_linear).
        for name, param in itertools.chain(model.named_parameters(), model.named_buffers()):
            lname = name.lower()
            if not param.is_floating_point():
                if lname.endswith("tid2eid"):
                    _randomise_hash_table(model, param, gen)
                continue
            if "scale" in lname.rsplit(".", 1)[-1] or "shared_expert_gate" in lname:
                continue
            if any(key in lname for key in (*_ROUTING_NAMES, *extra)):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


_ROUTING_NAMES = ("e_score_correction_bias", "router", ".gate.", "mlp.gate.weight", ".wg.", "classifier")


def _randomise_hash_table(model: torch.nn.Module, table: torch.Tensor, gen: torch.Generator) -> None:
    """k distinct experts per token id, out of the model's routed experts."""
    experts = model.config.get_text_config().num_local_experts
    rows = [torch.randperm(experts, generator=gen)[: table.shape[1]] for _ in range(table.shape[0])]
    table.copy_(torch.stack(rows))


def build_tiny_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    if family in ZOO_CONFIGS:
        auto = getattr(transformers, ZOO_AUTO[family])
    else:
        auto = transformers.AutoModelForSeq2SeqLM if family in SEQ2SEQ else transformers.AutoModelForCausalLM
    model = auto.from_config(config)
    randomise_routing(model, seed, ZOO_RANDOMISE.get(family, ()))
    if family == "zaya":  # experts' balancing biases near the skip class's −1: some tokens skip
        for name, bias in model.named_buffers():
            if name.endswith("balancing_biases"):
                bias[:-1] = bias[:-1] * 0.02 - 1.06
    return model.eval()


def save_tiny_model(family: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    model = build_tiny_model(family, seed, **overrides)
    model.save_pretrained(folder)
    return Path(folder)
