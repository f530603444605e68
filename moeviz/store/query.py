"""DuckDB queries over a store: aggregates computed where the data lies, never the whole store in memory.

Every query reads only the part files listed in the manifests of the selected runs (validated first:
foreign or corrupt files raise `StoreError`; the selected runs' parts are always checked by size and
sha256, even with `validate=False`, each hashed once per process while unchanged — see
`moeviz.store.layout`), filtered by model, checkpoint, domain and layer. Results are
small frames (per layer × expert, per token id, ...); the metrics are the in-memory analysis functions'
definitions (docs/routing-metrics.md), and tests check they agree exactly on the same traces.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moeviz.analysis.balance import (
    BALANCE_COLUMNS,
    EXPERT_BALANCE_COLUMNS,
    balance_from_counts,
    balance_record,
    expert_balance_rows,
)
from moeviz.analysis.collapse import CollapseThresholds, LayerVerdict, judge_layer
from moeviz.analysis.losses import bias_stats
from moeviz.store.layout import RunInfo, StoreError, check_part, list_runs, validate_store

RUN_KEYS = ["model", "checkpoint"]
# the balance indicators `collapse` reports next to the verdict
COLLAPSE_INDICATORS = ["max_share", "dead_fraction", "load_entropy", "z_loss"]


def _as_list(value: str | int | Sequence | None) -> list | None:
    if value is None:
        return None
    return [value] if isinstance(value, (str, int)) else list(value)


class StoreQuery:
    """A filtered view of a store. `model`, `checkpoint`, `domain`, `layer`: one value or a list each.

    `validate=True` checks every Parquet file under the store first (see `validate_store`). Either way the
    parts of the selected runs must be regular files of the recorded size and sha256 (hashed on the first
    open in this process; a part whose manifest entry has no hash is checked by size only)."""

    def __init__(
        self,
        store: str | Path,
        *,
        model: str | Sequence[str] | None = None,
        checkpoint: str | Sequence[str] | None = None,
        domain: str | Sequence[str] | None = None,
        layer: int | Sequence[int] | None = None,
        validate: bool = True,
        threads: int | None = None,
    ) -> None:
        import duckdb

        self.root = Path(store)
        runs = list_runs(self.root)
        if validate:
            problems = validate_store(self.root)
            if problems:
                listing = "\n  ".join(problems[:20])
                more = f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else ""
                raise StoreError(f"store {self.root} holds files that cannot be trusted:\n  {listing}{more}")
        models, checkpoints = _as_list(model), _as_list(checkpoint)
        self.runs: list[RunInfo] = [
            r
            for r in runs
            if (models is None or r.model in models) and (checkpoints is None or r.checkpoint in checkpoints)
        ]
        if not self.runs:
            have = ", ".join(f"{r.model}/{r.checkpoint}" for r in runs) or "nothing"
            raise StoreError(
                f"no run in {self.root} matches model={model!r} checkpoint={checkpoint!r} (has {have})"
            )
        damaged = [
            f"{r.path.relative_to(self.root)}/{problem}"
            for r in self.runs
            for entry in r.parts.values()
            if (problem := check_part(r.path, entry, cached=True)) is not None
        ]
        if damaged:
            listing = "\n  ".join(damaged[:20])
            more = f"\n  … and {len(damaged) - 20} more" if len(damaged) > 20 else ""
            raise StoreError(f"store {self.root} holds parts that cannot be trusted:\n  {listing}{more}")
        self.files = [str(f) for r in self.runs for f in r.files]
        if not self.files:
            raise StoreError(f"the selected runs in {self.root} hold no completed batch yet")
        self.con = duckdb.connect()
        if threads:
            self.con.execute(f"SET threads = {int(threads)}")
        listing = ", ".join("'" + f.replace("'", "''") + "'" for f in self.files)
        self.con.execute(f"CREATE VIEW raw AS SELECT * FROM read_parquet([{listing}], union_by_name = true)")
        where, self.params = [], {}
        for name, values in (("domain", _as_list(domain)), ("layer", _as_list(layer))):
            if values is not None:
                where.append(f"{name} IN (SELECT unnest(${name}))")
                self.params[name] = values
        if models is not None:
            where.append("model IN (SELECT unnest($models))")
            self.params["models"] = models
        if checkpoints is not None:
            where.append("checkpoint IN (SELECT unnest($checkpoints))")
            self.params["checkpoints"] = checkpoints
        self.where = " AND ".join(where) or "TRUE"

    # ---- plumbing -------------------------------------------------------------------------------------
    def sql(self, query: str, params: dict[str, Any] | None = None) -> pd.DataFrame:
        """Run SQL over the view `rows` (the filtered store; columns: moeviz.store.schema)."""
        head = f"WITH rows AS (SELECT * FROM raw WHERE {self.where})"
        body = query.strip()
        text = f"{head}, {body[4:]}" if body[:4].upper() == "WITH" else f"{head} {body}"
        return self.con.execute(text, {**self.params, **(params or {})}).df()

    def layer_meta(self) -> dict[tuple[str, str, str, int], dict[str, Any]]:
        """{(model, checkpoint, site, layer): {num_experts, k, bias, ...}} from the runs' run.json."""
        meta = {}
        for run in self.runs:
            for info in run.config.get("layers") or []:
                meta[(run.model, run.checkpoint, info["site"], int(info["layer"]))] = info
        return meta

    # ---- load and balance ------------------------------------------------------------------------------
    @staticmethod
    def _num_experts(info: dict[str, Any] | None, per_expert: pd.DataFrame) -> int:
        if info is not None:
            return int(info["num_experts"])
        return int(per_expert["expert"].max()) + 1 if len(per_expert) else 0

    def _layer_counts(self) -> list[tuple[Any, tuple[str, str, str, int], np.ndarray]]:
        """Per (model, checkpoint, site, layer): (its row — tokens, dropped, top_k, z_loss —, the key,
        tokens per expert [E] with the experts that got no token included)."""
        per_expert = self.sql(
            "SELECT model, checkpoint, site, layer, expert, count(*) AS count FROM rows WHERE expert >= 0 "
            "GROUP BY ALL"
        )
        per_layer = self.sql(
            "SELECT model, checkpoint, site, layer, count(*) FILTER (WHERE rank = 0) AS tokens, "
            "count(*) FILTER (WHERE expert < 0) AS dropped, max(rank) + 1 AS top_k, "
            "avg(CAST(lse AS DOUBLE) * lse) FILTER (WHERE rank = 0) AS z_loss FROM rows GROUP BY ALL"
        )
        groups = {
            (model, checkpoint, site, int(layer)): group
            for (model, checkpoint, site, layer), group in per_expert.groupby(
                [*RUN_KEYS, "site", "layer"], sort=False
            )
        }
        meta = self.layer_meta()
        out = []
        for row in per_layer.itertuples(index=False):
            key = (row.model, row.checkpoint, row.site, int(row.layer))
            sel = groups.get(key, per_expert.iloc[:0])
            counts = np.zeros(self._num_experts(meta.get(key), sel), np.int64)
            counts[sel["expert"].to_numpy()] = sel["count"].to_numpy()
            out.append((row, key, counts))
        return out

    def expert_balance(self, devices: int | None = None) -> pd.DataFrame:
        """Per (model, checkpoint, site, layer, expert): EXPERT_BALANCE_COLUMNS as `expert_balance_frame`
        (count, share f = c/(kT) with dropped slots in kT, utilisation, dead, device), experts with no
        token included. A layer's dropped slots are in `balance()` (dropped, dropped_fraction)."""
        parts = []
        for record, stats in self._balance_records(devices):
            rows = expert_balance_rows(record["layer"], record["site"], stats)
            parts.append(rows.assign(model=record["model"], checkpoint=record["checkpoint"]))
        if not parts:
            return pd.DataFrame(columns=[*RUN_KEYS, *EXPERT_BALANCE_COLUMNS])
        frame = pd.concat(parts, ignore_index=True)[[*RUN_KEYS, *EXPERT_BALANCE_COLUMNS]]
        return _sorted(frame, ["expert"])

    def balance(self, devices: int | None = None) -> pd.DataFrame:
        """Per (model, checkpoint, site, layer): every balance indicator (BALANCE_COLUMNS, as
        `balance_frame`) plus z_loss (mean squared router logsumexp)."""
        records = [record for record, _ in self._balance_records(devices)]
        return _sorted(pd.DataFrame(records), [])[[*RUN_KEYS, *BALANCE_COLUMNS, "z_loss"]]

    def _balance_records(self, devices: int | None = None) -> list[tuple[dict[str, Any], Any]]:
        meta = self.layer_meta()
        rows = []
        for row, key, counts in self._layer_counts():
            k = int(meta.get(key, {}).get("k", row.top_k))
            stats = balance_from_counts(counts, int(row.tokens), k, int(row.dropped), devices)
            record = {"model": row.model, "checkpoint": row.checkpoint}
            record |= balance_record(int(row.layer), row.site, stats)
            rows.append(({**record, "z_loss": float(row.z_loss)}, stats))
        return rows

    def collapse(self, thresholds: CollapseThresholds | None = None) -> pd.DataFrame:
        """Per (model, checkpoint, site, layer): verdict and reasons by `judge_layer` on the store's
        balance, z-loss and recorded bias; plus the indicators the thresholds look at."""
        meta = self.layer_meta()
        # The same sample-size rule as `collapse_report`: tokens of one sequence are correlated, and the
        # level is shared by the layers of one (model, checkpoint).
        lengths = self.sql(
            "SELECT model, checkpoint, site, layer, seq, count(*) AS n FROM rows WHERE rank = 0 GROUP BY ALL"
        )
        seq_lengths = {
            (model, checkpoint, site, int(layer)): group["n"].to_numpy()
            for (model, checkpoint, site, layer), group in lengths.groupby([*RUN_KEYS, "site", "layer"])
        }
        records = self._balance_records()
        layers_per_run = pd.Series([(r["model"], r["checkpoint"]) for r, _ in records]).value_counts()
        rows = []
        for record, stats in records:
            key = (record["model"], record["checkpoint"], record["site"], record["layer"])
            bias = meta.get(key, {}).get("bias")
            verdict: LayerVerdict = judge_layer(
                record["layer"],
                record["site"],
                stats,
                record["z_loss"],
                bias_stats(None if bias is None else np.asarray(bias, np.float32)),
                thresholds,
                layers=int(layers_per_run[(record["model"], record["checkpoint"])]),
                sequence_lengths=seq_lengths.get(key, []),
                score_fn=meta.get(key, {}).get("score_fn"),
            )
            rows.append(
                {
                    **{name: record[name] for name in (*RUN_KEYS, "layer", "site")},
                    "verdict": str(verdict.verdict),
                    "reasons": "; ".join(verdict.reasons),
                    **{name: record[name] for name in COLLAPSE_INDICATORS},
                }
            )
        return _sorted(pd.DataFrame(rows), [])

    # ---- specialisation --------------------------------------------------------------------------------
    def domain_specialisation(self) -> pd.DataFrame:
        """DS(e, D) = #{t ∈ D : e ∈ S_t} / #{t ∈ D} per (model, checkpoint, site, layer, domain, expert):
        tokens, dispatched, ds, baseline (k/E), lift — as `expert_domain_specialisation(...).experts`
        without the shuffle null (which needs token-level permutations)."""
        sizes = self.sql(
            "SELECT model, checkpoint, site, layer, domain, count(*) AS tokens FROM rows WHERE rank = 0 "
            "GROUP BY ALL"
        )
        hits = self.sql(
            "SELECT model, checkpoint, site, layer, domain, expert, count(*) AS dispatched FROM rows "
            "WHERE expert >= 0 GROUP BY ALL"
        )
        meta = self.layer_meta()
        keys = [*RUN_KEYS, "site", "layer"]
        parts = []
        for key, group in sizes.groupby(keys, sort=True):
            e = self._num_experts(meta.get(tuple(key)), hits.iloc[:0])
            k = int(meta.get(tuple(key), {}).get("k", 1))
            grid = pd.MultiIndex.from_product(
                [sorted(group["domain"]), range(e)], names=["domain", "expert"]
            ).to_frame(index=False)
            for name, value in zip(keys, key, strict=True):
                grid[name] = value
            frame = grid.merge(group, on=[*keys, "domain"]).merge(
                hits, on=[*keys, "domain", "expert"], how="left"
            )
            frame["dispatched"] = frame["dispatched"].fillna(0).astype(np.int64)
            frame["ds"] = frame["dispatched"] / frame["tokens"]
            frame["baseline"] = k / e
            frame["lift"] = frame["ds"] / frame["baseline"]
            parts.append(frame)
        columns = [*keys, "domain", "expert", "tokens", "dispatched", "ds", "baseline", "lift"]
        return _sorted(pd.concat(parts, ignore_index=True)[columns], ["domain", "expert"])

    def token_specialisation(self, min_count: int = 10) -> pd.DataFrame:
        """Per (model, checkpoint, site, layer, token_id) with ≥ min_count routed occurrences: occurrences,
        top_expert (most frequent top-1 expert; ties → lowest id) and share (of occurrences with that
        top-1) — as `vocabulary_token_frame(trace, "input")`."""
        counts = self.sql(
            "SELECT model, checkpoint, site, layer, token_id, expert, count(*) AS n FROM rows "
            "WHERE rank = 0 AND expert >= 0 GROUP BY ALL"
        )
        keys = [*RUN_KEYS, "site", "layer", "token_id"]
        occ = counts.groupby(keys)["n"].transform("sum")
        counts = counts[occ >= min_count].assign(occurrences=occ[occ >= min_count])
        counts = counts.sort_values([*keys, "n", "expert"], ascending=[True] * len(keys) + [False, True])
        top = counts.drop_duplicates(keys).rename(columns={"expert": "top_expert"})
        top["share"] = top["n"] / top["occurrences"]
        return _sorted(
            top[[*keys, "occurrences", "top_expert", "share"]].reset_index(drop=True), ["token_id"]
        )

    def vocabulary_specialisation(self, min_count: int = 10) -> pd.DataFrame:
        """Per (model, checkpoint, site, layer): token_ids, occurrences, specialisation (mean over ids of
        the top-1 share) and specialisation_weighted — `vocabulary_specialisation_frame`'s "input" key."""
        tokens = self.token_specialisation(min_count)
        tokens["top"] = tokens["share"] * tokens["occurrences"]
        out = tokens.groupby([*RUN_KEYS, "site", "layer"], as_index=False).agg(
            token_ids=("token_id", "size"),
            occurrences=("occurrences", "sum"),
            specialisation=("share", "mean"),
            top=("top", "sum"),
        )
        out["specialisation_weighted"] = out["top"] / out["occurrences"]
        return _sorted(out.drop(columns="top"), [])

    def summary(self) -> pd.DataFrame:
        """Per run: model, checkpoint, complete, batches, tokens, rows, bytes on disk."""
        return pd.DataFrame(
            [
                {
                    "model": r.model,
                    "checkpoint": r.checkpoint,
                    "complete": r.complete,
                    "batches": len(r.parts),
                    "tokens": r.tokens,
                    "rows": r.rows,
                    "bytes": sum(int(p["bytes"]) for p in r.parts.values()),
                }
                for r in self.runs
            ]
        )


def _sorted(frame: pd.DataFrame, extra: list[str]) -> pd.DataFrame:
    if frame.empty:
        return frame
    return frame.sort_values([*RUN_KEYS, "site", "layer", *extra], kind="stable").reset_index(drop=True)
