"""Fine-tune a Mixtral on a new domain in the Lab and record what each recipe does to its routing.

`FinetuneConfig` says what to fine-tune (the mode, the new domain, the optimiser, LoRA's rank, alpha and
targets), `FinetuneRun` trains it step by step from a bundled sample or the Lab's own model, and
`finetune_summary` puts several runs side by side. The four modes differ only in what may change:

- "router": every MoE router's gate weight [E, d]; everything else frozen;
- "experts": the fused expert tensors (gate_up_proj [E, 2f, d], down_proj [E, d, f]); routers, attention,
  embeddings and norms frozen;
- "lora": peft's `get_peft_model` with a `LoraConfig`: rank r on the attention projections (q/k/v/o), the
  routers and the fused expert tensors (peft ≥ 0.17 wraps a 3-D parameter with `target_parameters`, one
  rank-r pair per expert); the base weights are frozen and B starts at zero, so before the first step the
  model computes exactly what the base computes;
- "full": every parameter.

The loss is next-token cross-entropy on the new domain plus `aux_coef` · the auxiliary balancing loss in
Megatron-Core's form (per MoE layer, mean over layers), as the Lab trains. AdamW (β 0.9/0.95, no weight
decay) on the trainable parameters only, the Lab's warm-up + cosine schedule, gradient clipping at 1.

Recorded: each step's training loss and aux loss; at step 0 (the start model) and every `eval_every` steps
the held-out loss on the new domain, on the old domains (forgetting), the router mismatch against the start
model (the fraction of (token, MoE layer) top-k sets that differ from the start model's on a fixed
held-out batch) and each layer's balance on that batch (max share and normalised load entropy,
`moeviz.analysis.balance.balance_indicators`).

Data: a domain of the sample corpus (`moeviz.lab.data`: its training part to train on, its held-out part
to evaluate; the other domains' held-out parts are the "old" domains) or the user's text (its first 90%
to train on, the rest, at least one sequence, held out; every corpus domain is "old"). The start model
must be a Mixtral with the sample tokenizer's vocabulary (the bundled Mixtral samples, the Lab's models).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from moeviz.analysis.balance import balance_indicators
from moeviz.errors import InputError
from moeviz.jsonable import dumps
from moeviz.lab.budget import LabMemory, finetune_memory
from moeviz.lab.config import MAX_STEPS, check_ranges, check_trained_tokens
from moeviz.lab.data import HELDOUT_FRACTION, lab_corpus, lab_tokenizer
from moeviz.lab.runner import LabRunner
from moeviz.lab.train import in_memory_model, lab_threads, lr_at, timed_step
from moeviz.models.loading import LoadedModel, sample_models_dir

MODES = ("router", "experts", "lora", "full")
MODE_LABELS = {
    "router": "router only",
    "experts": "experts only",
    "lora": "LoRA",
    "full": "full",
}
LORA_TARGETS = ("attention", "router", "experts")
# peft names of each LoRA target on transformers' Mixtral (modules by name, 3-D tensors by parameter path)
_TARGET_MODULES = {"attention": ["q_proj", "k_proj", "v_proj", "o_proj"]}
_TARGET_PARAMETERS = {
    "router": ["mlp.gate.weight"],
    "experts": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}
FINETUNE_FOLDER = "lab-finetune"  # LoadedModel.folder of a fine-tuned model held in memory
HELDOUT_ROWS = 4  # held-out windows per domain in the fixed evaluation batch
HISTORY_COLUMNS = [
    "step",
    "train_loss",
    "aux_loss_megatron",
    "new_loss",
    "old_loss",
    "router_mismatch",
    "max_share",
    "load_entropy",
    "lr",
]
BALANCE_COLUMNS = ["step", "layer", "max_share", "load_entropy"]
# The curves a page overlays per run (`moeviz.lab.curves.runs_curves` of the histories, in this order).
CURVE_METRICS = ("new_loss", "old_loss", "router_mismatch", "max_share")
# The side-by-side verdicts: a mode adapted when its new-domain loss fell by at least ADAPTED_DROP nats,
# forgot when its old-domain loss rose by more than FORGOT_RISE nats, kept balance when no layer's max share
# rose by more than BALANCE_SLACK of the even share (1/E of the slots).
ADAPTED_DROP = 0.02
FORGOT_RISE = 0.02
BALANCE_SLACK = 0.25


@dataclass(frozen=True)
class FinetuneConfig:
    """One fine-tuning run.

    start: the model to start from: "sample:NAME" (a bundled Mixtral sample) or, with a model handed to
        `FinetuneRun`, its label (the Lab's run name).
    mode: one of MODES. domain: a domain of the sample corpus (`moeviz.samples.DOMAINS`) to fine-tune on;
        text: the user's text instead (domain None). lora_rank / lora_alpha / lora_targets: LoRA only (by
        default attention and the routers: adding the fused expert tensors makes a step slower than full
        fine-tuning of the sample, benchmarks/bench_finetune.py).
    """

    start: str = "sample:mixtral-healthy"
    mode: str = "lora"
    domain: str | None = "python"
    text: str | None = None
    steps: int = 60
    lr: float = 1e-3
    batch: int = 8
    seq: int = 64
    seed: int = 0
    eval_every: int = 10
    aux_coef: float = 0.01
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("attention", "router")

    def __post_init__(self) -> None:
        _check(self)

    @property
    def new_domain(self) -> str:
        """The new domain's name: the corpus domain, or "your text"."""
        return self.domain if self.domain is not None else "your text"

    def label(self) -> str:
        """Short description, e.g. 'LoRA r=8 (attention+router+experts) on python, 60 steps'."""
        mode = MODE_LABELS[self.mode]
        if self.mode == "lora":
            mode += f" r={self.lora_rank} ({'+'.join(self.lora_targets)})"
        return f"{mode} on {self.new_domain}, {self.steps} steps, lr={self.lr:g}, seed={self.seed}"

    def with_mode(self, mode: str) -> FinetuneConfig:
        return FinetuneConfig(**{**asdict(self), "mode": mode})


