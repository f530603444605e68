"""What a long action will cost before it runs: forwards counted the way the action runs them, priced by
one measured forward of the loaded model.

`time_forward` times one plain forward on an input (seconds per token: the figure to keep per model); the
`*_cost` functions count the forwards an action runs and the tokens they carry, and price them linearly in
tokens (a batch of B copies of T tokens costs B·T tokens). Batching and attention's T² are not modelled,
so an estimate is a guide (its text says ≈), not a promise.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moeviz.errors import InputError
from moeviz.models.loading import LoadedModel

SAMPLE_ELEMENTS = 1 << 22  # elements a quantising-time sample covers: ~10 ms, a small share of any model


@dataclass(frozen=True)
class ForwardTiming:
    """One plain forward of `tokens` tokens took `seconds` (wall clock, what the user waits)."""

    seconds: float
    tokens: int

    @property
    def per_token(self) -> float:
        return self.seconds / max(self.tokens, 1)

    def describe(self) -> str:
        return f"one forward of {self.tokens:,} tokens took {format_seconds(self.seconds)}"


@dataclass(frozen=True)
class CostEstimate:
    """An action's `forwards` model calls, carrying `tokens` tokens in all, ≈ `seconds` (forwards priced
    per token, plus `other_seconds` of work that is not a forward, named by `other`)."""

    forwards: int
    tokens: int
    seconds: float
    other_seconds: float = 0.0
    other: str = ""

    def __str__(self) -> str:
        calls = f"{self.forwards:,} forward{'s' if self.forwards != 1 else ''} ({self.tokens:,} tokens)"
        extra = f" + {self.other}" if self.other else ""
        return f"{calls}{extra} ≈ {format_seconds(self.seconds)}"


def format_seconds(seconds: float) -> str:
    """'0.04 s', '3.2 s', '45 s', '4 min 5 s', '2 h 10 min'."""
    if not math.isfinite(seconds):
        return "unknown"
    if seconds < 0.1:
        return f"{seconds:.2f} s"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def time_forward(loaded: LoadedModel, token_ids: Sequence[int]) -> ForwardTiming:
    """Time a plain forward of `loaded` on one sequence of token ids (no hooks of ours, no grad): the faster
    of two, the second being what every later forward costs."""
    ids = [int(i) for i in token_ids]
    if not ids:
        raise InputError("timing a forward needs at least one token")
    batch = torch.tensor([ids], device=loaded.device)
    timings = []
    with torch.inference_mode():
        for _ in range(2):  # the faster of two: a model's first forward pays one-time costs (~3× at scale)
            start = time.perf_counter()
            loaded.model(input_ids=batch)
            if loaded.device.type == "cuda":
                torch.cuda.synchronize(loaded.device)
            timings.append(time.perf_counter() - start)
    return ForwardTiming(seconds=min(timings), tokens=len(ids))


def _priced(
    timing: ForwardTiming, forwards: int, tokens: int, other_seconds: float = 0.0, other: str = ""
) -> CostEstimate:
    return CostEstimate(forwards, tokens, tokens * timing.per_token + other_seconds, other_seconds, other)


def whatif_cost(timing: ForwardTiming, tokens: int) -> CostEstimate:
    """`counterfactual` on one sequence of `tokens`: a forward without and one with the interventions."""
    return _priced(timing, 2, 2 * tokens)


def importance_cost(
    timing: ForwardTiming, tokens: int, experts_per_layer: Sequence[int], batch_size: int = 8
) -> CostEstimate:
    """`expert_importance` on one sequence of `tokens`: one capture, then per layer ⌈n/batch_size⌉ forwards
    of (1 + a chunk of experts) copies of the sequence, `experts_per_layer` = n the experts that need a
    forward in each layer (those the input dispatches among the chosen ones)."""
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    forwards, copies = 1, 1
    for n in experts_per_layer:
        chunks = -(-int(n) // batch_size)
        forwards += chunks
        copies += int(n) + chunks  # each chunk carries the unmodified copy too
    return _priced(timing, forwards, copies * tokens)


def quantisation_cost(
    timing: ForwardTiming, sequence_lengths: Sequence[int], quantise_seconds: float, batch: int = 8
) -> CostEstimate:
    """`quantisation_flips` on sequences of `sequence_lengths`: the routing of the original and of the
    quantised copy (`batch` sequences a forward, padded to the longest; a sequence routed alone is scored by
    that same forward), one next-token forward of each per sequence of 2 or more tokens routed with others,
    and `quantise_seconds` of fake-quantising the weights."""
    lengths = [int(n) for n in sequence_lengths]
    routed_forwards, routed_tokens = 0, 0
    scored: list[int] = []
    for start in range(0, len(lengths), batch):
        chunk = lengths[start : start + batch]
        routed_forwards += 1
        routed_tokens += len(chunk) * max(chunk)
        if len(chunk) > 1:
            scored.extend(n for n in chunk if n > 1)
    forwards = 2 * routed_forwards + 2 * len(scored)
    tokens = 2 * routed_tokens + 2 * sum(scored)
    return _priced(
        timing, forwards, tokens, quantise_seconds, f"quantising {format_seconds(quantise_seconds)}"
    )


def prefetch_cost(timing: ForwardTiming, sequence_lengths: Sequence[int]) -> CostEstimate:
    """`prefetch_recall` on sequences of `sequence_lengths`: one forward per sequence (the next routers
    applied to the kept router inputs cost a few matrix products, not counted)."""
    lengths = [int(n) for n in sequence_lengths]
    return _priced(timing, len(lengths), sum(lengths))


def capture_cost(timing: ForwardTiming, forward_tokens: Sequence[int]) -> CostEstimate:
    """Plain captures: one forward per entry of `forward_tokens`, each carrying that many tokens (a batch of
    B sequences of T tokens carries B·T)."""
    tokens = [int(n) for n in forward_tokens]
    return _priced(timing, len(tokens), sum(tokens))


def sampled_seconds(work: Sequence[tuple[torch.Tensor, Callable[[torch.Tensor], object]]]) -> float:
    """Seconds `fn(tensor)` would take over every (tensor, fn) of `work`, from timing `fn` on a slice of the
    first tensor along its first dimension (at most SAMPLE_ELEMENTS elements, never fewer than one slice;
    the second of two calls), scaled by element counts. For elementwise work such as fake quantisation
    (rows or experts independent along the first dimension)."""
    if not work:
        return 0.0
    tensor, fn = work[0]
    rows = max(1, min(tensor.shape[0], SAMPLE_ELEMENTS // max(tensor[0].numel(), 1))) if tensor.dim() else 1
    sample = tensor[:rows] if tensor.dim() else tensor
    with torch.no_grad():
        fn(sample)  # the first call pays one-time costs (allocation, dispatch caches) the others do not
        start = time.perf_counter()
        fn(sample)
        seconds = time.perf_counter() - start
    total = sum(t.numel() for t, _ in work)
    return seconds * total / max(sample.numel(), 1)
