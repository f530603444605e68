"""LoRA adapters as users make them (peft's `get_peft_model` + `save_pretrained`) over a tiny base, for the
adapter and fine-tune tests."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILY = "qwen3_moe"
ATTENTION = ["q_proj", "v_proj"]
ROUTER_AND_EXPERTS = ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def save_adapter(
    folder: Path,
    *,
    random_b: bool = True,
    rank: int = 4,
    seed: int = 1,
    safe: bool = True,
    modules: list[str] | None = None,
    parameters: list[str] | None = None,
    **overrides,
) -> Path:
    """A LoRA adapter saved by peft over a fresh tiny base (`overrides`: the base's config); B = 0 (peft's
    default init: the update is zero) unless `random_b`."""
    from peft import LoraConfig, get_peft_model

    from moeviz.testing.tiny_models import build_tiny_model

    base = build_tiny_model(FAMILY, **overrides)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=ATTENTION if modules is None else modules,
        target_parameters=ROUTER_AND_EXPERTS if parameters is None else parameters,
        init_lora_weights=not random_b,
    )
    get_peft_model(base, config).save_pretrained(folder, safe_serialization=safe)
    return folder
