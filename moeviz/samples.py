"""The committed held-out evaluation slices (`sample_models/eval/<domain>.txt`) and the fixed protocol
that model cards and tests use to measure the sample models: the first `chunks` windows of `length`
tokens of each domain, one sequence per window; and the example prompt the app opens on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moeviz.errors import InputError
from moeviz.models.sources import sample_models_dir

if TYPE_CHECKING:  # no torch at import: the app names the domains before it loads torch
    from moeviz.models.loading import LoadedModel

DOMAINS = ("english", "python", "bible_en", "bible_es", "data")
# The prompt the app opens on; its routing by each bundled sample ships with the sample
# (`moeviz.models.bundled_examples`).
EXAMPLE_PROMPT = (
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list)."
)


def eval_dir() -> Path:
    return sample_models_dir() / "eval"


@dataclass(frozen=True)
class EvalBatch:
    """token_ids [S][length] and the domain of each sequence."""

    token_ids: list[list[int]]
    domains: list[str]


def eval_batch(loaded: LoadedModel, chunks: int = 8, length: int = 256) -> EvalBatch:
    """Windows of the eval slices, tokenized with the model's own tokenizer."""
    if loaded.tokenizer is None:
        raise InputError("the evaluation protocol needs a model with a tokenizer")
    token_ids, domains = [], []
    for domain in DOMAINS:
        path = eval_dir() / f"{domain}.txt"
        if not path.is_file():
            raise InputError(f"evaluation slice {path} is missing")
        ids = loaded.tokenizer(path.read_text(encoding="utf-8"))["input_ids"]
        for i in range(min(chunks, len(ids) // length)):
            token_ids.append(ids[i * length : (i + 1) * length])
            domains.append(domain)
    return EvalBatch(token_ids, domains)


# ---- the measurements a sample's model card reports --------------------------------------------------
def heldout_loss(loaded: LoadedModel, batch: EvalBatch) -> dict[str, float]:
    """Mean next-token loss (nats/token) per domain on the evaluation windows."""
    import numpy as np
    import torch

    losses: dict[str, list[float]] = {}
    with torch.inference_mode():
        for ids, domain in zip(batch.token_ids, batch.domains, strict=True):
            x = torch.tensor([ids])
            losses.setdefault(domain, []).append(loaded.model(input_ids=x, labels=x).loss.item())
    return {domain: round(float(np.mean(values)), 4) for domain, values in losses.items()}


def bias_rows(trace) -> list[dict]:
    """Per biased layer: bias spread, and how often the bias changed the dispatched set vs unbiased top-k."""
    from moeviz.analysis.confidence import decision_set, topk_overlap
    from moeviz.analysis.losses import bias_stats, router_probs

    rows = []
    for routing in trace.layers:
        spread = bias_stats(routing.bias)
        if spread is None:
            continue
        overlap = topk_overlap(router_probs(routing), decision_set(routing), routing.k)
        rows.append(
            {
                "layer": routing.layer,
                "bias_std": round(spread.std, 5),
                "bias_max_abs": round(spread.max_abs, 5),
                "changed_selection_share": round(float((overlap < 1).mean()), 4),
                "mean_unbiased_overlap": round(float(overlap.mean()), 4),
            }
        )
    return rows


def measure_sample(loaded: LoadedModel) -> dict:
    """Everything a sample's card states, measured with moeviz on the committed evaluation slices."""
    from moeviz.analysis import balance_frame, collapse_report
    from moeviz.analysis.specialisation import domain_specialisation_frame
    from moeviz.architecture import parameter_summary
    from moeviz.capture import capture

    batch = eval_batch(loaded)
    trace = capture(loaded, token_ids=batch.token_ids)
    summary = balance_frame(trace)
    special = domain_specialisation_frame(trace, batch.domains)
    verdicts = collapse_report(trace).layers
    params = parameter_summary(loaded.model)
    layers = []
    for row, spec, verdict in zip(summary.itertuples(), special.itertuples(), verdicts, strict=True):
        layers.append(
            {
                "layer": int(row.layer),
                "load_entropy": round(float(row.load_entropy), 4),
                "max_share": round(float(row.max_share), 4),
                "dead_experts": int(row.dead_experts),
                "verdict": str(verdict.verdict),
                "reasons": verdict.reasons,
                "domain_mi_bits": round(float(spec.mi_bits), 4),
                "domain_mi_null": round(float(spec.null_mean), 4),
            }
        )
    return {
        "protocol": "moeviz.samples.eval_batch(chunks=8, length=256): 8 windows of 256 tokens per domain",
        "tokens": len(trace.tokens),
        "parameters_total": params["total"],
        "parameters_active_per_token": params["active"],
        "heldout_loss_nats": heldout_loss(loaded, batch),
        "layers": layers,
        "bias": bias_rows(trace),
    }


def write_eval_prefix(loaded: LoadedModel, folder: Path, tokens_per_domain: int) -> Path:
    """Write the text of the first `tokens_per_domain` tokens (this model's tokenizer) of each evaluation
    slice to `folder/<domain>.txt`: a small corpus on which every checkpoint of a series sees the same
    tokens."""
    if loaded.tokenizer is None or not getattr(loaded.tokenizer, "is_fast", False):
        raise InputError("cutting the evaluation slices by token needs a model with a fast tokenizer")
    folder.mkdir(parents=True, exist_ok=True)
    for domain in DOMAINS:
        text = (eval_dir() / f"{domain}.txt").read_text(encoding="utf-8")
        offsets = loaded.tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
        end = offsets[min(tokens_per_domain, len(offsets)) - 1][1]
        (folder / f"{domain}.txt").write_text(text[:end], encoding="utf-8")
    return folder