_INTS = {
    "steps": (1, MAX_STEPS),
    "batch": (1, 64),
    "seq": (8, 512),
    "seed": (0, 2**32 - 1),
    "eval_every": (1, MAX_STEPS),
}
_FLOATS = {"lr": (1e-7, 0.1), "aux_coef": (-1.0, 1.0), "lora_alpha": (1e-3, 1e4)}


def _check(config: FinetuneConfig) -> None:
    from moeviz.samples import DOMAINS

    if config.mode not in MODES:
        raise InputError(f"fine-tune: mode must be one of {', '.join(MODES)}, got {config.mode!r}")
    check_ranges(config, "fine-tune", _INTS, _FLOATS)
    rank = config.lora_rank
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise InputError(f"fine-tune: LoRA rank must be a whole number, got {rank!r}")
    if rank <= 0:
        raise InputError(f"fine-tune: LoRA rank must be at least 1, got {rank}")
    unknown = [t for t in config.lora_targets if t not in LORA_TARGETS]
    if unknown or not config.lora_targets:
        raise InputError(
            f"fine-tune: LoRA targets must be some of {', '.join(LORA_TARGETS)}, got "
            f"{', '.join(map(str, config.lora_targets)) or 'none'}"
        )
    if (config.domain is None) == (config.text is None):
        raise InputError("fine-tune: give either a domain of the sample corpus or a text, not both")
    if config.domain is not None and config.domain not in DOMAINS:
        raise InputError(
            f"fine-tune: the new domain must be one of the sample corpus's ({', '.join(DOMAINS)}), "
            f"got {config.domain!r}"
        )
    if config.text is not None and not config.text.strip():
        raise InputError("fine-tune: the text to fine-tune on is empty")
    check_trained_tokens(config, "fine-tune")


