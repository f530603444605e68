"""Measure a trained sample model with moeviz and write its model card (README.md) and routing_stats.json.

    python scripts/samples/write_card.py sample_models/mixtral-healthy --title "..." --how "..."

Every routing number in the card comes from `moeviz` on the committed evaluation slices with the protocol
in `moeviz.samples.eval_batch`, so a user can reproduce it (tests/models/test_sample_models.py does).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import moeviz
from moeviz.samples import measure_sample


def attention_line(config: dict) -> str:
    """The card's sentence on attention span (sliding-window models only)."""
    window = config.get("sliding_window")
    if not window:
        return ""
    return (
        f"\nAttention: a sliding window of {window} tokens (the training length), so the model stays in "
        f"distribution up to its {config['max_position_embeddings']:,}-token context."
    )


def card(folder: Path, stats: dict, title: str, how: str) -> str:
    config = json.loads((folder / "config.json").read_text())
    training = json.loads((folder / "training.json").read_text())
    rows = "\n".join(
        f"| {r['layer']} | {r['load_entropy']:.3f} | {r['max_share']:.3f} | {r['dead_experts']} | "
        f"{r['verdict']} | {r['domain_mi_bits']:.3f} (null {r['domain_mi_null']:.3f}) |"
        for r in stats["layers"]
    )
    reasons = "\n".join(
        f"- layer {r['layer']}: " + "; ".join(r["reasons"]) for r in stats["layers"] if r["reasons"]
    )
    reasons = reasons or "every layer healthy."
    losses = " · ".join(f"{d} {v:.2f}" for d, v in stats["heldout_loss_nats"].items())
    bias = ""
    if stats["bias"]:
        bias_rows = "\n".join(
            f"| {b['layer']} | {b['bias_std']:.4f} | {b['bias_max_abs']:.4f} | {b['changed_selection_share']:.3f} |"
            for b in stats["bias"]
        )
        bias = (
            "\n## Balancing bias\n\n| layer | bias std | max abs bias | tokens whose dispatched set differs "
            f"from the unbiased top-k |\n|---|---|---|---|\n{bias_rows}\n"
        )
    return f"""# {folder.name}

{title}

{how}

## Architecture
`{config["architectures"][0]}`: {config["num_hidden_layers"]} layers, d={config["hidden_size"]}, \
{config.get("num_local_experts") or config.get("n_routed_experts")} routed experts, \
top-{config["num_experts_per_tok"]}, vocabulary {config["vocab_size"]} (byte-level BPE), tied embeddings.{attention_line(config)}
Parameters: {stats["parameters_total"]:,} total, {stats["parameters_active_per_token"]:,} active per token.
Weights stored as fp16 safetensors.

## Training
{training["steps"]} steps × {training["batch"]} sequences × {training["seq"]} tokens, AdamW lr \
{training["lr"]} (betas 0.9/0.95, weight decay 0.1, {training["warmup"]} warm-up steps, cosine to 10%), \
clip 1.0, seed {training["seed"]}, {training["threads"]} CPU thread: {training.get("seconds", 0) / 60:.1f} min wall time (four runs sharing a 2-core machine; about 11 min alone).
Balancing: `--balance {training["balance"]}` (aux coefficient {training["aux_coef"]}, bias rate \
{training["bias_rate"]}). Recipe: `scripts/samples/` (see its README).

## Data and licences
Five domains, sampled equally: English reference prose (CPython `pydoc_data.topics`, PSF-2.0), Python code
(CPython standard library, PSF-2.0), English and Spanish Bible text (from the World English Bible and the
Reina-Valera 1909, public domain; parallel verses), and synthetic CSV / JSON lines / arithmetic (own).
Held-out slices: `sample_models/eval/` (licences in its LICENSES.md).

## Held-out loss (nats/token)
{losses}

## Routing, measured by moeviz
On {stats["tokens"]:,} held-out tokens ({stats["protocol"]}). Load entropy is normalised (1 = uniform),
max share is the largest expert's share of dispatched slots (uniform = 1/E), domain MI is the mutual
information between a token's domain and its top-1 expert in bits (max log2 5 = 2.32; null = shuffled domains).
Verdicts are moeviz's collapse verdicts with their default thresholds (`moeviz.analysis.CollapseThresholds`):
{reasons}

| layer | load entropy | max share | dead experts | verdict | domain MI bits |
|---|---|---|---|---|---|
{rows}
{bias}
Reproduce: `python scripts/samples/write_card.py sample_models/{folder.name} --check`.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--title", default="")
    parser.add_argument("--how", default="")
    parser.add_argument("--check", action="store_true", help="print the measurement, write nothing")
    args = parser.parse_args()
    stats = measure_sample(moeviz.load_model(args.folder))
    if args.check:
        print(json.dumps(stats, indent=2))
        return
    (args.folder / "routing_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    (args.folder / "README.md").write_text(card(args.folder, stats, args.title, args.how))
    print(json.dumps(stats["layers"], indent=1))


if __name__ == "__main__":
    main()
