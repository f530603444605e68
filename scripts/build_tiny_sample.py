"""Build `sample_models/tiny-mixtral`: a small random-weight Mixtral with a real BPE tokenizer.

A stand-in default for the app until the trained sample models exist (see the sample-models issue).
Deterministic: fixed seed, tokenizer trained on CPython's own `pydoc_data.topics` text.

    python scripts/build_tiny_sample.py [OUT_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

VOCAB = 1024
SEED = 0


def train_tokenizer(out: Path):
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([topics[key] for key in sorted(topics)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)
    return fast


def build(out: Path) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    from moeviz.testing.tiny_models import randomise_routing

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out)
    torch.manual_seed(SEED)
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    model = MixtralForCausalLM(config).eval()
    randomise_routing(model, SEED)
    model.save_pretrained(out)
    (out / "README.md").write_text(
        "# tiny-mixtral\n\nRandom weights (seed 0), Mixtral architecture: 4 layers, d=64, 8 experts, top-2, "
        f"vocab {len(tokenizer)} (byte-level BPE trained on CPython's pydoc topics, PSF licence).\n"
        "Not trained: routing is driven by random router weights.\n"
        "A stand-in until the trained samples land.\n"
        "Rebuild with `python scripts/build_tiny_sample.py`.\n"
    )
    return out


if __name__ == "__main__":
    target = (
        Path(sys.argv[1])
        if len(sys.argv) > 1
        else Path(__file__).resolve().parents[1] / "sample_models" / "tiny-mixtral"
    )
    print(build(target))
