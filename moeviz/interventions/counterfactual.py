"""What if the routing had been different? Run a prompt with interventions and compare before/after.

Everything runs through hooks installed for the one call (`moeviz.interventions.hooks`); the model is
never edited and other sessions sharing it are unaffected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from moeviz.capture.forward import capture, token_batch
from moeviz.errors import InputError
from moeviz.interventions.hooks import Probe, probing
from moeviz.interventions.specs import Intervention, _DisablePerSequence, apply, resolve
from moeviz.models.loading import LoadedModel
from moeviz.trace import Trace


def sequence_ids(loaded: LoadedModel, text: str | None, token_ids: Sequence[int] | None) -> list[int]:
    """One sequence of token ids from `text` or `token_ids` (validated like `capture`)."""
    if loaded.is_encoder_decoder:
        raise InputError("attribution and counterfactual routing cover decoder-only models")
    loaded.refuse_token_classifier("attribution and counterfactual routing")
    if token_ids is not None and len(token_ids) and not isinstance(token_ids[0], (int, np.integer)):
        raise InputError("give one sequence of token ids (a flat list of ints)")
    return token_batch(loaded, text, None if token_ids is None else [list(token_ids)])[0]


@contextmanager
def intervening(loaded: LoadedModel, interventions: Sequence[Intervention], seq_len: int) -> Iterator[Probe]:
    """Apply `interventions` to every forward this thread runs on `loaded` inside the block.

    `seq_len` is the length S of the [B, S] input, mapping a call's flattened rows to positions."""
    plan = resolve(loaded.sites, interventions)
    sites = loaded.sites

    def rewrite(site_index, index, weights, logits):
        shape = index.shape
        idx, w = index.reshape(-1, shape[-1]), weights.reshape(-1, shape[-1])
        for spec in plan[site_index]:
            idx, w = apply(spec, sites[site_index], idx, w, logits, seq_len)
        return idx, w

    probe = Probe()
    if plan:
        probe.rewrite, probe.rewrite_sites = rewrite, set(plan)
    with probing(loaded.model, sites, probe):
        yield probe


