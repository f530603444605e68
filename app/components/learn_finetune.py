"""The Learn page's fine-tuning step, its numbers: the run shipped in `sample_models/finetune-modes/`
(written by `scripts/samples/finetune_modes.py`: the healthy Mixtral fine-tuned on one domain in each of the
Lab's four modes), read back; each mode's verdicts (adapted? forgot? kept balance?) by the Lab's own rule
(`moeviz.lab.finetune.finetune_summary`) over the shipped curves; the step's table, its "what to notice"
line and its per-mode explanation, every claim computed from those numbers. Streamlit-free (the page draws).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from moeviz.analysis.collapse import Verdict
from moeviz.lab.finetune import MODE_LABELS, MODES, FinetuneConfig, FinetuneResult, finetune_summary
from moeviz.models.loading import sample_models_dir

FOLDER = "finetune-modes"  # under sample_models/
RECIPE = "python scripts/samples/finetune_modes.py"
FILES = ("curves", "balance", "layers", "load_shift")
TABLE_COLUMNS = [
    "mode",
    "trains",
    "new-domain loss",
    "old-domain loss",
    "routing changed",
    "most changed layer",
    "adapted",
    "forgot",
    "kept balance",
]


@dataclass(frozen=True)
class ShippedFinetune:
    """The shipped run: `curves` (mode, step, FinetuneRun.history() columns), `balance` (mode, step, layer,
    max_share, load_entropy), `layers` (mode, layer, router_mismatch, verdicts, … at the end, on the new
    domain's held-out tokens), `load_shift` (mode, layer, expert, shift, …) and `meta` (run.json)."""

    curves: pd.DataFrame
    balance: pd.DataFrame
    layers: pd.DataFrame
    load_shift: pd.DataFrame
    meta: dict

    @property
    def modes(self) -> list[str]:
        """The modes the run holds, in the Lab's order."""
        shipped = set(self.curves["mode"])
        return [mode for mode in MODES if mode in shipped]

    @property
    def labels(self) -> list[str]:
        return [MODE_LABELS[mode] for mode in self.modes]

    @property
    def domain(self) -> str:
        return str(self.meta["new_domain"])

    @property
    def steps(self) -> int:
        return int(self.curves["step"].max())

    @property
    def experts(self) -> int:
        return int(self.meta["experts"])


def shipped_folder() -> Path:
    return sample_models_dir() / FOLDER


def read_shipped(folder: Path | None = None) -> ShippedFinetune | None:
    """The shipped run in `folder` (default: sample_models/finetune-modes), or None when a file is missing."""
    folder = shipped_folder() if folder is None else folder
    paths = [folder / f"{name}.parquet" for name in FILES] + [folder / "run.json"]
    if not all(path.is_file() for path in paths):
        return None
    frames = [pd.read_parquet(path) for path in paths[:-1]]
    meta = json.loads(paths[-1].read_text(encoding="utf-8"))
    return ShippedFinetune(*frames, meta=meta)


def results(shipped: ShippedFinetune) -> list[FinetuneResult]:
    """Each mode's run as the Lab's `FinetuneResult`, rebuilt from the shipped curves and balance."""
    config = {**shipped.meta["config"], "lora_targets": tuple(shipped.meta["config"]["lora_targets"])}
    base = FinetuneConfig(**config)
    out = []
    for mode in shipped.modes:
        counts = shipped.meta["modes"][mode]
        history = shipped.curves[shipped.curves["mode"] == mode].drop(columns="mode").reset_index(drop=True)
        balance = shipped.balance[shipped.balance["mode"] == mode].drop(columns="mode").reset_index(drop=True)
        out.append(
            FinetuneResult(
                MODE_LABELS[mode],
                replace(base, mode=mode),
                int(counts["trainable"]),
                int(counts["parameters"]),
                history,
                balance,
                shipped.experts,
            )
        )
    return out


def summary(shipped: ShippedFinetune) -> pd.DataFrame:
    """`finetune_summary` of the shipped runs (one row per mode, indexed by its label), with `mode` (the key),
    each mode's trainable share and, from the end-of-run comparison on the new domain, its most changed
    layer and that layer's mismatch."""
    table = finetune_summary(results(shipped)).drop(columns="mode").set_index("run")
    table["key"] = [next(m for m in shipped.modes if MODE_LABELS[m] == run) for run in table.index]
    total = {mode: shipped.meta["modes"][mode]["parameters"] for mode in shipped.modes}
    table["trainable share"] = [table.at[run, "trainable"] / total[key] for run, key in table["key"].items()]
    worst = shipped.layers.sort_values(["router_mismatch", "layer"], ascending=[False, True])
    worst = worst.drop_duplicates("mode").set_index("mode")
    table["worst layer"] = [int(worst.at[key, "layer"]) for key in table["key"]]
    table["worst layer mismatch"] = [float(worst.at[key, "router_mismatch"]) for key in table["key"]]
    return table


def table(rows: pd.DataFrame) -> pd.DataFrame:
    """The step's table: one row per mode, numbers as text."""
    return pd.DataFrame(
        {
            "mode": rows.index,
            "trains": [f"{share:.1%}" for share in rows["trainable share"]],
            "new-domain loss": [f"{-drop:+.3f}" for drop in rows["new loss drop"]],
            "old-domain loss": [f"{rise:+.3f}" for rise in rows["old loss rise"]],
            "routing changed": [f"{m:.0%}" for m in rows["router mismatch"]],
            "most changed layer": [
                f"{layer} ({m:.0%})"
                for layer, m in zip(rows["worst layer"], rows["worst layer mismatch"], strict=True)
            ],
            "adapted": rows["adapted"].to_list(),
            "forgot": rows["forgot"].to_list(),
            "kept balance": rows["kept balance"].to_list(),
        },
        columns=TABLE_COLUMNS,
    )


def chart_frame(shipped: ShippedFinetune) -> pd.DataFrame:
    """The curves with each mode's label as `run` (the charts' colour key)."""
    return shipped.curves.assign(run=shipped.curves["mode"].map(MODE_LABELS))


def colour_key(colours: dict[str, str]) -> str:
    """One line of HTML naming each mode in its chart colour (the four panels have no legend of their own)."""
    return " &nbsp; ".join(
        f"<span style='color:{colour}; font-weight:600'>━ {label}</span>" for label, colour in colours.items()
    )


def _names(labels: list[str]) -> str:
    """'a', 'a and b', 'a, b and c', first letter capitalised by the caller where it opens a sentence."""
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _signed(value: float) -> str:
    return f"{value:+.3f}".replace("-", "−")


def _with_losses(rows: pd.DataFrame) -> list[str]:
    """Each mode's label with its (new-domain, old-domain) held-out loss change: 'LoRA (−0.043 / +0.004)'."""
    return [
        f"{run} ({_signed(-r['new loss drop'])} / {_signed(r['old loss rise'])})"
        for run, r in rows.iterrows()
    ]


def notice(rows: pd.DataFrame, shipped: ShippedFinetune) -> str:
    """The step's "what to notice" line from the summary `rows` (`summary`): which modes adapted and which
    forgot (first sentence: what a projector shows), which changed the routing most, and the balance (the
    curves' max share, and the collapse verdicts on the new domain's tokens before and after)."""
    adapted, forgot = rows["adapted"] == "yes", rows["forgot"] == "yes"
    clean = rows[adapted & ~forgot]
    parts, numbers = [], []
    for group, phrase in (
        (clean, "adapted without forgetting"),
        (rows[adapted & forgot], "adapted but forgot"),
        (rows[~adapted & forgot], "forgot without adapting"),
        (rows[~adapted & ~forgot], "barely moved either loss"),
    ):
        if group.empty:
            continue
        group = group.sort_values("new loss drop", ascending=False)
        more = not clean.empty and (group["new loss drop"] > clean["new loss drop"].max()).all()
        if phrase == "adapted but forgot" and more:
            phrase = "adapted more but forgot"
        parts.append(f"{_names(list(group.index))} {phrase}")
        numbers += _with_losses(group)
    first = f"After {shipped.steps} steps on {shipped.domain}, " + "; ".join(parts) + "."
    losses = (
        "Held-out loss change on the new / the old domains, in nats per token: " + ", ".join(numbers) + "."
    )
    routed = rows.sort_values("router mismatch", ascending=False)
    most, least = routed.index[0], routed.index[-1]
    second = (
        f"{_cap(most)} changed the most routing decisions ({routed['router mismatch'].iloc[0]:.0%} of the "
        f"top-k sets differ from the base's), {least} the fewest ({routed['router mismatch'].iloc[-1]:.0%})."
    )
    router = MODE_LABELS["router"]
    if router in rows.index and rows.at[router, "adapted"] == "no" and rows.at[router, "router mismatch"] > 0:
        second += (
            f" {_cap(router)} re-routed {rows.at[router, 'router mismatch']:.0%} of them yet did not adapt: "
            "choosing other experts did not help while the experts stayed as they were."
        )
    unbalanced = rows[rows["kept balance"] == "no"]
    if unbalanced.empty:
        third = (
            "Every mode kept the load balanced: the busiest expert of the worst layer had "
            f"{rows['max share before'].max():.1%} of the slots before, "
            f"{rows['max share after'].min():.1%}–{rows['max share after'].max():.1%} after"
        )
    else:
        third = f"{_cap(_names(list(unbalanced.index)))} lost balance: " + ", ".join(
            f"{run} {r['max share before']:.1%} → {r['max share after']:.1%}"
            for run, r in unbalanced.iterrows()
        )
    layers = shipped.layers
    worse = layers[layers["verdict_tuned"].map(Verdict.parse) > layers["verdict_base"].map(Verdict.parse)]
    if worse.empty:
        third += f"; no layer's collapse verdict on the {shipped.domain} tokens got worse."
    else:
        third += (
            "; collapse verdicts that got worse: "
            + ", ".join(
                f"{MODE_LABELS[r.mode]} layer {r.layer} ({r.verdict_base} → {r.verdict_tuned})"
                for r in worse.itertuples()
            )
            + "."
        )
    return " ".join([first, losses, second, third])


def frozen_layer_note(shipped: ShippedFinetune) -> str:
    """A sentence on experts-only's first MoE layer when its routing did not change on the new domain's
    tokens (its router reads only what frozen weights computed), "" otherwise."""
    mode = "experts"
    layers = shipped.layers[shipped.layers["mode"] == mode].sort_values("layer")
    if layers.empty:
        return ""
    first = layers.iloc[0]
    deeper = layers.iloc[1:]
    if first["router_mismatch"] != 0 or deeper.empty or not (deeper["router_mismatch"] > 0).any():
        return ""
    return (
        f" Experts only left layer {int(first['layer'])}'s routing untouched (0% changed; up to "
        f"{deeper['router_mismatch'].max():.0%} deeper): its router reads only frozen weights' output."
    )


def explanation(shipped: ShippedFinetune) -> str:
    """What each mode trains (markdown bullets), with its trainable parameters from the shipped run."""
    config = shipped.meta["config"]
    counts = {mode: shipped.meta["modes"][mode] for mode in shipped.modes}

    def share(mode: str) -> str:
        if mode not in counts:
            return ""
        c = counts[mode]
        return f" ({c['trainable']:,} parameters, {c['trainable'] / c['parameters']:.1%})"

    lines = {
        "router": f"**Router only**{share('router')}: each MoE layer's gate, so only *which* experts a token "
        "visits can change, not what they compute.",
        "experts": f"**Experts only**{share('experts')}: the experts' weights; the routers are frozen, so "
        "routing moves only where a router's input (earlier layers' experts) changed.",
        "lora": f"**LoRA**{share('lora')}: a rank-{config['lora_rank']} update B·A beside "
        f"{', '.join(config['lora_targets'])}; B starts at 0, so step 0 is the base.",
        "full": f"**Full**{share('full')}: every weight.",
    }
    return "\n".join(f"- {lines[mode]}" for mode in shipped.modes)
