"""What a lab training run is: the model size, the routing and balancing options, the optimiser and the data.

Every field is checked when a `LabConfig` is made, with a message that says what is allowed, so a page can
show the error as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeviz.errors import InputError

MAX_EXPERTS = 64
MAX_STEPS = 5_000  # also bounds the memory of a run's history
MAX_TRAINED_TOKENS = 10_000_000  # steps × batch × seq: the time one run may hold a server's cores
HEADS = 4  # attention heads (d_model must be a multiple of 2 · HEADS: RoPE rotates pairs)


@dataclass(frozen=True)
class LabConfig:
    """One lab run.

    experts: routed experts per MoE layer, 1 … 64. `experts=1` is the dense baseline: one expert and k = 1,
        so every token goes through the same FFN with weight 1 (the model is still a transformers Mixtral
        with a one-expert router, whose balancing losses are constant).
    k: experts per token (1 … experts).
    aux_coef: weight of the auxiliary balancing loss in Megatron-Core's form (`aux_loss_megatron`),
        computed per MoE layer and averaged (E·Σ f_e·P_e, f_e = share of the layer's top-k slots of the
        unbiased probabilities, 1 when balanced); 0 = none, negative = rewards concentration.
    z_coef: weight of the ST-MoE router z-loss, mean_t (logsumexp logits_t)², averaged over layers.
    bias_rate: γ of DeepSeek-V3 loss-free balancing: a per-expert bias is added to the router scores for
        selection only and moves by γ · sign(mean load − load) after each step; 0 = off.
    capacity_factor: Megatron-style capacity per sequence while training, ceil(cf · S·k / E) slots per
        expert; the lowest-probability slots beyond it are dropped (weight 0). None = no drops.
    router_noise: std of Gaussian noise added to the router logits while training (not at evaluation).
    expert_ffn: width of each expert's FFN; None = d_model (the experts sweep scales it so that k · width
        stays constant).
    """

    experts: int = 8
    k: int = 2
    aux_coef: float = 0.01
    z_coef: float = 0.0
    bias_rate: float = 0.0
    capacity_factor: float | None = None
    router_noise: float = 0.0
    lr: float = 3e-3
    steps: int = 300
    seed: int = 0
    d_model: int = 64
    layers: int = 2
    batch: int = 8
    seq: int = 64
    eval_every: int = 25
    expert_ffn: int | None = None

    def __post_init__(self) -> None:
        _check(self)

    @property
    def dense(self) -> bool:
        return self.experts == 1

    @property
    def ffn(self) -> int:
        """Width of one expert's FFN."""
        return self.expert_ffn if self.expert_ffn is not None else self.d_model

    def label(self) -> str:
        """Short description, e.g. 'E=8 k=2 aux=0.01 seed=0'."""
        parts = [f"E={self.experts}", f"k={self.k}", f"aux={self.aux_coef:g}"]
        for name, value, off in (
            ("z", self.z_coef, 0.0),
            ("γ", self.bias_rate, 0.0),
            ("cf", self.capacity_factor, None),
            ("noise", self.router_noise, 0.0),
        ):
            if value != off:
                parts.append(f"{name}={value:g}")
        parts.append(f"seed={self.seed}")
        return " ".join(parts)


_INTS = {  # name: (lowest, highest)
    "experts": (1, MAX_EXPERTS),
    "k": (1, MAX_EXPERTS),
    "steps": (1, MAX_STEPS),
    "seed": (0, 2**32 - 1),
    "d_model": (16, 512),
    "layers": (1, 8),
    "batch": (1, 64),
    "seq": (8, 512),
    "eval_every": (1, MAX_STEPS),
    "expert_ffn": (4, 4096),
}
_FLOATS = {  # name: (lowest, highest), inclusive
    "aux_coef": (-1.0, 1.0),
    "z_coef": (0.0, 1.0),
    "bias_rate": (0.0, 1.0),
    "capacity_factor": (0.05, 64.0),
    "router_noise": (0.0, 10.0),
    "lr": (1e-6, 0.1),
}


def _check(config: LabConfig) -> None:
    check_ranges(config, "lab", _INTS, _FLOATS, optional=("capacity_factor", "expert_ffn"))
    if config.k > config.experts:
        raise InputError(
            f"lab: k must be at most the number of experts ({config.experts}), got {config.k}"
            + (" (experts = 1 is the dense model: k = 1)" if config.experts == 1 else "")
        )
    check_trained_tokens(config, "lab")
    if config.d_model % (2 * HEADS):
        raise InputError(
            f"lab: d_model must be a multiple of {2 * HEADS} ({HEADS} heads), got {config.d_model}"
        )


def check_ranges(config, who: str, ints: dict, floats: dict, optional: tuple[str, ...] = ()) -> None:
    """InputError, its message starting `who:`, for the first field of `config` named in `ints` that is not a
    whole number in its (lowest, highest), or in `floats` not a finite number in it (inclusive); a field
    in `optional` may also be None."""
    for name, (low, high) in {**ints, **floats}.items():
        value = getattr(config, name)
        if value is None and name in optional:
            continue
        if name in ints:
            if isinstance(value, bool) or not isinstance(value, int):
                raise InputError(f"{who}: {name} must be a whole number, got {value!r}")
            if not low <= value <= high:
                raise InputError(f"{who}: {name} must be {low} … {high}, got {value}")
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise InputError(f"{who}: {name} must be a finite number, got {value!r}")
        if not low <= value <= high:
            raise InputError(f"{who}: {name} must be {low:g} … {high:g}, got {value:g}")


def check_trained_tokens(config, who: str) -> None:
    """InputError when a run of `config` (steps, batch, seq) would train on over MAX_TRAINED_TOKENS."""
    trained = config.steps * config.batch * config.seq
    if trained > MAX_TRAINED_TOKENS:
        raise InputError(
            f"{who}: steps × batch × sequence length = {trained:,} tokens; a lab run trains on at most "
            f"{MAX_TRAINED_TOKENS:,} (fewer steps, a smaller batch or shorter sequences)"
        )


PRESETS: dict[str, LabConfig] = {
    # per-layer Switch loss: every layer keeps all experts in use
    "healthy": LabConfig(aux_coef=0.01),
    # no balancing: a few experts take most tokens, none quite dies
    "hub experts": LabConfig(aux_coef=0.0),
    # a negative coefficient rewards concentration: most experts go dead within the run
    "collapse": LabConfig(aux_coef=-0.05),
}
