"""Checkpoint timelines: a series of checkpoints traced on one fixed token set, compared in the store.

Per layer and checkpoint c (ordered as given, the last = final):
- router saturation against the final (OLMoE): Sat_ℓ(c) = mean_t |S^c_t ∩ S^final_t| / |S^final_t| and the
  top-1 variant (as `moeviz.analysis.routing_agreement_frame`);
- balance and collapse indicators and the verdict (as `StoreQuery.collapse`);
- expert drift from the previous checkpoint: per expert 1 − |T^prev_e ∩ T^c_e| / |T^prev_e ∪ T^c_e|;
- per-domain specialisation: max_e DS(e, D) and its expert;
- the first checkpoint at which each collapse indicator crossed its warning / collapsed threshold.

A series is full checkpoints (folders with config.json) or the PEFT adapters a fine-tune saved every N steps
(folders with adapter_config.json), each merged into one base model; the base alone is then step 0.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moeviz.analysis.collapse import CollapseThresholds, judges_z_loss
from moeviz.errors import CheckpointSeriesError, InputError
from moeviz.store.layout import StoreError, slug
from moeviz.store.query import StoreQuery
from moeviz.store.writer import TraceSettings

ADAPTER_CONFIG = "adapter_config.json"  # what peft's `save_pretrained` writes (moeviz.models.adapters)
ADAPTER_CONFIG_LIMIT = 1 << 20  # bytes: an adapter config is a few KB
BASE_LABEL = "base"  # an adapter series' step 0: the base model alone, before any fine-tuning


def _natural(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _step(name: str) -> int | None:
    """The training step a checkpoint folder's name gives: its last number (`checkpoint-500` → 500,
    `step-00100` → 100); None when it has none."""
    numbers = re.findall(r"\d+", name)
    return int(numbers[-1]) if numbers else None


def _is_adapter(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file()


def _is_model(folder: Path) -> bool:
    return (folder / "config.json").is_file() and not _is_adapter(folder)


@dataclass(frozen=True)
class Series:
    """A checkpoint series resolved: its label, its checkpoints in training order as (label, folder), and,
    for a series of adapters, the base model folder every adapter is merged into (None: full checkpoints).
    In an adapter series each folder is an adapter, except the base's own step 0 (label `BASE_LABEL`)."""

    name: str
    checkpoints: list[tuple[str, Path]]
    base: Path | None = None

    @property
    def adapters(self) -> bool:
        return self.base is not None

    def load_args(self, folder: Path) -> dict[str, Any]:
        """The `moeviz.load_model` arguments of one checkpoint: {"source": folder} for a full checkpoint
        (and the base's step 0), {"source": base, "adapter": folder} for an adapter."""
        if self.base is not None and _is_adapter(folder):
            return {"source": self.base, "adapter": folder}
        return {"source": folder}


