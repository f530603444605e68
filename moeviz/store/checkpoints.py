"""Checkpoint timelines: a series of checkpoints traced on one fixed token set, compared in the store.

Per layer and checkpoint c (ordered as given, the last = final):
- router saturation against the final (OLMoE): Sat_ℓ(c) = mean_t |S^c_t ∩ S^final_t| / |S^final_t| and the
  top-1 variant (as `moeviz.analysis.routing_agreement_frame`);
- balance and collapse indicators and the verdict (as `StoreQuery.collapse`);
- expert drift from the previous checkpoint: per expert 1 − |T^prev_e ∩ T^c_e| / |T^prev_e ∪ T^c_e|;
- per-domain specialisation: max_e DS(e, D) and its expert;
- the first checkpoint at which each collapse indicator crossed its warning / collapsed threshold.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moeviz.analysis.collapse import CollapseThresholds, judges_z_loss
from moeviz.errors import InputError
from moeviz.store.layout import StoreError, slug
from moeviz.store.query import StoreQuery
from moeviz.store.writer import TraceSettings


def _natural(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def resolve_series(spec: str | Path | Sequence[str | Path]) -> tuple[str, list[tuple[str, Path]]]:
    """(series label, [(checkpoint label, folder)] in training order) from a folder of checkpoint folders
    (sorted by name, numbers compared as numbers) or a list of folders (comma-separated or a sequence)."""
    if isinstance(spec, (str, Path)) and "," not in str(spec):
        folder = Path(spec)
        if not folder.is_dir():
            raise InputError(f"checkpoint series {folder} is not a folder")
        if (folder / "config.json").is_file():
            raise InputError(
                f"{folder} is one model, not a series: give a folder of checkpoint folders or A,B,C"
            )
        children = sorted(
            (p for p in folder.iterdir() if (p / "config.json").is_file()), key=lambda p: _natural(p.name)
        )
        if len(children) < 2:
            raise InputError(
                f"{folder} holds {len(children)} checkpoint folder(s) (with config.json); need ≥ 2"
            )
        return slug(folder.name), [(slug(p.name), p) for p in children]
    items = (
        [Path(s.strip()) for s in str(spec).split(",") if s.strip()] if isinstance(spec, str) else list(spec)
    )
    folders = [Path(p) for p in items]
    if len(folders) < 2:
        raise InputError(f"a checkpoint series needs at least 2 checkpoints, got {len(folders)}")
    for path in folders:
        if not (path / "config.json").is_file():
            raise InputError(f"checkpoint {path} is not a model folder (no config.json)")
    labels = [slug(p.name) for p in folders]
    if len(set(labels)) != len(labels):
        labels = [f"{i:03d}-{label}" for i, label in enumerate(labels)]
    parents = {p.resolve().parent.name for p in folders}
    name = slug(parents.pop()) if len(parents) == 1 else "series"
    return name, list(zip(labels, folders, strict=True))


def write_series(
    spec: str | Path | Sequence[str | Path],
    corpus: str | Path,
    store: str | Path,
    *,
    model: str | None = None,
    settings: TraceSettings | None = None,
    resume: bool = False,
    progress: bool = True,
    **load_options: Any,
) -> tuple[str, list[str]]:
    """Trace every checkpoint of a series on the same corpus plan into `store`; returns (model label,
    checkpoint labels in order). Each checkpoint is loaded (`moeviz.load_model(folder, **load_options)`:
    dtype, device, device_map, ...), traced and released in turn."""
    import gc

    from moeviz.models import load_model
    from moeviz.store.writer import write_corpus

    name, checkpoints = resolve_series(spec)
    name = model or name
    for index, (label, folder) in enumerate(checkpoints):
        loaded = load_model(folder, **load_options)
        write_corpus(
            loaded,
            corpus,
            store,
            model=name,
            checkpoint=label,
            checkpoint_index=index,
            settings=settings,
            resume=resume,
            progress=progress,
        )
        del loaded
        gc.collect()
    return name, [label for label, _ in checkpoints]


@dataclass(frozen=True)
class CheckpointTimeline:
    """Frames, tidy, `checkpoint` ordered as trained (`order` = its index):
    saturation: checkpoint, order, site, layer, tokens, saturation_topk, saturation_top1
    collapse: checkpoint, order, site, layer, verdict, reasons, max_share, dead_fraction, load_entropy, z_loss
    drift: checkpoint, order, site, layer, expert, load_prev, load, kept, jaccard, drift (vs previous)
    specialisation: checkpoint, order, site, layer, domain, tokens, top_expert, ds, baseline, lift
    crossings: site, layer, indicator, level, threshold, first_checkpoint (None = never), value"""

    model: str
    checkpoints: list[str]
    saturation: pd.DataFrame
    collapse: pd.DataFrame
    drift: pd.DataFrame
    specialisation: pd.DataFrame
    crossings: pd.DataFrame


INDICATORS = {
    # indicator: (direction, warning threshold field, collapsed threshold field)
    "max_share": (">", None, None),
    "dead_fraction": (">=", "warning_dead_fraction", "collapsed_dead_fraction"),
    "load_entropy": ("<", "warning_load_entropy", "collapsed_load_entropy"),
    "z_loss": (">", None, None),  # its warning level depends on E: CollapseThresholds.z_loss_threshold
}


def checkpoint_timeline(
    store: str | Path,
    model: str | None = None,
    checkpoints: Sequence[str] | None = None,
    thresholds: CollapseThresholds | None = None,
) -> CheckpointTimeline:
    """The timeline of one model's checkpoints in `store` (all of them by default, in traced order)."""
    query = StoreQuery(store, model=model, checkpoint=checkpoints)
    models = sorted({r.model for r in query.runs})
    if len(models) != 1:
        raise StoreError(f"the store holds several models ({', '.join(models)}): choose one")
    runs = sorted(query.runs, key=lambda r: (r.checkpoint_index, _natural(r.checkpoint)))
    if len(runs) < 2:
        raise StoreError(f"model {models[0]!r} has {len(runs)} checkpoint in the store; a timeline needs ≥ 2")
    reference = {b: p["token_hash"] for b, p in runs[-1].parts.items()}
    for run in runs:
        if not run.complete:
            raise StoreError(
                f"checkpoint {run.checkpoint!r} is incomplete: finish it with `moeviz trace --resume`"
            )
        if {b: p["token_hash"] for b, p in run.parts.items()} != reference:
            raise StoreError(
                f"checkpoint {run.checkpoint!r} was traced on other tokens than {runs[-1].checkpoint!r}: a "
                "timeline needs one fixed token set (same corpus, chunking and batch size)"
            )
    names = [r.checkpoint for r in runs]
    order = {name: i for i, name in enumerate(names)}
    t = thresholds or CollapseThresholds()

    def ordered(frame: pd.DataFrame, extra: list[str]) -> pd.DataFrame:
        frame = frame.copy()
        frame.insert(1, "order", frame["checkpoint"].map(order).astype(int))
        return frame.sort_values(["order", "site", "layer", *extra], kind="stable").reset_index(drop=True)

    final = names[-1]
    saturation = query.sql(
        """
        WITH f AS (SELECT seq, pos, site, layer, expert, rank FROM rows WHERE checkpoint = $final),
        per_token AS (
            SELECT c.checkpoint, c.seq, c.pos, c.site, c.layer,
                   count(*) FILTER (WHERE c.expert >= 0) AS n_c,
                   max(CASE WHEN c.rank = 0 THEN c.expert END) AS top1_c
            FROM rows c GROUP BY ALL),
        fin AS (
            SELECT seq, pos, site, layer, count(*) FILTER (WHERE expert >= 0) AS n_f,
                   max(CASE WHEN rank = 0 THEN expert END) AS top1_f
            FROM f GROUP BY ALL),
        inter AS (
            SELECT c.checkpoint, c.seq, c.pos, c.site, c.layer, count(*) AS n_i
            FROM rows c JOIN f USING (seq, pos, site, layer, expert) WHERE c.expert >= 0 GROUP BY ALL)
        SELECT p.checkpoint, p.site, p.layer, count(*) AS tokens,
               avg(CASE WHEN fin.n_f > 0 THEN coalesce(inter.n_i, 0) / fin.n_f
                        ELSE CAST(p.n_c = 0 AS DOUBLE) END) AS saturation_topk,
               avg(CAST(p.top1_c = fin.top1_f AS DOUBLE)) AS saturation_top1
        FROM per_token p JOIN fin USING (seq, pos, site, layer)
        LEFT JOIN inter USING (checkpoint, seq, pos, site, layer)
        GROUP BY ALL
        """,
        {"final": final},
    )
    collapse = query.collapse(t).drop(columns="model")
    drift = _drift(query, names)
    spec = query.domain_specialisation()
    spec = spec.sort_values(
        ["checkpoint", "site", "layer", "domain", "ds", "expert"], ascending=[*[True] * 4, False, True]
    )
    spec = spec.drop_duplicates(["checkpoint", "site", "layer", "domain"]).rename(
        columns={"expert": "top_expert"}
    )
    spec = spec[["checkpoint", "site", "layer", "domain", "tokens", "top_expert", "ds", "baseline", "lift"]]
    collapse_o = ordered(collapse, [])
    return CheckpointTimeline(
        model=models[0],
        checkpoints=names,
        saturation=ordered(saturation, []),
        collapse=collapse_o,
        drift=ordered(drift, ["expert"]) if len(drift) else drift,
        specialisation=ordered(spec, ["domain"]),
        crossings=_crossings(collapse_o, query, t),
    )


