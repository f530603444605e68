"""Train a small Mixtral-style MoE on the sample corpus step by step, recording how its routing evolves.

The model is a real transformers `MixtralForCausalLM` (4 heads, RMSNorm, RoPE, tied embeddings, the bundled
2,048-token sample tokenizer). The lab's routing options live in `LabRouter`, a subclass of transformers'
`MixtralTopKRouter` swapped in as the class of every layer's `mlp.gate` (its weight is untouched):

- softmax over the logits, top-k, weights = the chosen probabilities renormalised to sum 1 — exactly
  Mixtral's rule, so with no bias a saved model routes identically under the stock class;
- router noise (training only): N(0, σ²) added to the logits before everything else;
- loss-free balancing (DeepSeek-V3): a per-expert bias buffer `e_score_correction_bias` is added to the
  probabilities for *selection only*; after each optimiser step it moves by γ · sign(mean load − load),
  load = the slots each expert was selected for in that step's batch. moeviz's capture reads the buffer as
  the router's balancing bias (the name transformers' DeepSeek-V3 uses);
- capacity (training only): per sequence of S tokens each expert takes at most ceil(cf · S·k / E) slots;
  beyond it the slots of lowest router probability are dropped (Megatron's "probs" policy; ties: earlier
  token first): their weight becomes 0, the other slot of the token keeps its weight.

Losses: next-token cross-entropy + aux_coef · mean over layers of the auxiliary loss in Megatron-Core's
form (`aux_loss_megatron` of moeviz.analysis.losses: E · Σ_e f_e · P_e, f_e = share of the layer's top-k
slots of the unbiased probabilities, P_e = mean probability; 1 when balanced; transformers'
`router_aux_loss_coef` would pool all layers into one load instead) + z_coef · mean over layers of the
router z-loss (`z_loss` of moeviz.analysis.losses, mean_t logsumexp(logits)²). AdamW (β 0.9/0.95, weight
decay 0.1 on matrices), warm-up then cosine to 10% of lr, gradient clipping at 1 — the sample models' recipe
(scripts/samples/train_model.py).

Determinism: parameters are initialised from a `torch.Generator` seeded with `config.seed`, batches come
from a numpy Generator with the same seed, router noise from a second torch Generator: nothing draws from
the process-wide random state. Each step runs on one torch thread (`lab_threads`), set for the calling thread
only, so the same config and seed give identical histories whatever the process's thread setting (float
reductions split over another thread count could differ in the last bits). One thread is also the fastest
here: the ops are small, and on 2 shared cores a second OpenMP thread mostly spins (measured 4–7× more CPU
per step under load, benchmarks/bench_lab.py).

The saved folder (`save`) is a plain Mixtral checkpoint that `moeviz.load_model` opens with the same
routing — except a loss-free balancing bias: transformers' Mixtral has no place for one, so the folder
records it in `lab.json` but the reloaded model routes without it. `loaded_model()` keeps it (the router
class stays swapped on the returned model, with noise and capacity off).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

# From the defining modules, not `from transformers import …`: `transformers` swaps itself for a lazy module
# in sys.modules while it is first imported, and a second thread importing it then (an app page whose script
# starts while another session's still imports it) is handed the half-built module without those names.
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import (
    MixtralForCausalLM,
    MixtralSparseMoeBlock,
    MixtralTopKRouter,
)

from moeviz.analysis.balance import balance_from_counts, balance_indicators
from moeviz.analysis.collapse import CollapseThresholds, Verdict, judge_layer
from moeviz.analysis.losses import bias_stats
from moeviz.jsonable import dumps
from moeviz.lab.config import HEADS, LabConfig
from moeviz.lab.data import LabCorpus, lab_corpus, lab_tokenizer
from moeviz.models.loading import MODEL_BUILD_LOCK, LoadedModel
from moeviz.models.sites import find_moe_sites
from moeviz.scoring import expert_capacity
from moeviz.trace import ModelInfo

BIAS_NAME = "e_score_correction_bias"
LOAD_WINDOW = 10  # steps whose loads `dead_experts_window_sum` and the collapse verdict look at
LONG_CONTEXT = 32_768  # positions the saved model accepts (sliding window = the training length)
INIT_STD = 0.02
# The history's columns. The balance values are the library's, named as there: `aux_loss_megatron` and
# `z_loss` (moeviz.analysis.losses) and `load_entropy` (moeviz.analysis.balance, normalised) of each layer
# on the step's batch, mean over the layers. `dead_experts_window_sum` is a quantity of the Lab's own: the
# library's per-layer `dead_experts` of each layer's load summed over the last LOAD_WINDOW steps, summed over
# the layers (an expert that got no slot in ten steps, counted once per layer).
HISTORY_COLUMNS = [
    "step",
    "train_loss",
    "heldout_loss",
    "aux_loss_megatron",
    "z_loss",
    "load_entropy",
    "dead_experts_window_sum",
    "collapsed",
    "dropped_fraction",
    "lr",
]
LOAD_COLUMNS = ["step", "layer", "expert", "load"]
LAB_FOLDER = "lab-run"  # LoadedModel.folder of a lab model: a name, not a folder on disk


LAB_THREADS = 1  # torch intra-op threads of a training step


# ---- threads --------------------------------------------------------------------------------------------
def _in_fresh_thread(function, *args):
    """function(*args) in a short-lived thread (a thread whose torch settings start from the process's)."""
    result = []
    helper = threading.Thread(target=lambda: result.append(function(*args)), name="moeviz-lab-threads")
    helper.start()
    helper.join()
    return result[0]


@contextmanager
def lab_threads(threads: int = LAB_THREADS) -> Iterator[None]:
    """Inside the block, torch ops of the calling thread run on `threads` intra-op threads; every other
    thread keeps its own setting.

    torch.set_num_threads sets the calling thread's OpenMP and MKL thread counts (both per thread) and, as a
    side effect, the count that threads which have not used torch yet start with. That second effect is
    undone at once from a helper thread, so the app's other threads are not touched (for a few
    microseconds, a thread making its first torch call could start with `threads`)."""
    before = torch.get_num_threads()  # this thread's own count (initialised on its first torch call)
    if before == threads:
        yield
        return
    default = _in_fresh_thread(torch.get_num_threads)
    torch.set_num_threads(threads)
    _in_fresh_thread(torch.set_num_threads, default)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        _in_fresh_thread(torch.set_num_threads, default)


# ---- routing ----------------------------------------------------------------------------------------------
def capacity_keep(indices: torch.Tensor, probs: torch.Tensor, seq: int, factor: float) -> torch.Tensor:
    """Which slots [N, k] survive capacity (bool). indices [N, k] are the chosen experts of N = B·seq tokens,
    probs [N, E] the router probabilities. Per sequence and expert the `expert_capacity` slots of highest
    probability are kept (ties: earlier token, then earlier slot, first)."""
    n, k = indices.shape
    experts = probs.shape[1]
    if n % seq:
        seq = n
    cap = max(1, expert_capacity(seq, k, experts, factor))  # Megatron get_capacity; a sequence keeps a slot
    seqs, width = n // seq, seq * k
    expert = indices.reshape(seqs, width)
    prob = probs.gather(1, indices).reshape(seqs, width)
    by_prob = torch.sort(-prob, dim=1, stable=True).indices  # descending probability, ties by position
    by_expert = torch.sort(expert.gather(1, by_prob), dim=1, stable=True).indices
    order = by_prob.gather(1, by_expert)  # slots grouped by expert, each group by descending probability
    counts = F.one_hot(expert, experts).sum(1)  # [seqs, E]
    starts = counts.cumsum(1) - counts
    rank = torch.arange(width).expand(seqs, width) - starts.gather(1, expert.gather(1, order))
    keep = torch.zeros(seqs, width, dtype=torch.bool).scatter(1, order, rank < cap)
    return keep.reshape(n, k)


# (logits [N, E], probs [N, E], indices [N, k], kept [N, k] or None without capacity, top [N, k])
LabRecord = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]