# ---- the start model --------------------------------------------------------------------------------------
def start_config(config: FinetuneConfig, start: LoadedModel | None = None):
    """The transformers config of the start model (read without loading weights for a sample); InputError
    unless it is a Mixtral with the sample corpus's vocabulary."""
    if start is not None:
        model_config = start.model.config
    else:
        if not config.start.startswith("sample:"):
            raise InputError(f"fine-tune: start from a bundled sample (sample:NAME), got {config.start!r}")
        from transformers import AutoConfig

        folder = sample_models_dir() / config.start.removeprefix("sample:")
        if not (folder / "config.json").is_file():
            raise InputError(f"fine-tune: no bundled sample {config.start!r}")
        model_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if model_config.model_type != "mixtral":
        raise InputError(
            f"fine-tune: the Lab fine-tunes Mixtral models; {config.start} is a {model_config.model_type}"
        )
    vocab = lab_corpus().vocab_size
    if model_config.vocab_size != vocab:
        raise InputError(
            f"fine-tune: {config.start} has a vocabulary of {model_config.vocab_size} tokens, not the sample "
            f"tokenizer's {vocab}: the Lab's corpus cannot be fed to it"
        )
    return model_config


def _dims(model_config) -> dict[str, int]:
    d = model_config.hidden_size
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or d // heads
    return {
        "d": d,
        "f": model_config.intermediate_size,
        "experts": model_config.num_local_experts,
        "k": model_config.num_experts_per_tok,
        "layers": model_config.num_hidden_layers,
        "heads": heads,
        "q": heads * head_dim,
        "kv": model_config.num_key_value_heads * head_dim,
        "vocab": model_config.vocab_size,
        "tied": bool(getattr(model_config, "tie_word_embeddings", False)),
    }


def max_lora_rank(config: FinetuneConfig, model_config) -> tuple[int, str]:
    """The largest LoRA rank the targeted layers allow (the smallest dimension of a targeted matrix; a fused
    expert tensor counts per expert) and which matrix sets it."""
    m = _dims(model_config)
    bounds = {
        "attention": (min(m["d"], m["q"], m["kv"]), f"attention ({m['kv']} × {m['d']})"),
        "router": (min(m["d"], m["experts"]), f"the router ({m['experts']} × {m['d']})"),
        "experts": (min(m["d"], m["f"]), f"each expert ({m['f']} × {m['d']})"),
    }
    return min((bounds[t] for t in config.lora_targets), key=lambda bound: bound[0])


def check_rank(config: FinetuneConfig, model_config) -> None:
    """InputError when LoRA's rank exceeds the smallest targeted matrix (LoRA runs only)."""
    if config.mode != "lora":
        return
    largest, which = max_lora_rank(config, model_config)
    if config.lora_rank > largest:
        raise InputError(
            f"fine-tune: LoRA rank {config.lora_rank} is larger than {which} allows: at most {largest}"
        )


def trainable_count(config: FinetuneConfig, model_config) -> tuple[int, int]:
    """(trainable parameters, all parameters) of `config`'s mode on the start model, counted from its
    config (LoRA's adapter parameters included in both)."""
    m = _dims(model_config)
    d, f, e, layers, r = m["d"], m["f"], m["experts"], m["layers"], config.lora_rank
    attention = d * m["q"] + 2 * d * m["kv"] + m["q"] * d
    router, experts = d * e, 3 * e * d * f
    total = m["vocab"] * d * (1 if m["tied"] else 2) + layers * (attention + router + experts + 2 * d) + d
    trainable = {
        "router": layers * router,
        "experts": layers * experts,
        "full": total,
    }
    if config.mode != "lora":
        return trainable[config.mode], total
    lora = {
        "attention": r * ((d + m["q"]) + 2 * (d + m["kv"]) + (m["q"] + d)),
        "router": r * (d + e),
        "experts": r * e * ((d + 2 * f) + (f + d)),  # one rank-r pair per expert and fused tensor
    }
    adapter = layers * sum(lora[t] for t in config.lora_targets)
    return adapter, total + adapter


