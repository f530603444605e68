"""Random models shaped like today's largest MoE models (narrow widths), for the app tests and benchmark at
scale: DeepSeek-V3 (256 routed experts, top-8 within the best 4 of 8 groups, 61 blocks of which the first 3
dense, sigmoid scores with a balancing bias) and Kimi-K2 (384 experts, top-8, one group; 8 blocks here to
keep it quick). Both carry the mixtral sample's tokenizer (2,048 ids), so the example prompt works and a
local folder opens them (test code: it needs the repository's samples)."""

from __future__ import annotations

import shutil
from pathlib import Path

from moeviz.testing.tiny_models import save_tiny_model

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "sample_models" / "mixtral-healthy"
_NARROW = dict(
    hidden_size=32,
    intermediate_size=32,
    moe_intermediate_size=8,
    vocab_size=2048,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=8,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    num_experts_per_tok=8,
)
SHAPES = {  # name -> deepseek_v3 config overrides
    "deepseek-v3": dict(
        _NARROW, n_routed_experts=256, n_group=8, topk_group=4, num_hidden_layers=61, first_k_dense_replace=3
    ),
    "kimi-k2": dict(
        _NARROW, n_routed_experts=384, n_group=1, topk_group=1, num_hidden_layers=8, first_k_dense_replace=1
    ),
}


def with_tokenizer(folder: Path) -> Path:
    """Give a saved tiny model the sample's tokenizer (its vocabulary is the sample's size)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, Path(folder) / name)
    return Path(folder)


def save_scale_model(name: str, folder: Path, **overrides) -> Path:
    """The `name` model of SHAPES (random weights, seeded) saved in `folder` with the sample's tokenizer."""
    return with_tokenizer(save_tiny_model("deepseek_v3", folder, **{**SHAPES[name], **overrides}))


def save_scale_series(name: str, folder: Path, steps: tuple[int, ...] = (0, 100, 1000)) -> Path:
    """A checkpoint series of the `name` model in `folder`: one `step-<n>` folder per step, every weight
    moved along a straight line from a random start (seed 1) to the final model (seed 0), so routing
    settles towards the last checkpoint's; each checkpoint carries the sample's tokenizer."""
    import torch

    from moeviz.testing.tiny_models import build_tiny_model

    final = build_tiny_model("deepseek_v3", 0, **SHAPES[name])
    start = build_tiny_model("deepseek_v3", 1, **SHAPES[name]).state_dict()
    end = {key: value.clone() for key, value in final.state_dict().items()}
    for i, step in enumerate(steps):
        t = i / (len(steps) - 1)
        with torch.no_grad():
            for key, value in final.state_dict().items():
                if value.is_floating_point():
                    value.copy_((1 - t) * start[key] + t * end[key])
        final.save_pretrained(Path(folder) / f"step-{step:05d}")
        with_tokenizer(Path(folder) / f"step-{step:05d}")
    return Path(folder)