def next_token_logprobs(loaded: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """[B, S] ids -> [B, S, V] next-token log-probabilities (fp32) of one plain forward."""
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits
    return torch.log_softmax(logits.float(), dim=-1)


@dataclass
class Counterfactual:
    """Before/after of one prompt under interventions. T = tokens in the prompt.

    - token_ids [T], tokens [T]: the prompt
    - logprob_before / logprob_after [T-1]: log p(token[i+1] | tokens ≤ i) without / with the interventions
    - next_id: the model's own argmax after the last token (before); next_logprob_before/after its log-prob;
      next_id_after: the argmax with the interventions
    - before / after: the routing traces (after = what the experts actually received)
    """

    interventions: tuple[Intervention, ...]
    token_ids: np.ndarray
    tokens: list[str]
    logprob_before: np.ndarray
    logprob_after: np.ndarray
    next_id: int
    next_token: str
    next_logprob_before: float
    next_logprob_after: float
    next_id_after: int
    next_token_after: str
    before: Trace
    after: Trace

    def __post_init__(self) -> None:
        t = len(self.token_ids)
        if len(self.tokens) != t:
            raise ValueError(f"tokens: expected {t} strings, got {len(self.tokens)}")
        for name in ("logprob_before", "logprob_after"):
            arr = getattr(self, name)
            if arr.shape != (max(t - 1, 0),):
                raise ValueError(f"{name}: expected shape [{t - 1}] (T-1 next tokens), got {list(arr.shape)}")

    @property
    def next_logprob_change(self) -> float:
        return self.next_logprob_after - self.next_logprob_before

    @property
    def intervened_positions(self) -> tuple[int, ...] | None:
        """Positions the interventions act at (sorted), or None where one acts at every position."""
        found: set[int] = set()
        for spec in self.interventions:
            positions = getattr(spec, "positions", None)
            if positions is None:
                return None
            single = isinstance(positions, (int, np.integer))
            found.update([int(positions)] if single else map(int, positions))
        return tuple(sorted(found))

    @property
    def first_intervened(self) -> int:
        """The earliest position an intervention acts at (0 where one acts at every position)."""
        positions = self.intervened_positions
        return 0 if positions is None else min(positions, default=0)

    def position_frame(self) -> pd.DataFrame:
        """One row per position t < T-1: Δ log-prob of the prompt's actual next token,
        delta = log p_after(x_{t+1} | x_≤t) − log p_before(x_{t+1} | x_≤t).

        Columns pos, token (x_t), next_token (x_{t+1}), logprob_before, logprob_after, delta,
        intervened (an intervention acts at t), after (t ≥ `first_intervened`: a prediction the
        intervention can reach; earlier ones are 0 exactly in a causal model) and routing_changed (the
        dispatched experts of x_t changed at some MoE layer, `routing_changes`)."""
        t = len(self.token_ids)
        pos = np.arange(max(t - 1, 0))
        changes = self.routing_changes()
        changed = set(changes.loc[changes["changed"], "pos"].astype(int))
        positions = self.intervened_positions
        return pd.DataFrame(
            {
                "pos": pos,
                "token": self.tokens[:-1],
                "next_token": self.tokens[1:],
                "logprob_before": self.logprob_before,
                "logprob_after": self.logprob_after,
                "delta": self.logprob_after - self.logprob_before,
                "intervened": [positions is None or int(p) in positions for p in pos],
                "after": pos >= self.first_intervened,
                "routing_changed": [int(p) in changed for p in pos],
            }
        )

    @property
    def deltas_after(self) -> np.ndarray:
        """Δ log-prob of the actual next token at the positions from `first_intervened` on."""
        return (self.logprob_after - self.logprob_before)[self.first_intervened :]

    @property
    def mean_delta_after(self) -> float:
        """Mean Δ log-prob of the actual next token over the positions from the first intervened one on
        (`position_frame`'s rows with `after`); NaN where there are none (an intervention at the last
        token: see `next_logprob_change`)."""
        delta = self.deltas_after
        return float(delta.mean()) if len(delta) else float("nan")

    @property
    def max_abs_delta_after(self) -> float:
        """Largest |Δ log-prob| over the same positions as `mean_delta_after` (NaN where none)."""
        delta = self.deltas_after
        return float(np.abs(delta).max()) if len(delta) else float("nan")

    def token_frame(self) -> pd.DataFrame:
        """One row per position: the log-prob of the *next* prompt token before/after and its change."""
        t = len(self.token_ids)
        return pd.DataFrame(
            {
                "pos": np.arange(t - 1),
                "token": self.tokens[:-1],
                "next_token": self.tokens[1:],
                "logprob_before": self.logprob_before,
                "logprob_after": self.logprob_after,
                "change": self.logprob_after - self.logprob_before,
            }
        )

    def routing_changes(self) -> pd.DataFrame:
        """One row per (pos, MoE layer): dispatched experts before/after (weight > 0), whether the set
        changed, and the L1 change of the router scores (0 where the router saw the same input)."""
        frames = []
        pos_of_row = self.before.tokens["pos"].to_numpy()
        for b in self.before.layers:
            a = self.after.layer(b.layer, b.site)
            eb, ea = _dispatched(b.experts, b.weights), _dispatched(a.experts, a.weights)
            frames.append(
                pd.DataFrame(
                    {
                        "pos": pos_of_row[b.token_rows],
                        "token": np.asarray(self.tokens, dtype=object)[pos_of_row[b.token_rows]],
                        "layer": b.layer,
                        "site": b.site,
                        "experts_before": eb,
                        "experts_after": ea,
                        "changed": [x != y for x, y in zip(eb, ea, strict=True)],
                        "score_change": np.abs(a.scores - b.scores).sum(axis=1),
                    }
                )
            )
        return pd.concat(frames, ignore_index=True)

    def layer_summary(self) -> pd.DataFrame:
        """Per MoE layer: tokens whose dispatched experts changed, and the mean router-score change."""
        frame = self.routing_changes()
        return (
            frame.groupby(["layer", "site"], sort=True)
            .agg(
                tokens_changed=("changed", "sum"),
                fraction_changed=("changed", "mean"),
                mean_score_change=("score_change", "mean"),
            )
            .reset_index()
        )


def _dispatched(experts: np.ndarray, weights: np.ndarray) -> list[str]:
    """Per token, the experts that contributed (id ≥ 0 and weight ≠ 0), sorted, as a label like '1,5'."""
    out = []
    for e, w in zip(experts, weights, strict=True):
        out.append(",".join(str(int(x)) for x in sorted(e[(e >= 0) & (w != 0)])))
    return out


def counterfactual(
    loaded: LoadedModel,
    text: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    interventions: Sequence[Intervention],
) -> Counterfactual:
    """Run one prompt with and without `interventions`; see `Counterfactual` for what is compared."""
    ids = sequence_ids(loaded, text, token_ids)
    batch = torch.tensor([ids])
    seq = len(ids)
    resolve(loaded.sites, interventions)  # fail early on a bad spec, before any forward
    before = capture(loaded, token_ids=[ids])
    lp_before = next_token_logprobs(loaded, batch)[0]
    with intervening(loaded, interventions, seq):
        after = capture(loaded, token_ids=[ids])
        lp_after = next_token_logprobs(loaded, batch)[0]
    target = torch.tensor(ids[1:])
    gather = lambda lp: lp[:-1].gather(1, target[:, None])[:, 0].numpy()  # noqa: E731
    next_id = int(lp_before[-1].argmax())
    next_after = int(lp_after[-1].argmax())
    texts = loaded.token_texts([*ids, next_id, next_after])
    return Counterfactual(
        interventions=tuple(interventions),
        token_ids=np.asarray(ids),
        tokens=texts[:seq],
        logprob_before=gather(lp_before),
        logprob_after=gather(lp_after),
        next_id=next_id,
        next_token=texts[seq],
        next_logprob_before=float(lp_before[-1, next_id]),
        next_logprob_after=float(lp_after[-1, next_id]),
        next_id_after=next_after,
        next_token_after=texts[seq + 1],
        before=before,
        after=after,
    )


def expert_importance(
    loaded: LoadedModel,
    text: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    layers: Sequence[int] | None = None,
    batch_size: int = 8,
    progress: Callable[[float, str], None] | None = None,
) -> pd.DataFrame:
    """Per MoE layer and expert: Δ loss when the expert is disabled for every token, beside its use.

    Loss = mean next-token NLL of the text (nats). Columns: layer, site, expert, load (share of the
    layer's token slots dispatched to the expert), weighted_load (mean combination weight per token),
    tokens (tokens sent to it), loss, delta_loss (loss with it disabled − loss without). The disabled
    copies run `batch_size` at a time, each a copy of the text with a different expert disabled, next to
    an unmodified copy so the difference is taken within one forward.
    """
    ids = sequence_ids(loaded, text, token_ids)
    if len(ids) < 2:
        raise InputError("expert importance needs at least 2 tokens (a next-token loss)")
    seq = len(ids)
    trace = capture(loaded, token_ids=[ids])
    wanted = [s for s in loaded.sites if layers is None or s.layer in set(layers)]
    if not wanted:
        raise InputError(f"no MoE layer among {list(layers or [])}")
    target = torch.tensor(ids[1:])
    rows, done, total = [], 0, sum(site.num_experts for site in wanted)
    for site in wanted:
        routing = trace.layer(site.layer, site.site)
        n_tok = max(len(routing.token_rows), 1)
        experts = list(range(site.num_experts))
        for start in range(0, len(experts), batch_size):
            chunk = experts[start : start + batch_size]
            per_seq = (-1, *chunk)
            batch = torch.tensor([ids] * len(per_seq))
            spec = _DisablePerSequence(layer=site.layer, experts=per_seq, site=site.site)
            with intervening(loaded, [spec], seq):
                lp = next_token_logprobs(loaded, batch)
            nll = -lp[:, :-1].gather(2, target[None, :, None].expand(len(per_seq), -1, 1))[..., 0].mean(1)
            base = float(nll[0])
            for j, e in enumerate(chunk, start=1):
                hit = routing.experts == e
                rows.append(
                    {
                        "layer": site.layer,
                        "site": site.site,
                        "expert": e,
                        "load": float(hit.sum()) / (n_tok * routing.k),
                        "weighted_load": float(routing.weights[hit].sum()) / n_tok,
                        "tokens": int(hit.any(axis=1).sum()),
                        "loss": float(nll[j]),
                        "delta_loss": float(nll[j]) - base,
                    }
                )
            done += len(chunk)
            if progress is not None:
                progress(done / total, f"layer {site.layer}: experts {chunk[0]}–{chunk[-1]} disabled")
    return pd.DataFrame(rows)