def memory_needed(config: FinetuneConfig, model_config) -> LabMemory:
    """What `config` holds while it trains (`moeviz.lab.budget.finetune_memory`)."""
    m = _dims(model_config)
    trainable, total = trainable_count(config, model_config)
    return finetune_memory(
        parameters=total,
        trainable=trainable,
        layers=m["layers"],
        d_model=m["d"],
        ffn=m["f"],
        experts=m["experts"],
        k=m["k"],
        heads=m["heads"],
        vocab=m["vocab"],
        batch=config.batch,
        seq=config.seq,
    )


# ---- data --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FinetuneData:
    """Token ids to train on (`train` [n]), the fixed evaluation batch `heldout` [R, seq] and each row's
    part ("new" or "old")."""

    train: np.ndarray
    heldout: torch.Tensor
    parts: tuple[str, ...]


def finetune_data(config: FinetuneConfig) -> FinetuneData:
    """The new domain's training tokens and the fixed held-out batch (new domain's windows, then the old
    domains'); InputError when the text is too short for one training and one held-out sequence."""
    corpus = lab_corpus()
    seq = config.seq
    corpus.check_seq(seq)
    if config.domain is not None:
        train, new_heldout = corpus.train[config.domain], corpus.heldout[config.domain]
    else:
        ids = np.asarray(corpus.tokenizer(config.text)["input_ids"], dtype=np.int64)
        if len(ids) < 2 * seq:
            raise InputError(
                f"fine-tune: the text has {len(ids)} tokens; it needs at least {2 * seq} (two sequences of "
                f"{seq}: one to train on, one held out): paste more text or shorten the sequences"
            )
        cut = min(len(ids) - seq, round(len(ids) * (1 - HELDOUT_FRACTION)))
        train, new_heldout = ids[:cut], ids[cut:]
    if len(train) < seq:
        raise InputError(f"fine-tune: {config.new_domain} has fewer than {seq} training tokens")
    rows, parts = _windows(new_heldout, seq), []
    parts += ["new"] * len(rows)
    for domain, ids in corpus.heldout.items():
        if domain != config.domain:
            old = _windows(ids, seq)
            rows += old
            parts += ["old"] * len(old)
    return FinetuneData(train, torch.from_numpy(np.stack(rows)), tuple(parts))


def _windows(ids: np.ndarray, seq: int) -> list[np.ndarray]:
    """Up to HELDOUT_ROWS evenly spaced windows of `seq` tokens."""
    fit = len(ids) // seq
    return [
        ids[i * seq : (i + 1) * seq]
        for i in np.linspace(0, fit - 1, min(HELDOUT_ROWS, fit)).round().astype(int)
    ]