def _drift(query: StoreQuery, names: list[str]) -> pd.DataFrame:
    """Per (checkpoint, site, layer, expert), against the previous checkpoint: load_prev, load, kept
    (tokens routed to the expert in both), jaccard and drift = 1 − jaccard (NaN: no token in either)."""
    pairs = pd.DataFrame({"checkpoint": names[1:], "prev": names[:-1]})
    query.con.register("pairs", pairs)
    loads = query.sql(
        "SELECT checkpoint, site, layer, expert, count(*) AS n FROM rows WHERE expert >= 0 GROUP BY ALL"
    )
    kept = query.sql(
        """
        WITH d AS (SELECT checkpoint, seq, pos, site, layer, expert FROM rows WHERE expert >= 0)
        SELECT pairs.checkpoint, b.site, b.layer, b.expert, count(*) AS kept
        FROM pairs JOIN d a ON a.checkpoint = pairs.prev
        JOIN d b ON b.checkpoint = pairs.checkpoint AND a.seq = b.seq AND a.pos = b.pos
             AND a.site = b.site AND a.layer = b.layer AND a.expert = b.expert
        GROUP BY ALL
        """
    )
    meta = query.layer_meta()
    # each frame split once, not filtered again for every (checkpoint, site, layer)
    by_layer = {(site, int(layer)): g for (site, layer), g in loads.groupby(["site", "layer"], sort=False)}
    kept_by = {
        (c, site, int(layer)): g.set_index("expert")["kept"]
        for (c, site, layer), g in kept.groupby(["checkpoint", "site", "layer"], sort=False)
    }
    nothing_kept = pd.Series(dtype=np.int64)
    parts = []
    for cur, prev in zip(names[1:], names[:-1], strict=True):
        for (site, layer), _ in loads[loads["checkpoint"] == cur].groupby(["site", "layer"]):
            info = meta.get((query.runs[0].model, cur, site, int(layer)))
            here = by_layer[(site, int(layer))]
            e = int(info["num_experts"]) if info else int(here["expert"].max()) + 1
            grid = pd.DataFrame(
                {"checkpoint": cur, "site": site, "layer": int(layer), "expert": np.arange(e)}
            )
            for label, name in (("load_prev", prev), ("load", cur)):
                counts = here[here["checkpoint"] == name].set_index("expert")["n"]
                grid[label] = grid["expert"].map(counts).fillna(0).astype(np.int64)
            k = kept_by.get((cur, site, int(layer)), nothing_kept)
            grid["kept"] = grid["expert"].map(k).fillna(0).astype(np.int64)
            parts.append(grid)
    if not parts:
        return pd.DataFrame()
    frame = pd.concat(parts, ignore_index=True)
    union = frame["load_prev"] + frame["load"] - frame["kept"]
    frame["jaccard"] = np.where(union > 0, frame["kept"] / union.where(union > 0, 1), np.nan)
    frame["drift"] = 1.0 - frame["jaccard"]
    return frame