class LabRouter(MixtralTopKRouter):
    """Mixtral's router with the lab's options (see the module docstring). Installed with `install_routers`
    by changing the class of an existing `MixtralTopKRouter`; without bias, noise or capacity it computes
    exactly what `MixtralTopKRouter` computes."""

    lab_noise: float = 0.0
    lab_capacity: float | None = None
    lab_seq: int | None = None  # tokens per sequence of the training batch (for capacity)
    lab_generator: torch.Generator | None = None
    lab_recording: bool = False
    # (logits, probs, indices, kept, top) of the last recorded forward: top = the unbiased top-k [N, k]
    lab_record: LabRecord | None = None

    def forward(self, hidden_states):
        hidden = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden, self.weight)
        if self.training and self.lab_noise > 0:
            noise = torch.randn(logits.shape, generator=self.lab_generator, dtype=torch.float32)
            logits = logits + (self.lab_noise * noise).to(logits.dtype)
        probs = torch.softmax(logits.float(), dim=-1)
        bias = getattr(self, BIAS_NAME, None)
        top = torch.topk(probs.detach(), self.top_k, dim=-1).indices
        indices = top if bias is None else torch.topk(probs.detach() + bias, self.top_k, dim=-1).indices
        weights = probs.gather(1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        kept = None
        if self.training and self.lab_capacity is not None:
            kept = capacity_keep(indices, probs.detach(), self.lab_seq or len(indices), self.lab_capacity)
            weights = weights * kept
        if self.lab_recording:
            self.lab_record = (logits, probs, indices, kept, top)
        return logits, weights, indices


def install_routers(
    model: torch.nn.Module,
    *,
    bias: bool = False,
    noise: float = 0.0,
    capacity: float | None = None,
    seed: int = 0,
) -> list[LabRouter]:
    """Make every MoE layer's router a `LabRouter` (in place; weights kept). `bias`: give each a zero
    selection bias buffer (not saved with the weights)."""
    routers = []
    for i, block in enumerate(m for m in model.modules() if isinstance(m, MixtralSparseMoeBlock)):
        gate = block.gate
        gate.__class__ = LabRouter
        gate.lab_noise, gate.lab_capacity = float(noise), capacity
        gate.lab_generator = torch.Generator().manual_seed(seed * 1_000 + 7 + i) if noise > 0 else None
        if bias and getattr(gate, BIAS_NAME, None) is None:
            gate.register_buffer(BIAS_NAME, torch.zeros(gate.num_experts), persistent=False)
        routers.append(gate)
    return routers


# ---- the model ------------------------------------------------------------------------------------------
def model_config(config: LabConfig, corpus: LabCorpus) -> MixtralConfig:
    tokenizer = corpus.tokenizer
    return MixtralConfig(
        vocab_size=corpus.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.ffn,
        num_hidden_layers=config.layers,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        num_local_experts=config.experts,
        num_experts_per_tok=config.k,
        router_aux_loss_coef=0.0,  # the lab's balancing is per layer, below
        router_jitter_noise=0.0,
        output_router_logits=False,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # As in the samples: a window as long as the training sequences is full attention on every training
        # sequence and keeps every relative position in distribution on the app's longer prompts.
        max_position_embeddings=LONG_CONTEXT,
        sliding_window=config.seq,
    )


def build_model(config: LabConfig, corpus: LabCorpus) -> MixtralForCausalLM:
    """A fresh model, initialised from `config.seed` only (N(0, 0.02²) matrices, unit norms)."""
    with (
        MODEL_BUILD_LOCK
    ):  # transformers may switch torch's default dtype while another thread builds a model
        model = MixtralForCausalLM(model_config(config, corpus))
    generator = torch.Generator().manual_seed(config.seed)
    with torch.no_grad():
        for _, parameter in model.named_parameters():  # Mixtral: 1-D parameters are the RMSNorm weights
            if parameter.dim() == 1:
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, INIT_STD, generator=generator)
    return model