# ---- routing -----------------------------------------------------------------------------------------------
class _RouterTap:
    """Forward hooks on every MoE block's router (whatever wraps it: peft's ParamWrapper returns the wrapped
    router's output): the (logits [N, E], top-k indices [N, k]) of each layer's last call, in layer order."""

    def __init__(self, model: torch.nn.Module):
        self.blocks = [m for m in model.modules() if isinstance(m, MixtralSparseMoeBlock)]
        self.calls: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.blocks)
        self._handles = [
            block.gate.register_forward_hook(self._hook(i)) for i, block in enumerate(self.blocks)
        ]

    def _hook(self, layer: int):
        def record(_module, _inputs, output):
            logits, _weights, indices = output
            self.calls[layer] = (logits, indices)

        return record

    def recorded(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (logits, indices) of the last forward; RuntimeError before every router ran."""
        calls = [call for call in self.calls if call is not None]
        if len(calls) != len(self.calls):
            raise RuntimeError("a router did not run in the last forward")
        return calls

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def topk_sets(indices: torch.Tensor) -> np.ndarray:
    """Top-k indices [..., k] as sets: sorted along the last axis."""
    return np.sort(indices.detach().cpu().numpy(), axis=-1)


def mismatch_fraction(base: np.ndarray, other: np.ndarray) -> float:
    """Fraction of (token, layer) top-k sets that differ between two [layers, N, k] sorted selections."""
    if base.shape != other.shape:
        raise ValueError(f"routing shapes differ: {base.shape} vs {other.shape}")
    return float(np.any(base != other, axis=-1).mean())


# ---- the run -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FinetuneResult:
    """What the side-by-side summary needs of a run: its name, config, parameter counts and history."""

    name: str
    config: FinetuneConfig
    trainable: int
    parameters: int
    history: pd.DataFrame
    balance: pd.DataFrame
    experts: int


class FinetuneRun:
    """One fine-tuning run (see the module docstring). `step()` trains one batch and returns its history
    row; thread-safe like `LabRun` (a lock is held while a step runs and while the model is copied)."""

    def __init__(self, config: FinetuneConfig, start: LoadedModel | None = None):
        self.config = config
        model_config = start_config(config, start)
        check_rank(config, model_config)
        self.data = finetune_data(config)
        if start is None:
            from moeviz.models.loading import load_model

            start = load_model(config.start, dtype="float32", device="cpu", check_memory=False)
        self.start_info = start.info
        model = copy.deepcopy(start.model).float().train()
        self.trainable, self.parameters = trainable_count(config, model_config)
        self.model = self._prepare(model)
        self._tap = _RouterTap(self.model)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer: torch.optim.Optimizer | None = torch.optim.AdamW(
            trainable, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0
        )
        self.experts = model_config.num_local_experts
        self.top_k = model_config.num_experts_per_tok
        self.layers = len(self._tap.blocks)
        self._rng = np.random.default_rng(config.seed)
        self._lock = threading.RLock()
        self._rows: list[dict] = []
        self._balance: list[dict] = []
        self._step = 0
        self.elapsed = 0.0
        with lab_threads():
            self.base_routing = self._evaluate_routing()  # [layers, N, k] of the start model
            self._record(self._evaluation(), {"step": 0})

    def _prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Freeze what the mode keeps, or wrap the model with peft's LoRA."""
        mode = self.config.mode
        if mode == "lora":
            from peft import LoraConfig, get_peft_model

            targets = self.config.lora_targets
            lora = LoraConfig(
                r=self.config.lora_rank,
                lora_alpha=self.config.lora_alpha,  # type: ignore[arg-type]  # peft scales by any number
                lora_dropout=0.0,
                target_modules=[name for t in targets for name in _TARGET_MODULES.get(t, [])],
                target_parameters=[name for t in targets for name in _TARGET_PARAMETERS.get(t, [])] or None,
                bias="none",
            )
            return get_peft_model(model, lora)
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(_trains(mode, name))
        return model

    # -- state -------------------------------------------------------------------------------------------
    @property
    def steps_done(self) -> int:
        return self._step

    @property
    def done(self) -> bool:
        return self._step >= self.config.steps

    def history(self) -> pd.DataFrame:
        """One row per step, from step 0 (the start model: evaluation only); the evaluation columns are NaN
        between evaluations, the training columns at step 0."""
        with self._lock:
            return pd.DataFrame(list(self._rows), columns=HISTORY_COLUMNS)

    def load_history(self) -> pd.DataFrame:
        """Per evaluation and MoE layer: the max share and normalised load entropy on the held-out batch."""
        with self._lock:
            return pd.DataFrame(list(self._balance), columns=BALANCE_COLUMNS)

    def result(self, name: str | None = None) -> FinetuneResult:
        return FinetuneResult(
            name or MODE_LABELS[self.config.mode],
            self.config,
            self.trainable,
            self.parameters,
            self.history(),
            self.load_history(),
            self.experts,
        )

    def release_training_state(self) -> None:
        """Drop the gradients and AdamW's moments once the run ends; `step()` after this fails."""
        with self._lock:
            self.model.zero_grad(set_to_none=True)
            if self.optimizer is not None:
                self.optimizer.state.clear()
            self.optimizer = None

    # -- training ----------------------------------------------------------------------------------------
    def step(self) -> dict:
        """Train on the next batch of the new domain; the history row of this step."""
        return timed_step(self, "the fine-tune")

    def _batch(self) -> torch.Tensor:
        c = self.config
        starts = self._rng.integers(0, len(self.data.train) - c.seq + 1, size=c.batch)
        return torch.from_numpy(np.stack([self.data.train[s : s + c.seq] for s in starts]))

    def _train_step(self) -> dict:
        c = self.config
        lr = lr_at(self._step, c.steps, c.lr)
        optimizer = self.optimizer
        if optimizer is None:
            raise RuntimeError("this fine-tune has ended: its optimiser state was released")
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = self._batch()
        out = self.model(input_ids=ids, labels=ids, use_cache=False)
        aux_terms = []
        for logits, indices in self._tap.recorded():
            probs = torch.softmax(logits.float(), dim=-1)
            f = torch.bincount(indices.reshape(-1), minlength=self.experts).float() / indices.numel()
            aux_terms.append(self.experts * (f * probs.mean(0)).sum())  # aux_loss_megatron
        aux = torch.stack(aux_terms).mean()
        loss = out.loss + c.aux_coef * aux
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        trainable = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        self._step += 1
        row = {
            "step": self._step,
            "train_loss": float(out.loss.detach()),
            "aux_loss_megatron": float(aux.detach()),
            "lr": lr,
        }
        if self._step % c.eval_every == 0 or self.done:
            self._record(self._evaluation(), row)
        else:
            self._rows.append(row)
        return row

    def _record(self, evaluation: tuple[dict, np.ndarray, np.ndarray], row: dict) -> None:
        values, max_share, entropy = evaluation
        row.update(values)
        row["max_share"] = float(max_share.max())  # the worst layer
        row["load_entropy"] = float(entropy.mean())
        self._rows.append(row)
        for layer in range(len(max_share)):
            self._balance.append(
                {
                    "step": row["step"],
                    "layer": layer,
                    "max_share": float(max_share[layer]),
                    "load_entropy": float(entropy[layer]),
                }
            )

    @torch.no_grad()
    def _forward_heldout(self) -> torch.Tensor:
        self.model.eval()
        try:
            return self.model(input_ids=self.data.heldout, use_cache=False).logits.float()
        finally:
            self.model.train()

    def _evaluate_routing(self) -> np.ndarray:
        """The top-k sets [layers, N, k] of the fixed held-out batch (N = rows × seq, row-major)."""
        self._forward_heldout()
        return np.stack([topk_sets(indices) for _, indices in self._tap.recorded()])

    def _evaluation(self) -> tuple[dict, np.ndarray, np.ndarray]:
        """Losses and router mismatch on the held-out batch, and each layer's (max share, load entropy)."""
        logits = self._forward_heldout()
        routing = np.stack([topk_sets(indices) for _, indices in self._tap.recorded()])
        ids = self.data.heldout
        per_row = (
            F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            )
            .reshape(len(ids), -1)
            .mean(1)
            .numpy()
        )
        parts = np.asarray(self.data.parts)
        counts = np.stack([np.bincount(r.reshape(-1), minlength=self.experts) for r in routing])
        stats = balance_indicators(counts, routing.shape[1], self.top_k, ("max_share", "load_entropy"))
        values = {
            "new_loss": float(per_row[parts == "new"].mean()),
            "old_loss": float(per_row[parts == "old"].mean()) if (parts == "old").any() else float("nan"),
            "router_mismatch": mismatch_fraction(self.base_routing, routing),
        }
        return values, stats["max_share"], stats["load_entropy"]

    def routing(self, ids: torch.Tensor) -> np.ndarray:
        """The model's top-k sets [layers, N, k] on token ids [B, S] (evaluation mode)."""
        with self._lock, torch.no_grad():
            self.model.eval()
            try:
                self.model(input_ids=ids, use_cache=False)
            finally:
                self.model.train()
            return np.stack([topk_sets(indices) for _, indices in self._tap.recorded()])

    def run(self, steps: int | None = None) -> pd.DataFrame:
        target = self.config.steps if steps is None else min(self.config.steps, self._step + steps)
        while self._step < target:
            self.step()
        return self.history()

    # -- the fine-tuned model ----------------------------------------------------------------------------
    def plain_model(self) -> torch.nn.Module:
        """A copy of the fine-tuned model as a plain transformers Mixtral (LoRA merged into its base),
        evaluation mode, hooks removed."""
        with self._lock:
            self._tap.close()
            try:
                model = copy.deepcopy(self.model)
            finally:
                self._tap = _RouterTap(self.model)
        if self.config.mode == "lora":
            model = model.merge_and_unload()
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        return model.eval()

    def loaded_model(self) -> LoadedModel:
        """The fine-tuned model as a moeviz LoadedModel (a merged copy: training may go on)."""
        model = self.plain_model()
        return in_memory_model(
            model,
            f"fine-tune of {self.config.start}: {self.config.label()} @ step {self._step}",
            [f"fine-tuned in the lab from {self.config.start}: {self.config.label()}"],
            FINETUNE_FOLDER,
            getattr(model.config, "max_position_embeddings", None),
        )

    def _meta(self) -> dict:
        with self._lock:
            last = dict(self._rows[-1]) if self._rows else {}
        config = asdict(self.config)
        if config["text"] is not None:
            config["text"] = f"<{len(config['text'])} characters>"
        return {
            "config": config,
            "start": self.config.start,
            "steps_done": self._step,
            "trainable_parameters": self.trainable,
            "last": last,
        }

    def save(self, folder: str | Path) -> Path:
        """LoRA: a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) over the start
        model; the other modes: a Hugging Face model folder (safetensors, the tokenizer) that
        `moeviz.load_model` opens. Both with finetune.json (the config and the last history row)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.config.mode == "lora":
            with self._lock:
                self.model.save_pretrained(folder, safe_serialization=True)
        else:
            self.plain_model().save_pretrained(folder, safe_serialization=True)
        lab_tokenizer().save_pretrained(folder)
        (folder / "finetune.json").write_text(dumps(self._meta(), indent=2) + "\n", encoding="utf-8")
        return folder

    def save_merged(self, folder: str | Path) -> Path:
        """A Hugging Face model folder of the fine-tuned model in every mode (LoRA merged into its base),
        for pages that open a model folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.plain_model().save_pretrained(folder, safe_serialization=True)
        lab_tokenizer().save_pretrained(folder)
        (folder / "finetune.json").write_text(dumps(self._meta(), indent=2) + "\n", encoding="utf-8")
        return folder


