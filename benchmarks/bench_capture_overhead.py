"""Router-capture overhead: `moeviz.capture` vs a plain forward of the same model on the same 512 tokens.

Runs are interleaved (plain, capture, plain, capture, ...) so machine noise hits both alike; the figure is
the ratio of medians. Target (foundation issue): capture adds at most 5% (ratio <= 1.05).

    python benchmarks/bench_capture_overhead.py [--tokens 512] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import moeviz
from moeviz.models.loading import LoadedModel
from moeviz.models.sites import find_moe_sites
from moeviz.trace import ModelInfo


def mid_size_mixtral() -> LoadedModel:
    """A Mixtral of more realistic proportions (d=512, 8 layers, 8 experts) with random weights."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
    )
    model = MixtralForCausalLM(config).eval()
    info = ModelInfo(
        source="random mixtral d=512 L=8 E=8", model_type="mixtral", architecture="Mixtral", num_layers=8
    )
    return LoadedModel(model, None, find_moe_sites(model), info, folder=None, max_length=4096)


def measure(loaded: LoadedModel, tokens: int, repeats: int) -> tuple[float, float]:
    vocab = loaded.model.config.vocab_size
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    id_list = ids[0].tolist()

    def plain() -> None:
        with torch.inference_mode():
            loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids))

    def captured() -> None:
        moeviz.capture(loaded, token_ids=[id_list])

    for _ in range(3):  # warm-up
        plain()
        captured()
    plain_times, capture_times = [], []
    for _ in range(repeats):
        for fn, sink in ((plain, plain_times), (captured, capture_times)):
            start = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - start)
    return statistics.median(plain_times), statistics.median(capture_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print(
        f"torch threads: {torch.get_num_threads()}, tokens: {args.tokens}, "
        f"repeats: {args.repeats} (interleaved)"
    )
    for name, loaded in (
        ("sample:mixtral-healthy", moeviz.load_model("sample:mixtral-healthy")),
        ("mid-size", mid_size_mixtral()),
    ):
        plain, captured = measure(loaded, args.tokens, args.repeats)
        ratio = captured / plain
        verdict = "OK" if ratio <= 1.05 else "ABOVE TARGET"
        print(
            f"{name:<22} plain {plain * 1e3:8.2f} ms   capture {captured * 1e3:8.2f} ms   "
            f"ratio {ratio:.3f}  (target <= 1.05: {verdict})"
        )


if __name__ == "__main__":
    main()
