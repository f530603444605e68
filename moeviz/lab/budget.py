"""What a lab run costs the server before it starts: parameters, the optimiser's state and one training
step's activations, in bytes (`memory_estimate`), and the server's budget for all lab runs together
(`memory_budget`: `MOEVIZ_LAB_MEMORY_GIB`, default a quarter of the machine's memory, at most 4 GiB).

The estimate counts fp32 tensors the way a training step holds them (`moeviz.lab.train`: a transformers
Mixtral with eager attention, AdamW): each parameter with its gradient, AdamW's two moments and the
two temporaries its update allocates (24 bytes);
per layer the activations autograd keeps for the backward pass — the residual stream and its norms,
queries/keys/values and the attention output (~12·T·d), the attention probabilities and their softmax
input (2·B·H·S²), the router's logits and probabilities (3·T·E), and each routed slot's expert input,
gate, up and product (T·k·(2d + 4f)); plus the logits, their log-softmax and gradient (3·T·V); doubled,
since the backward pass holds each one's gradient beside it at its peak. It is an upper estimate, within
3× of the peak memory a real run adds (`tests/models/test_lab_budget.py` measures it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from moeviz.lab.config import HEADS, LabConfig
from moeviz.settings import current_settings

FLOAT = 4  # bytes of an fp32 value
# the weight, its gradient, AdamW's exp_avg and exp_avg_sq, and the two temporaries of its update
PER_PARAMETER = 6 * FLOAT
BACKWARD = 2  # the backward pass holds each saved activation's gradient beside it at its peak
DEFAULT_CAP = 4 << 30
DEFAULT_SHARE = 0.25  # of the machine's memory, when MOEVIZ_LAB_MEMORY_GIB is unset


@dataclass(frozen=True)
class LabMemory:
    """Bytes a lab run holds while it trains."""

    parameters: int  # the number of parameters (not bytes)
    weights_and_optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights_and_optimizer + self.activations

    def describe(self) -> str:
        return (
            f"≈ {gib(self.total)} ({self.parameters / 1e6:.1f} M parameters with their gradients and AdamW "
            f"state: {gib(self.weights_and_optimizer)}; one step's activations: {gib(self.activations)})"
        )


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def parameter_count(config: LabConfig, vocab: int) -> int:
    """Parameters of the lab's Mixtral: tied embeddings, per layer attention (4·d²), two norms, the router
    (d·E) and E SwiGLU experts (3·d·f), and the final norm."""
    d, f, e = config.d_model, config.ffn, config.experts
    per_layer = 4 * d * d + 2 * d + d * e + e * 3 * d * f
    return vocab * d + config.layers * per_layer + d


def memory_estimate(config: LabConfig, vocab: int) -> LabMemory:
    """The bytes `config` needs while it trains (see the module docstring for what is counted)."""
    d, f, e, k = config.d_model, config.ffn, config.experts, config.k
    tokens = config.batch * config.seq
    per_layer = (
        12 * tokens * d
        + 2 * config.batch * HEADS * config.seq * config.seq
        + 3 * tokens * e
        + tokens * k * (2 * d + 4 * f)
    )
    activations = BACKWARD * FLOAT * (config.layers * per_layer + 3 * tokens * vocab)
    parameters = parameter_count(config, vocab)
    return LabMemory(parameters, parameters * PER_PARAMETER, activations)


def memory_budget() -> int:
    """Bytes all lab runs of this server may hold together: `MOEVIZ_LAB_MEMORY_GIB`, or a quarter of the
    machine's memory capped at 4 GiB."""
    setting = current_settings().lab_memory_gib
    if setting is not None:
        return int(setting * 2**30)
    try:
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return DEFAULT_CAP
    return int(min(DEFAULT_CAP, machine * DEFAULT_SHARE))


def finetune_memory(
    *,
    parameters: int,
    trainable: int,
    layers: int,
    d_model: int,
    ffn: int,
    experts: int,
    k: int,
    heads: int,
    vocab: int,
    batch: int,
    seq: int,
) -> LabMemory:
    """The bytes a Lab fine-tune holds while it trains: every parameter's fp32 weight, and only the
    `trainable` ones' gradient, AdamW moments and update temporaries (a frozen parameter has none), plus one
    step's activations counted as `memory_estimate` counts them (an upper estimate: a frozen layer before the
    first trainable one keeps less for the backward pass)."""
    tokens = batch * seq
    per_layer = (
        12 * tokens * d_model
        + 2 * batch * heads * seq * seq
        + 3 * tokens * experts
        + tokens * k * (2 * d_model + 4 * ffn)
    )
    activations = BACKWARD * FLOAT * (layers * per_layer + 3 * tokens * vocab)
    weights = parameters * FLOAT + trainable * (PER_PARAMETER - FLOAT)
    return LabMemory(parameters, weights, activations)