def plan_series(
    spec: str | Path | Sequence[str | Path], base: str | Path | None = None, *, with_base: bool = True
) -> Series:
    """Resolve a series (see `resolve_series`): full checkpoints, or PEFT adapters over one base."""
    if isinstance(spec, Path) or (isinstance(spec, str) and "," not in spec):  # a Path is one folder
        folder = Path(spec)
        if not folder.is_dir():
            raise InputError(f"checkpoint series {folder} is not a folder")
        if _is_model(folder):
            raise InputError(
                f"{folder} is one model, not a series: give a folder of checkpoint folders or A,B,C"
            )
        children = [p for p in folder.iterdir() if p.is_dir()]
        models = [p for p in children if _is_model(p)]
        adapters = [p for p in children if _is_adapter(p)]
        if adapters:
            if models:
                raise CheckpointSeriesError(
                    f"{folder} holds full checkpoints ({models[0].name}, …) and adapters "
                    f"({adapters[0].name}, …): a series is one or the other; give the folders of one kind"
                )
            return _adapter_series(slug(folder.name), adapters, base, with_base, ordered=False)
        if _is_adapter(folder):
            raise InputError(f"{folder} is one adapter, not a series: give a folder of adapter checkpoints")
        _no_base(folder, base)
        children = sorted(models, key=lambda p: _natural(p.name))
        if len(children) < 2:
            raise InputError(
                f"{folder} holds {len(children)} checkpoint folder(s) (with config.json); need ≥ 2"
            )
        return Series(slug(folder.name), [(slug(p.name), p) for p in children])
    items = [Path(s.strip()) for s in spec.split(",") if s.strip()] if isinstance(spec, str) else list(spec)
    folders = [Path(p) for p in items]
    parents = {p.resolve().parent.name for p in folders}
    name = slug(parents.pop()) if len(parents) == 1 else "series"
    adapters = [p for p in folders if _is_adapter(p)]
    if adapters:
        models = [p for p in folders if not _is_adapter(p)]
        if models:
            raise CheckpointSeriesError(
                f"the series mixes adapters ({adapters[0]}) with checkpoints that are not ({models[0]}): "
                "a series is all full checkpoints or all adapters of one base"
            )
        return _adapter_series(name, folders, base, with_base, ordered=True)
    if len(folders) < 2:
        raise InputError(f"a checkpoint series needs at least 2 checkpoints, got {len(folders)}")
    for path in folders:
        if not (path / "config.json").is_file():
            raise InputError(f"checkpoint {path} is not a model folder (no config.json)")
    _no_base(folders[0].parent, base)
    return Series(name, list(zip(_labels(folders), folders, strict=True)))


def _labels(folders: list[Path]) -> list[str]:
    labels = [slug(p.name) for p in folders]
    if len(set(labels)) != len(labels):
        labels = [f"{i:03d}-{label}" for i, label in enumerate(labels)]
    return labels


def _no_base(where: Path, base: str | Path | None) -> None:
    if base is not None:
        raise CheckpointSeriesError(
            f"{where} holds full checkpoints, not adapters: a base model applies only to a series of adapters"
        )


def _adapter_series(
    name: str, adapters: list[Path], base: str | Path | None, with_base: bool, *, ordered: bool
) -> Series:
    """An adapter series: in the given order (`ordered`) or by the step number in each folder's name."""
    if not ordered:
        unnumbered = [p.name for p in adapters if _step(p.name) is None]
        if unnumbered:
            raise CheckpointSeriesError(
                f"adapter folder {unnumbered[0]!r} has no step number in its name (checkpoint-500, "
                "step-00100): its place in training is unknown; give the adapters in order as A,B,C"
            )
        adapters = sorted(adapters, key=lambda p: (_step(p.name), _natural(p.name)))
    first: dict[str, Path] = {}  # each declared base → the first adapter declaring it
    for adapter in adapters:
        first.setdefault(_declared_base(adapter), adapter)
    first.pop("", None)
    if len(first) > 1:
        (da, a), (db, b) = list(first.items())[:2]
        raise CheckpointSeriesError(
            f"the adapters are of different bases ({a.name}: {da!r}, {b.name}: {db!r}): a series is one "
            "fine-tune of one base"
        )
    folder = _base_folder(base, next(iter(first), ""), adapters[0].parent)
    labels = _labels(adapters)
    if with_base and BASE_LABEL in labels:
        raise CheckpointSeriesError(
            f"an adapter folder is named {BASE_LABEL!r}, the label of the base's own step 0: rename it"
        )
    checkpoints = [*([(BASE_LABEL, folder)] if with_base else []), *zip(labels, adapters, strict=True)]
    if len(checkpoints) < 2:
        raise InputError(f"a checkpoint series needs at least 2 checkpoints, got {len(checkpoints)}")
    return Series(name, checkpoints, base=folder)


