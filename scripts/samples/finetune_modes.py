"""Fine-tune the healthy Mixtral sample on one domain in each of the Lab's four modes and write what each did
to the loss and to the routing: the small run the Learn page's "Fine-tuning" step shows.

    python scripts/samples/finetune_modes.py [--out sample_models/finetune-modes] [--stop-after N]

The recipe (`RECIPE`): start from `sample:mixtral-healthy`, fine-tune on `python` (the held-out slice's
first 90% of tokens; the base never saw this text), 60 steps of 8 × 64 tokens, AdamW lr 3e-4 with the Lab's
warm-up and cosine, aux coefficient 0.01, seed 0, evaluated after every step; LoRA rank 8, alpha 16 on the
attention projections, the routers and the experts. One run per mode of `moeviz.lab.finetune.MODES`, each
seeded afresh (`torch.manual_seed(SEED)`: LoRA's A matrices; the batches come from the config's seed, the
same for every mode). One torch thread throughout: the files are the same bit for bit on a rerun.

Written into `--out` (small: tens of KB):
- curves.parquet: per mode and step, `FinetuneRun.history()` (train loss, aux loss, new-domain and
  old-domain held-out loss, router mismatch vs the base, worst layer's max share, mean load entropy, lr);
- balance.parquet: per mode, step and MoE layer, max share and load entropy on the evaluation batch;
- summary.parquet: per mode, `finetune_summary` (adapted? forgot? kept balance?);
- layers.parquet: per mode and MoE layer at the end, on every held-out window of the new domain: router
  mismatch and top-1 mismatch vs the base (`engine_diff`), the collapse verdicts before and after and the
  router-weight delta (`moeviz.analysis.finetune_diff`);
- load_shift.parquet: per mode, MoE layer and expert, the load shift on the new domain with its paired
  bootstrap band (`load_shift_frame`);
- run.json: the recipe, the thresholds of the verdicts, per mode its trainable parameters and model
  verdicts, and the versions it ran with.

`--stop-after N` trains only the first N steps of the same schedule (the learning rate still follows the
60-step schedule), so its curves are the first N + 1 rows of the full run's (tests/system checks that the
shipped curves come from this recipe that way).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path

import pandas as pd
import torch

import moeviz
from moeviz.analysis.finetune_diff import finetune_diff, router_weights
from moeviz.lab.data import lab_corpus
from moeviz.lab.finetune import (
    ADAPTED_DROP,
    BALANCE_SLACK,
    FORGOT_RISE,
    LORA_TARGETS,
    MODE_LABELS,
    MODES,
    FinetuneConfig,
    FinetuneRun,
    finetune_summary,
)

SEED = 0
RECIPE = FinetuneConfig(
    start="sample:mixtral-healthy",
    mode="router",  # replaced per run
    domain="python",
    steps=60,
    lr=3e-4,
    batch=8,
    seq=64,
    seed=SEED,
    eval_every=1,
    aux_coef=0.01,
    lora_rank=8,
    lora_alpha=16.0,
    lora_targets=LORA_TARGETS,
)
DRAWS = 1000  # bootstrap resamples of the load-shift bands
LEVEL = 0.9
WHY_DOMAIN = (
    "the sample was trained on all five domains of the corpus, so no domain is new to it; what is new is "
    "the held-out text, whose domain gets all the weight. Code is the most distinct of the five "
    "(indentation, identifiers, punctuation): with this recipe every mode's effect shows within 60 small "
    "steps (full fine-tuning's new-domain loss fell by 0.09 nats), while on bible_es it fell by 0.02, less "
    "than LoRA's 0.03. It is also the Lab's default new domain."
)
FILES = ("curves", "balance", "summary", "layers", "load_shift")


def new_domain_windows(config: FinetuneConfig) -> list[list[int]]:
    """Every whole window of `config.seq` tokens of the new domain's held-out part (the base never saw it)."""
    ids = lab_corpus().heldout[config.new_domain]
    fit = len(ids) // config.seq
    return [ids[i * config.seq : (i + 1) * config.seq].tolist() for i in range(fit)]


def run_mode(mode: str, stop_after: int | None):
    """One fine-tune of RECIPE in `mode`, trained for all its steps or the first `stop_after`."""
    torch.manual_seed(SEED)
    run = FinetuneRun(RECIPE.with_mode(mode))
    run.run(stop_after)
    return run


def end_of_run(run: FinetuneRun, base, base_trace, windows) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(per-layer frame, load-shift frame, model verdicts) of the fine-tuned model against the base on the
    new domain's held-out windows."""
    tuned = run.loaded_model()
    trace = moeviz.capture(tuned, token_ids=windows)
    diff = finetune_diff(
        base_trace,
        trace,
        base_weights=router_weights(base),
        tuned_weights=router_weights(tuned),
        level=LEVEL,
        draws=DRAWS,
        seed=SEED,
    )
    routing = diff.routing.layers[["layer", "site", "pairs", "router_mismatch", "top1_mismatch"]]
    delta = diff.router_delta if diff.router_delta is not None else pd.DataFrame(columns=["layer", "site"])
    layers = (
        routing.merge(diff.balance.drop(columns=["reasons_tuned"]), on=["layer", "site"])
        .merge(
            delta[["layer", "site", "relative", "rank"]].rename(
                columns={"relative": "router_delta_relative", "rank": "router_delta_rank"}
            ),
            on=["layer", "site"],
            how="left",
        )
        .sort_values("layer")
        .reset_index(drop=True)
    )
    verdicts = {
        "verdict_base": str(diff.verdict_base),
        "verdict_tuned": str(diff.verdict_tuned),
        "degraded": bool(diff.degraded),
    }
    return layers, diff.load_shift, verdicts