def in_memory_model(
    model: MixtralForCausalLM, source: str, notes: list[str], folder: str, max_length: int | None
) -> LoadedModel:
    """A model trained in the lab (fp32, on the CPU) as a moeviz LoadedModel named `source`, with a
    tokenizer of its own (the app may change its settings) and `folder` the name it stands under."""
    params = list(model.parameters()) + list(model.buffers())
    return LoadedModel(
        model=model,
        tokenizer=lab_tokenizer(),
        sites=find_moe_sites(model),
        info=ModelInfo(
            source=source,
            model_type="mixtral",
            architecture=type(model).__name__,
            num_layers=model.config.num_hidden_layers,
            num_parameters=sum(p.numel() for p in model.parameters()),
            dtype="float32",
            device="cpu",
            parameter_bytes=sum(p.numel() * p.element_size() for p in params),
            notes=notes,
        ),
        folder=Path(folder),
        max_length=max_length,
    )


def lr_at(step: int, total: int, base: float) -> float:
    """Linear warm-up over the first 10% (≤ 30 steps), then cosine down to 10% of `base`."""
    warmup = max(1, min(30, total // 10))
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def timed_step(run, what: str) -> dict:
    """One `run._train_step()` under the run's lock on the lab's threads, its time added to `run.elapsed`
    (a LabRun or a fine-tune); RuntimeError once the run is done."""
    with run._lock:
        if run.done:
            raise RuntimeError(f"{what} is done ({run.config.steps} steps)")
        started = time.perf_counter()
        with lab_threads():
            row = run._train_step()
        run.elapsed += time.perf_counter() - started
        return dict(row)


# ---- the run --------------------------------------------------------------------------------------------
class LabRun:
    """One training run. `step()` trains on one batch and returns that step's history row; the methods are
    thread-safe (a lock is held while a step runs, and while `loaded_model`/`save` copy the weights)."""

    def __init__(self, config: LabConfig, thresholds: CollapseThresholds | None = None):
        self.config = config
        self.thresholds = thresholds or CollapseThresholds()
        self.corpus = lab_corpus()
        self.corpus.check_seq(config.seq)
        self.model = build_model(config, self.corpus).train()
        self.routers = install_routers(
            self.model,
            bias=config.bias_rate > 0,
            noise=config.router_noise,
            capacity=config.capacity_factor,
            seed=config.seed,
        )
        for router in self.routers:
            router.lab_seq = config.seq
        matrices = [p for p in self.model.parameters() if p.dim() >= 2]
        vectors = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
            lr=config.lr,
            betas=(0.9, 0.95),
        )
        self._rng = np.random.default_rng(config.seed)
        self._heldout, self._heldout_domains = self.corpus.heldout_batch(config.seq)
        self._lock = threading.RLock()
        self._rows: list[dict] = []
        self._loads = np.zeros((config.steps, config.layers, config.experts), dtype=np.float32)
        self._window: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=LOAD_WINDOW)  # (kept, dropped)
        self._step = 0
        self.collapse_step: int | None = None
        self.heldout_by_domain: dict[str, float] = {}
        self.elapsed = 0.0  # seconds spent in step()

    # -- state -----------------------------------------------------------------------------------------
    @property
    def steps_done(self) -> int:
        return self._step

    @property
    def done(self) -> bool:
        return self._step >= self.config.steps

    def bias(self) -> np.ndarray | None:
        """The loss-free balancing bias [layers, E], or None without it."""
        with self._lock:
            if self.config.bias_rate <= 0:
                return None
            return np.stack([getattr(r, BIAS_NAME).detach().numpy().copy() for r in self.routers])

    def history(self) -> pd.DataFrame:
        """One row per step done: HISTORY_COLUMNS (heldout_loss NaN between evaluations)."""
        with self._lock:
            return pd.DataFrame(list(self._rows), columns=HISTORY_COLUMNS)

    def load_history(self) -> pd.DataFrame:
        """Long form: step, layer, expert, load = the expert's share of the step's k·tokens slots (dropped
        slots count for no expert, so a step's shares sum to 1 − dropped fraction)."""
        with self._lock:
            loads = self._loads[: self._step].copy()
        steps, layers, experts = loads.shape
        grid = np.indices((steps, layers, experts)).reshape(3, -1)
        return pd.DataFrame(
            {
                "step": grid[0] + 1,
                "layer": grid[1],
                "expert": grid[2],
                "load": loads.reshape(-1).astype(np.float64),
            },
            columns=LOAD_COLUMNS,
        )

    def release_training_state(self) -> None:
        """Drop the gradients and AdamW's moments (3/4 of a run's parameter memory) once it ends: the weights
        stay for the other pages; `step()` after this fails."""
        with self._lock:
            self.model.zero_grad(set_to_none=True)
            self.optimizer.state.clear()
            self.optimizer = None

    # -- training --------------------------------------------------------------------------------------
    def step(self) -> dict:
        """Train on the next batch; the history row of this step."""
        return timed_step(self, "the lab run")

    def _train_step(self) -> dict:
        c = self.config
        lr = lr_at(self._step, c.steps, c.lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        ids = self.corpus.train_batch(self._rng, c.batch, c.seq)
        for router in self.routers:
            router.lab_recording = True
        try:
            out = self.model(input_ids=ids, labels=ids, use_cache=False)
            records = [router.lab_record for router in self.routers]
        finally:
            for router in self.routers:
                router.lab_recording, router.lab_record = False, None
        aux_terms, z_terms, selected, kept_counts, dropped = [], [], [], [], []
        for record in records:
            assert record is not None  # every router records in the forward above
            logits, probs, indices, kept, top = record
            counts = torch.bincount(indices.reshape(-1), minlength=c.experts)
            f = torch.bincount(top.reshape(-1), minlength=c.experts).float() / top.numel()
            aux_terms.append(c.experts * (f * probs.mean(0)).sum())  # aux_loss_megatron
            z_terms.append(torch.logsumexp(logits.float(), dim=-1).pow(2).mean())  # z_loss
            selected.append(counts.numpy())
            if kept is None:
                kept_counts.append(counts.numpy())
                dropped.append(0)
            else:
                kept_counts.append(torch.bincount(indices[kept], minlength=c.experts).numpy())
                dropped.append(int((~kept).sum()))
        aux = torch.stack(aux_terms).mean()
        z = torch.stack(z_terms).mean()
        loss = out.loss + c.aux_coef * aux + c.z_coef * z
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        if c.bias_rate > 0:
            self._update_bias(selected)
        slots = c.batch * c.seq * c.k
        kept_arr = np.stack(kept_counts).astype(np.int64)  # [layers, E]
        dropped_arr = np.asarray(dropped, dtype=np.int64)
        self._loads[self._step] = kept_arr / slots
        self._window.append((kept_arr, dropped_arr))
        self._step += 1
        heldout = float("nan")
        if self._step % c.eval_every == 0 or self.done:
            heldout = self._evaluate()
        z_per_layer = [float(t.detach()) for t in z_terms]
        collapsed = self._collapsed(z_per_layer)
        if collapsed and self.collapse_step is None:
            self.collapse_step = self._step
        tokens = c.batch * c.seq
        step_balance = balance_indicators(kept_arr, tokens, c.k, ("load_entropy",))  # per layer
        # [layers, E], the last LOAD_WINDOW steps
        window_counts = np.sum([w[0] for w in self._window], axis=0)
        window_balance = balance_indicators(window_counts, tokens * len(self._window), c.k, ("dead_experts",))
        row = {
            "step": self._step,
            "train_loss": float(out.loss.detach()),
            "heldout_loss": heldout,
            "aux_loss_megatron": float(aux.detach()),
            "z_loss": float(z.detach()),
            "load_entropy": float(np.mean(step_balance["load_entropy"])),  # normalised, mean over layers
            "dead_experts_window_sum": int(window_balance["dead_experts"].sum()),
            "collapsed": bool(collapsed),
            "dropped_fraction": float(dropped_arr.sum() / (slots * c.layers)),
            "lr": lr,
        }
        self._rows.append(row)
        return row

    @torch.no_grad()
    def _update_bias(self, selected: list[np.ndarray]) -> None:
        """DeepSeek-V3: b_e += γ · sign(mean load − load_e), per layer, from this step's selected slots."""
        for router, counts in zip(self.routers, selected, strict=True):
            load = torch.from_numpy(counts.astype(np.float32))
            getattr(router, BIAS_NAME).add_(self.config.bias_rate * torch.sign(load.mean() - load))

    def _collapsed(self, z_per_layer: list[float]) -> bool:
        """moeviz's collapse verdict (moeviz.analysis.collapse.judge_layer with `self.thresholds`) on the
        loads of the last LOAD_WINDOW steps, each sequence counted as one text: True when some layer is
        "collapsed"."""
        c = self.config
        kept = np.sum([w[0] for w in self._window], axis=0)
        dropped = np.sum([w[1] for w in self._window], axis=0)
        sequences = c.batch * len(self._window)
        biases = self.bias()
        for layer in range(c.layers):
            balance = balance_from_counts(kept[layer], sequences * c.seq, c.k, int(dropped[layer]))
            verdict = judge_layer(
                layer,
                "mlp",
                balance,
                z_per_layer[layer],
                None if biases is None else bias_stats(biases[layer]),
                self.thresholds,
                layers=c.layers,
                sequence_lengths=[c.seq] * sequences,
            )
            if verdict.verdict >= Verdict.COLLAPSED:
                return True
        return False

    @torch.no_grad()
    def _evaluate(self) -> float:
        """Mean next-token loss on the fixed held-out batch (evaluation mode: no noise, no capacity); the
        per-domain means go to `heldout_by_domain`."""
        self.model.eval()
        try:
            logits = self.model(input_ids=self._heldout, use_cache=False).logits.float()
        finally:
            self.model.train()
        targets = self._heldout[:, 1:]
        per_row = (
            F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
            )
            .reshape(targets.shape)
            .mean(1)
        )
        by_domain: dict[str, list[float]] = {}
        for domain, value in zip(self._heldout_domains, per_row.tolist(), strict=True):
            by_domain.setdefault(domain, []).append(value)
        self.heldout_by_domain = {d: float(np.mean(v)) for d, v in by_domain.items()}
        return float(per_row.mean())

    def run(self, steps: int | None = None) -> pd.DataFrame:
        """Train `steps` more steps (default: to the end); the history."""
        target = self.config.steps if steps is None else min(self.config.steps, self._step + steps)
        while self._step < target:
            self.step()
        return self.history()

    # -- the trained model -----------------------------------------------------------------------------
    def _plain_copy(self) -> MixtralForCausalLM:
        """A stock transformers Mixtral with the current weights (evaluation mode)."""
        with MODEL_BUILD_LOCK:
            copy = MixtralForCausalLM(self.model.config)
        copy.load_state_dict(self.model.state_dict())  # the bias buffer is not in the state dict
        return copy.eval()

    def loaded_model(self) -> LoadedModel:
        """The model as it is now, as a moeviz LoadedModel (a copy: training may go on). With loss-free
        balancing its routers keep the selection bias (capture reads it as the router's bias); noise and
        capacity are training-only and off."""
        with self._lock:
            model = self._plain_copy()
            biases = self.bias()
            step = self._step
        notes = [f"trained in the lab: {self.config.label()}, {step} of {self.config.steps} steps"]
        if biases is not None:
            for router, bias in zip(install_routers(model, bias=True), biases, strict=True):
                getattr(router, BIAS_NAME).copy_(torch.from_numpy(bias))
            model.eval()
            notes.append(
                "its routers add the loss-free balancing bias for selection; a saved folder cannot carry it "
                "(transformers' Mixtral has no selection bias), so the saved model routes without it"
            )
        # no folder on disk holds it (save() writes one)
        return in_memory_model(
            model, f"lab: {self.config.label()} @ step {step}", notes, LAB_FOLDER, LONG_CONTEXT
        )

    def save(self, folder: str | Path) -> Path:
        """Write a Hugging Face folder (config.json, model.safetensors in fp32, the tokenizer, and lab.json
        with the config, the history's last row and any balancing bias) that `moeviz.load_model` opens."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        with self._lock:
            model = self._plain_copy()
            biases = self.bias()
            step = self._step
            last = dict(self._rows[-1]) if self._rows else {}
        model.save_pretrained(folder)
        lab_tokenizer().save_pretrained(folder)
        meta = {
            "config": asdict(self.config),
            "steps_done": step,
            "collapse_step": self.collapse_step,
            "last": last,
            "heldout_by_domain": self.heldout_by_domain,
        }
        if biases is not None:
            meta["selection_bias"] = biases.tolist()
            meta["note"] = (
                "trained with loss-free balancing: its routers added selection_bias to the probabilities "
                "before top-k; transformers' Mixtral cannot hold it, so this folder routes without it"
            )
        (folder / "lab.json").write_text(dumps(meta, indent=2) + "\n", encoding="utf-8")
        return folder