def _declared_base(adapter: Path) -> str:
    """The base an adapter's config names (`base_model_name_or_path`), "" when none."""
    path = adapter / ADAPTER_CONFIG
    try:
        if path.stat().st_size > ADAPTER_CONFIG_LIMIT:
            raise CheckpointSeriesError(f"adapter {adapter}: {ADAPTER_CONFIG} is too large to be a config")
        config = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        raise CheckpointSeriesError(f"adapter {adapter}: {ADAPTER_CONFIG} is not readable JSON") from None
    value = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return value if isinstance(value, str) else ""


def _base_folder(base: str | Path | None, declared: str, where: Path) -> Path:
    """The base model folder: `base` (a folder or `sample:NAME`), else the one the adapters declare if it is
    a model folder here."""
    from moeviz.models.loading import resolve_source

    if base is None:
        candidate = Path(declared).expanduser() if declared else None
        if candidate is None or not (candidate / "config.json").is_file():
            named = f"base {declared!r}, not a model folder here" if declared else "no base"
            raise CheckpointSeriesError(
                f"the adapters in {where} declare {named}: give the base model (base=, --base)"
            )
        return candidate
    folder = resolve_source(base)
    if not _is_model(folder):
        raise CheckpointSeriesError(f"base {base} is not a model folder (no config.json, or an adapter)")
    return folder


def adapter_series_base(spec: str | Path | Sequence[str | Path]) -> str | None:
    """None when `spec` is not a series of adapters (full checkpoints, or nothing readable: `resolve_series`
    says what is wrong); else the base its first adapter declares ("" when none), to offer as the base."""
    if isinstance(spec, Path) or (isinstance(spec, str) and "," not in spec):  # a Path is one folder
        folder = Path(spec)
        parts = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    else:
        parts = (
            [Path(p.strip()) for p in spec.split(",")] if isinstance(spec, str) else [Path(p) for p in spec]
        )
    adapter = next((p for p in parts if _is_adapter(p)), None)
    return None if adapter is None else _declared_base(adapter)


def resolve_series(
    spec: str | Path | Sequence[str | Path], base: str | Path | None = None, *, with_base: bool = True
) -> tuple[str, list[tuple[str, Path]]]:
    """(series label, [(checkpoint label, folder)] in training order) from a folder of checkpoint folders
    (sorted by name, numbers compared as numbers) or a list of folders (comma-separated or a sequence).

    The checkpoints are full models (each folder with config.json) or PEFT LoRA adapters (each with
    adapter_config.json, as a Trainer saves `checkpoint-<step>/` every N steps), never both. Adapters are
    ordered by the step number in their folder names (given as A,B,C: as given) and merged into one base:
    `base` (a folder or `sample:NAME`), else the `base_model_name_or_path` they all declare, if that is a
    model folder here. The base alone is step 0, labelled `BASE_LABEL` ("base"), unless not `with_base`.
    `plan_series` gives the base too (`Series.load_args`: what to load for each checkpoint)."""
    series = plan_series(spec, base, with_base=with_base)
    return series.name, series.checkpoints


def write_series(
    spec: str | Path | Sequence[str | Path],
    corpus: str | Path,
    store: str | Path,
    *,
    model: str | None = None,
    settings: TraceSettings | None = None,
    resume: bool = False,
    progress: bool = True,
    base: str | Path | None = None,
    **load_options: Any,
) -> tuple[str, list[str]]:
    """Trace every checkpoint of a series on the same corpus plan into `store`; returns (model label,
    checkpoint labels in order). Each checkpoint is loaded (`moeviz.load_model(folder, **load_options)`:
    dtype, device, device_map, ...; an adapter as `load_model(base, adapter=folder)`, so its run records
    the adapter), traced and released in turn. `base`: the base model of a series of adapters
    (`resolve_series`)."""
    import gc

    from moeviz.models import load_model
    from moeviz.store.writer import write_corpus

    series = plan_series(spec, base)
    name = model or series.name
    for index, (label, folder) in enumerate(series.checkpoints):
        loaded = load_model(**series.load_args(folder), **load_options)
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
    return name, [label for label, _ in series.checkpoints]


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