def with_mode(frame: pd.DataFrame, mode: str) -> pd.DataFrame:
    return frame.assign(mode=mode)[["mode", *frame.columns]]


def versions() -> dict[str, str]:
    names = ("torch", "transformers", "peft", "numpy", "pandas", "pyarrow")
    return {"python": platform.python_version(), **{name: version(name) for name in names}}


def readme(meta: dict, summary: pd.DataFrame) -> str:
    """The folder's README: what it holds, the recipe command, seed and versions, and the summary."""
    c, t = meta["config"], meta["thresholds"]
    rows = "\n".join(
        f"| {r['mode']} | {r['trainable']:,} | {r['new loss drop']:+.3f} | {r['old loss rise']:+.3f} | "
        f"{r['router mismatch']:.3f} | {r['max share before']:.3f} → {r['max share after']:.3f} | "
        f"{r['adapted']} | {r['forgot']} | {r['kept balance']} |"
        for r in summary.to_dict("records")
    )
    v = ", ".join(f"{name} {number}" for name, number in meta["versions"].items())
    return f"""# finetune-modes

What each fine-tuning mode of the Lab (`moeviz.lab.finetune`) did to `{c["start"]}` on the
`{meta["new_domain"]}` held-out text: the numbers behind the Learn page's "Fine-tuning" step. Not a model
(no weights here): `moeviz.list_samples()` does not list it.

Recipe: `{meta["recipe"]}` (from the repository root; `scripts/samples/finetune_modes.py` documents every
file). Seed {meta["seed"]}, {meta["threads"]} torch thread; {c["steps"]} steps of {c["batch"]} × {c["seq"]}
tokens, AdamW lr {c["lr"]:g} (warm-up, cosine), aux coefficient {c["aux_coef"]:g}, evaluated after every
step; LoRA rank {c["lora_rank"]}, alpha {c["lora_alpha"]:g} on {", ".join(c["lora_targets"])}.
Versions: {v}.

Why {meta["new_domain"]}: {meta["why_this_domain"]}

| mode | trainable | new loss drop | old loss rise | mismatch | max share | adapted | forgot | balanced |
|---|---:|---:|---:|---:|---|---|---|---|
{rows}

Losses in nats per token on the held-out windows of `moeviz.lab.finetune` (4 per domain); adapted: a
drop of at least {t["adapted_drop"]:g}; forgot: a rise above {t["forgot_rise"]:g}; balanced (kept
balance): no layer's max share rose by more than {t["balance_slack"]:g} of the even share; mismatch: the
router mismatch vs the base at the last step. layers.parquet and load_shift.parquet compare each
fine-tune with the base on all {meta["end_of_run"]["tokens"]:,} held-out tokens of the new domain.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("sample_models/finetune-modes"))
    parser.add_argument("--stop-after", type=int, default=None, help="train only the first N steps")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args(argv)
    if args.stop_after is not None and not 0 <= args.stop_after <= RECIPE.steps:
        parser.error(f"--stop-after must be 0 … {RECIPE.steps}")
    torch.set_num_threads(1)  # one thread: the same sums in the same order on every run

    base = moeviz.load_model(RECIPE.start, dtype="float32", device="cpu")
    windows = new_domain_windows(RECIPE)
    base_trace = moeviz.capture(base, token_ids=windows)
    frames: dict[str, list[pd.DataFrame]] = {name: [] for name in FILES}
    results, modes = [], {}
    for mode in args.modes:
        started = time.process_time()
        run = run_mode(mode, args.stop_after)
        trained = time.process_time() - started
        frames["curves"].append(with_mode(run.history(), mode))
        frames["balance"].append(with_mode(run.load_history(), mode))
        layers, shift, verdicts = end_of_run(run, base, base_trace, windows)
        frames["layers"].append(with_mode(layers, mode))
        frames["load_shift"].append(with_mode(shift, mode))
        results.append(run.result(mode))
        modes[mode] = {
            "label": MODE_LABELS[mode],
            "trainable": run.trainable,
            "parameters": run.parameters,
            "steps_done": run.steps_done,
            **verdicts,
        }
        last = run.history().iloc[-1]
        print(
            f"{MODE_LABELS[mode]:>12}: {run.steps_done} steps in {trained:.1f} s CPU; new-domain loss "
            f"{last['new_loss']:.4f}, old {last['old_loss']:.4f}, router mismatch "
            f"{last['router_mismatch']:.3f}",
            flush=True,
        )
    frames["summary"] = [finetune_summary(results)]
    args.out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        pd.concat(frames[name], ignore_index=True).to_parquet(args.out / f"{name}.parquet", index=False)
    config = asdict(RECIPE)
    config.pop("mode")
    meta = {
        "recipe": "python scripts/samples/finetune_modes.py"
        + (f" --stop-after {args.stop_after}" if args.stop_after is not None else ""),
        "seed": SEED,
        "threads": 1,
        "config": config,
        "new_domain": RECIPE.new_domain,
        "why_this_domain": WHY_DOMAIN,
        "end_of_run": {
            "tokens": len(windows) * RECIPE.seq,
            "windows": len(windows),
            "level": LEVEL,
            "draws": DRAWS,
        },
        "thresholds": {
            "adapted_drop": ADAPTED_DROP,
            "forgot_rise": FORGOT_RISE,
            "balance_slack": BALANCE_SLACK,
        },
        "experts": int(base_trace.layers[0].num_experts),
        "top_k": int(base_trace.layers[0].k),
        "modes": modes,
        "versions": versions(),
    }
    (args.out / "run.json").write_text(json.dumps(meta, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    (args.out / "README.md").write_text(readme(meta, frames["summary"][0]), encoding="utf-8")
    print(f"wrote {args.out} ({sum(p.stat().st_size for p in args.out.iterdir()):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
