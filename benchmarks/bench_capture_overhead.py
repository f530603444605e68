"""Router-capture overhead: `moeviz.capture` vs a plain forward of the same model on the same 512 tokens,
with nnsight saving every router's output as the peer.

Measurement (the project's rules): CPU time (`time.process_time`) with one torch thread; the contenders
run interleaved (each round runs every contender once, in an order rotated round by round) so machine
noise hits them alike; per contender the median over the rounds; the ratio is median / plain's median.
The whole measurement is repeated (3 times by default) and the ratio's median and spread (min–max) over
the repeats are printed, per model: the bundled `sample:mixtral-healthy` and a d=512 Mixtral with random
weights (`mid_size_mixtral`). Targets (issue 18): capture ≤ 1.03× plain on the sample, ≤ 1.01× at d=512.

nnsight is a dev extra (`pip install -e .[dev]`), imported only here; without it its column is skipped.

    python benchmarks/bench_capture_overhead.py [--tokens 512] [--rounds 30] [--runs 3] [--models sample,mid]
        [--experts-implementation auto]   # or eager, grouped_mm, batched_mm: how the experts compute
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from record import Figure, flags, record

import moeviz
from moeviz.models.loading import LoadedModel
from moeviz.models.sites import find_moe_sites
from moeviz.trace import ModelInfo

TARGETS = {"sample:mixtral-healthy": 1.03, "mixtral d=512": 1.01}


def mid_size_mixtral(experts_implementation: str = "auto") -> LoadedModel:
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
    if experts_implementation != "auto":
        model.set_experts_implementation(experts_implementation)
    info = ModelInfo(
        source="random mixtral d=512 L=8 E=8", model_type="mixtral", architecture="Mixtral", num_layers=8
    )
    return LoadedModel(model, None, find_moe_sites(model), info, folder=None, max_length=4096)


def nnsight_contender(loaded: LoadedModel, ids: torch.Tensor) -> Callable[[], object] | None:
    """nnsight's documented way to read a module's output: one trace of the forward, each router's output
    saved (`nnsight.save` of the list of `model.layers[i].mlp.gate.output`). None when nnsight is missing.

    nnsight wraps a model for good (every module's `forward` becomes its controller, traced or not), so it
    gets its own copy of the model: the plain forward and moeviz run on the unwrapped one."""
    try:
        import nnsight
    except ImportError:
        return None
    wrapped = nnsight.NNsight(copy.deepcopy(loaded.model))
    names = [site.name for site in loaded.sites]  # "model.layers.3.mlp.gate"

    def envoy(name: str):
        node = wrapped
        for part in name.split("."):
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        return node

    routers = [envoy(name) for name in names]
    mask = torch.ones_like(ids)

    def traced() -> object:
        with torch.inference_mode(), wrapped.trace(input_ids=ids, attention_mask=mask):
            saved = nnsight.save([router.output for router in routers])
        return saved

    return traced


def measure(loaded: LoadedModel, tokens: int, rounds: int) -> dict[str, float]:
    """One measurement: median CPU seconds per contender over `rounds` interleaved rounds."""
    vocab = loaded.model.config.vocab_size
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    id_list = ids[0].tolist()
    mask = torch.ones_like(ids)

    def plain() -> object:
        with torch.inference_mode():
            return loaded.model(input_ids=ids, attention_mask=mask)

    def captured() -> object:
        return moeviz.capture(loaded, token_ids=[id_list])

    contenders: dict[str, Callable[[], object]] = {"plain": plain, "moeviz": captured}
    peer = nnsight_contender(loaded, ids)
    if peer is not None:
        contenders["nnsight"] = peer
    names = list(contenders)
    for _ in range(3):  # warm-up
        for name in names:
            contenders[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            start = time.process_time()
            contenders[name]()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds per measurement")
    parser.add_argument("--runs", type=int, default=3, help="times the whole measurement is repeated")
    parser.add_argument("--models", default="sample,mid", help="comma-separated: sample, mid")
    parser.add_argument(
        "--experts-implementation", default="auto", help="load_model's: auto, eager, grouped_mm, batched_mm"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        import nnsight

        peer = f"nnsight {nnsight.__version__}"
    except ImportError:
        peer = "nnsight not installed (pip install -e .[dev]): its column is skipped"
    print(
        f"torch threads: {torch.get_num_threads()}, tokens: {args.tokens}, rounds: {args.rounds} "
        f"(interleaved, CPU time, medians), runs: {args.runs}; peer: {peer}"
    )
    experts = args.experts_implementation
    loaders = {
        "sample": (
            "sample:mixtral-healthy",
            lambda: moeviz.load_model("sample:mixtral-healthy", experts_implementation=experts),
        ),
        "mid": ("mixtral d=512", lambda: mid_size_mixtral(experts)),
    }
    figures: list[Figure] = []
    for key in args.models.split(","):
        label, load = loaders[key.strip()]
        loaded = load()
        runs = [measure(loaded, args.tokens, args.rounds) for _ in range(args.runs)]
        plain_ms = statistics.median(run["plain"] for run in runs) * 1e3
        print(f"{label}: plain forward {plain_ms:.2f} ms (median of the runs' medians)")
        for name in [n for n in runs[0] if n != "plain"]:
            ratios = [run[name] / run["plain"] for run in runs]
            line = (
                f"  {name:<8} ratio {statistics.median(ratios):.3f} "
                f"(spread {min(ratios):.3f}–{max(ratios):.3f} over {len(ratios)} runs)"
            )
            figure = f"{statistics.median(ratios):.3f}× ({min(ratios):.3f}–{max(ratios):.3f})"
            target, met = "", None
            if name == "moeviz":
                target_ratio = TARGETS[label]
                met = statistics.median(ratios) <= target_ratio
                line += f"   target <= {target_ratio:.2f}: {'OK' if met else 'ABOVE TARGET'}"
                target = f"≤ {target_ratio:.2f}×"
            print(line, flush=True)
            what = "routing capture (moeviz)" if name == "moeviz" else f"{name} saving every router output"
            figures.append(
                Figure(
                    "Capture",
                    f"{what} vs a plain forward, {args.tokens} tokens, {label}, experts {experts}",
                    f"{figure}; plain forward {plain_ms:.2f} ms",
                    f"python benchmarks/bench_capture_overhead.py{flags(parser, args)}",
                    target,
                    met,
                )
            )
    record("capture_overhead", figures)


if __name__ == "__main__":
    main()