def _crossings(collapse: pd.DataFrame, query: StoreQuery, t: CollapseThresholds) -> pd.DataFrame:
    meta = query.layer_meta()
    rows = []
    for (site, layer), group in collapse.groupby(["site", "layer"], sort=True):
        group = group.sort_values("order")
        e = next((int(v["num_experts"]) for k, v in meta.items() if k[2:] == (site, layer)), 0)
        score_fn = next((v.get("score_fn") for k, v in meta.items() if k[2:] == (site, layer)), None)
        # sigmoid routers are not trained with a z-loss: no threshold of theirs
        z_levels = [("warning", t.z_loss_threshold(e) if e else np.nan)] if judges_z_loss(score_fn) else []
        levels = {
            "max_share": [
                ("warning", t.warning_share_factor / e if e else np.nan),
                ("collapsed", max(t.collapsed_max_share, t.warning_share_factor / e) if e else np.nan),
            ],
            "z_loss": z_levels,
        }
        for indicator, (direction, warn, collapsed) in INDICATORS.items():
            pairs = levels.get(indicator) or [
                (level, getattr(t, field))
                for level, field in (("warning", warn), ("collapsed", collapsed))
                if field
            ]
            values = group[indicator].to_numpy(dtype=float)
            for level, threshold in pairs:
                hit = {">": values > threshold, ">=": values >= threshold, "<": values < threshold}[direction]
                first = int(np.argmax(hit)) if hit.any() else None
                rows.append(
                    {
                        "site": site,
                        "layer": int(layer),
                        "indicator": indicator,
                        "level": level,
                        "threshold": float(threshold),
                        "first_checkpoint": None if first is None else group["checkpoint"].iloc[first],
                        "value": None if first is None else float(values[first]),
                    }
                )
    for (site, layer), group in collapse.groupby(["site", "layer"], sort=True):
        group = group.sort_values("order")
        for level in ("warning", "collapsed"):
            rank = {"healthy": 0, "warning": 1, "collapsed": 2}
            hit = group["verdict"].map(rank).to_numpy() >= rank[level]
            first = int(np.argmax(hit)) if hit.any() else None
            rows.append(
                {
                    "site": site,
                    "layer": int(layer),
                    "indicator": "verdict",
                    "level": level,
                    "threshold": float("nan"),
                    "first_checkpoint": None if first is None else group["checkpoint"].iloc[first],
                    "value": None,
                }
            )
    return pd.DataFrame(rows)


