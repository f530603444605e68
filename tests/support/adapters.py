"""LoRA adapters as users make them (peft's `get_peft_model` + `save_pretrained`) over a tiny base, for the
adapter and fine-tune tests."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILY = "qwen3_moe"
ATTENTION = ["q_proj", "v_proj"]
ROUTER_AND_EXPERTS = ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def save_adapter(folder: Path, **options) -> Path:
    """A LoRA adapter saved by peft over a fresh tiny base (`save_adapter_over`'s `options`; any other
    keyword is the base's config); B = 0 (peft's default init: the update is zero) unless `random_b`."""
    from moeviz.testing.tiny_models import build_tiny_model

    names = ("random_b", "rank", "seed", "safe", "modules", "parameters")
    adapter = {name: options.pop(name) for name in names if name in options}
    return save_adapter_over(build_tiny_model(FAMILY, **options), folder, **adapter)


def save_adapter_over(
    base: torch.nn.Module,
    folder: Path,
    *,
    random_b: bool = True,
    rank: int = 4,
    seed: int = 1,
    safe: bool = True,
    modules: list[str] | None = None,
    parameters: list[str] | None = None,
) -> Path:
    """`save_adapter` over a given transformers `base` (peft wraps it in place: pass a copy to keep it)."""
    from peft import LoraConfig, get_peft_model

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


# ---- a fine-tune's checkpoint series (adapters saved every N steps) -----------------------------------
SERIES_MODULES = ["q_proj", "v_proj"]
SERIES_PARAMETERS = ["mlp.gate.weight"]  # the router: the fine-tune moves the routing directly


def save_adapter_series(
    folder: Path,
    base: Path,
    steps: list[int],
    *,
    rank: int = 4,
    seed: int = 1,
    name: str = "checkpoint-{step}",
    declared_base: str | None = None,
) -> list[Path]:
    """A fine-tune's adapters as the HF Trainer saves them (`folder/checkpoint-<step>/` with
    adapter_config.json and adapter_model.safetensors, by peft's `save_pretrained`) over the model in `base`:
    one seeded LoRA whose B matrices grow with the step (B_s = B · s / max(steps): deterministic, and each
    checkpoint further from the base). `declared_base` replaces the base the configs name (a path that
    does not exist here, as on another machine)."""
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=SERIES_MODULES,
        target_parameters=SERIES_PARAMETERS,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, config)
    full = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_B" in n}
    saved = []
    for step in steps:
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if n in full:
                    p.copy_(full[n] * (step / max(steps)))
        out = folder / name.format(step=step)
        peft_model.save_pretrained(out, safe_serialization=True)
        if declared_base is not None:
            path = out / "adapter_config.json"
            raw = json.loads(path.read_text())
            path.write_text(json.dumps({**raw, "base_model_name_or_path": declared_base}))
        saved.append(out)
    return saved


def merge_as_full_checkpoint(base: Path, adapter: Path, out: Path) -> Path:
    """peft's own merge of `adapter` into `base` (`PeftModel.from_pretrained(...).merge_and_unload()`),
    saved as a full checkpoint folder in float32 with the base's tokenizer: a series of these is the
    independent path to an adapter series' timeline."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):
        if (base / tokenizer_file).is_file():
            shutil.copy(base / tokenizer_file, out / tokenizer_file)
    return out


def adapter_run_fixtures(steps: list[int], declared_base: str):
    """The fixtures of a test module on a fine-tune's run folder, bound by name in the module (`base, run =
    adapter_run_fixtures(STEPS, DECLARED)`): `base` (the bundled sample `mixtral-healthy`) and `run` (its
    adapter series at `steps` as the Trainer saves it on another machine: the base its adapters name,
    `declared_base`, is not here; beside the checkpoints the Trainer's log folder `runs/`, not one)."""
    import pytest

    from moeviz.models.loading import sample_models_dir

    @pytest.fixture(scope="module")
    def base() -> Path:
        return sample_models_dir() / "mixtral-healthy"

    @pytest.fixture(scope="module")
    def run(tmp_path_factory, base) -> Path:
        folder = tmp_path_factory.mktemp("finetune") / "run"
        save_adapter_series(folder, base, steps, declared_base=declared_base)
        (folder / "runs").mkdir()
        return folder

    return base, run