def _trains(mode: str, name: str) -> bool:
    """Whether parameter `name` of a transformers Mixtral trains in `mode` (not LoRA)."""
    if mode == "full":
        return True
    if mode == "router":
        return name.endswith("mlp.gate.weight")
    return ".mlp.experts." in name  # "experts"


# ---- side by side ------------------------------------------------------------------------------------------
SUMMARY_COLUMNS = [
    "run",
    "mode",
    "adapted",
    "forgot",
    "kept balance",
    "trainable",
    "new loss before",
    "new loss after",
    "new loss drop",
    "old loss before",
    "old loss after",
    "old loss rise",
    "router mismatch",
    "max share before",
    "max share after",
]


def finetune_summary(results: Sequence[FinetuneResult]) -> pd.DataFrame:
    """One row per run: the new-domain loss drop (adapted: ≥ ADAPTED_DROP), the old-domain loss rise
    (forgot: > FORGOT_RISE), the final router mismatch, and the worst layer's max share before and after
    (kept balance: no layer's max share rose by more than BALANCE_SLACK / E), from the first and last
    evaluations of each history."""
    rows = []
    for result in results:
        evaluated = result.history.dropna(subset=["new_loss"])
        if evaluated.empty:
            continue
        first, last = evaluated.iloc[0], evaluated.iloc[-1]
        balance = result.balance
        shares = balance.pivot(index="step", columns="layer", values="max_share")
        before, after = shares.loc[first["step"]].to_numpy(), shares.loc[last["step"]].to_numpy()
        even = 1.0 / result.experts  # max share's unit is the slots: an even load gives each expert 1/E
        drop = float(first["new_loss"] - last["new_loss"])
        rise = float(last["old_loss"] - first["old_loss"])
        rows.append(
            {
                "run": result.name,
                "mode": MODE_LABELS[result.config.mode],
                "trainable": result.trainable,
                "new loss before": float(first["new_loss"]),
                "new loss after": float(last["new_loss"]),
                "new loss drop": drop,
                "old loss before": float(first["old_loss"]),
                "old loss after": float(last["old_loss"]),
                "old loss rise": rise,
                "router mismatch": float(last["router_mismatch"]),
                "max share before": float(before.max()),
                "max share after": float(after.max()),
                "adapted": "yes" if drop >= ADAPTED_DROP else "no",
                "forgot": "yes" if rise > FORGOT_RISE else "no",
                "kept balance": "yes" if np.all(after - before <= BALANCE_SLACK * even) else "no",
            }
        )
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