def render_timeline(timeline: CheckpointTimeline) -> str:
    """Plain-text report: one table per topic, checkpoints as rows and layers as columns."""

    def pivot(frame: pd.DataFrame, value: str, fmt: str) -> list[str]:
        table = frame.pivot_table(index="order", columns="layer", values=value, aggfunc="first")
        labels = dict(zip(frame["order"], frame["checkpoint"], strict=False))
        width = max(len(c) for c in timeline.checkpoints)
        head = f"{'checkpoint':<{width}} " + " ".join(f"{'L' + str(c):>8}" for c in table.columns)
        lines = [head]
        for order_, row in table.iterrows():
            cells = " ".join(f"{v:>8{fmt}}" if isinstance(v, (int, float)) else f"{v!s:>8}" for v in row)
            lines.append(f"{labels[order_]:<{width}} {cells}")
        return lines

    out = [
        f"checkpoint timeline of {timeline.model}: {len(timeline.checkpoints)} checkpoints "
        f"({timeline.checkpoints[0]} … {timeline.checkpoints[-1]}), final = {timeline.checkpoints[-1]}"
    ]
    sections = [
        ("router saturation vs final (top-k overlap / k)", timeline.saturation, "saturation_topk", ".3f"),
        ("router saturation vs final (top-1 agreement)", timeline.saturation, "saturation_top1", ".3f"),
        ("normalised load entropy", timeline.collapse, "load_entropy", ".3f"),
        ("max share", timeline.collapse, "max_share", ".3f"),
        ("dead fraction", timeline.collapse, "dead_fraction", ".3f"),
        ("verdict", timeline.collapse, "verdict", ""),
    ]
    if len(timeline.drift):
        mean_drift = timeline.drift.groupby(["checkpoint", "order", "layer"], as_index=False)["drift"].mean()
        sections.append(
            ("expert drift from the previous checkpoint (mean over experts)", mean_drift, "drift", ".3f")
        )
    spec = timeline.specialisation.groupby(["checkpoint", "order", "layer"], as_index=False)["lift"].mean()
    sections.append(
        ("domain specialisation: mean over domains of max_e DS(e, D) / (k/E)", spec, "lift", ".2f")
    )
    for title, frame, value, fmt in sections:
        out += ["", title, *pivot(frame, value, fmt)]
    out += ["", "first checkpoint past a collapse threshold"]
    crossed = timeline.crossings[timeline.crossings["first_checkpoint"].notna()]
    if crossed.empty:
        out.append("  none: no indicator crossed a threshold at any checkpoint")
    for row in crossed.itertuples(index=False):
        value = (
            "" if row.value is None or pd.isna(row.value) else f" ({row.value:.3f} vs {row.threshold:.3g})"
        )
        out.append(f"  layer {row.layer} {row.indicator} {row.level}: {row.first_checkpoint}{value}")
    return "\n".join(out)