# ---- the runner ------------------------------------------------------------------------------------------
class FinetuneRunner(LabRunner):
    """Trains one `FinetuneRun` per config, one after another, in one background thread under the Lab's
    limits (one training slot; memory: the largest run's training plus the finished runs' weights).
    Inherits pause / resume / stop; `runs` holds the runs made so far, `run` the one training now."""

    def __init__(
        self,
        configs: Sequence[FinetuneConfig],
        start: LoadedModel | None = None,
        pause_limit: float | None = None,
    ):
        if not configs:
            raise InputError("fine-tune: pick at least one mode")
        self.configs = list(configs)
        self.start_model = start
        self.model_config = start_config(self.configs[0], start)
        for config in self.configs:
            check_rank(config, self.model_config)
            if config.text is not None:
                finetune_data(config)  # a text too short is refused now, not in the thread
        self.runs: list[FinetuneRun] = []
        kwargs = {} if pause_limit is None else {"pause_limit": pause_limit}
        super().__init__(self.configs[0], **kwargs)  # type: ignore[arg-type]  # read by _make_runs only

    def _estimate(self) -> LabMemory:
        needs = [memory_needed(config, self.model_config) for config in self.configs]
        largest = max(needs, key=lambda need: need.total)
        weights = sum(need.parameters for need in needs) * 4 - largest.parameters * 4
        return LabMemory(largest.parameters, largest.weights_and_optimizer + weights, largest.activations)

    def _make_runs(self):
        for config in self.configs:
            run = FinetuneRun(config, self.start_model)
            self.runs.append(run)
            yield run
            run.release_training_state()

    @property
    def steps_done(self) -> int:
        return sum(run.steps_done for run in self.runs)

    @property
    def total_steps(self) -> int:
        return sum(config.steps for config in self.configs)

    def snapshot(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(history, balance) of the run training now (empty frames before it starts)."""
        run = self.run
        if run is None:
            return pd.DataFrame(columns=HISTORY_COLUMNS), pd.DataFrame(columns=BALANCE_COLUMNS)
        return run.history(), run.load_history()

    def results(self) -> list[FinetuneResult]:
        """Every run made so far, named by its mode."""
        return [run.result() for run in list(self.runs)]
