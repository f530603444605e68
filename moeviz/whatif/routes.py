"""The routing the deployment simulators replay: per MoE layer, each token's dispatched experts in order.

One shape for every source (a Trace from `capture`, with or without `generate`; a corpus store), so the
simulators never care where the routing came from. Rows are sorted by (seq, pos): `seq` is the sequence id
(the Trace's `seq`), the order a server would decode it in.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from moeviz.errors import InputError
from moeviz.trace import Trace


@dataclass(frozen=True)
class LayerRoutes:
    """One MoE layer's routing. N = routed tokens, k = slots, E = experts.

    - experts [N, k] int64: dispatched experts by descending weight; -1 = a slot the model's capacity dropped
    - weights [N, k] float32: combination weights (0 for a dropped slot)
    - seq [N] int64: sequence id (each sequence is decoded on its own); rows sorted by (seq, pos)
    - pos [N] int64: position within the sequence
    - n_group, topk_group: group-limited routing (DeepSeek-V3 style), None otherwise
    """

    layer: int
    site: str
    experts: np.ndarray
    weights: np.ndarray
    seq: np.ndarray
    pos: np.ndarray
    num_experts: int
    n_group: int | None = None
    topk_group: int | None = None

    def __post_init__(self) -> None:
        n = len(self.seq)
        if self.experts.ndim != 2 or self.experts.shape[0] != n or self.weights.shape != self.experts.shape:
            raise ValueError(
                f"layer {self.layer}: experts {self.experts.shape} / weights {self.weights.shape} "
                f"do not match {n} tokens"
            )
        if self.pos.shape != (n,):
            raise ValueError(f"layer {self.layer}: pos {self.pos.shape} != ({n},)")

    @property
    def k(self) -> int:
        return int(self.experts.shape[1])

    @property
    def tokens(self) -> int:
        return len(self.seq)

    def take(self, rows: np.ndarray) -> LayerRoutes:
        """The same layer restricted to `rows` (a boolean mask or indices), order kept."""
        return replace(
            self,
            experts=self.experts[rows],
            weights=self.weights[rows],
            seq=self.seq[rows],
            pos=self.pos[rows],
        )


@dataclass(frozen=True)
class Routes:
    """Every MoE layer's routing for one model over one input (a prompt, a generation, or a corpus)."""

    model: str
    layers: list[LayerRoutes]
    source: str = "trace"  # "trace" | "store"
    notes: list[str] = field(default_factory=list)
    # `layer L (site)` of the layers whose router scores are not finite: the experts replayed there mean
    # nothing (capture's RoutingWarning; `moeviz.capture.forward.non_finite_warning` words it)
    non_finite: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            raise InputError(f"{self.model}: no MoE layer routed any token; nothing to simulate")

    @property
    def tokens(self) -> int:
        """Tokens routed by the first MoE layer (every layer routes the same tokens in a decoder)."""
        return self.layers[0].tokens

    @property
    def sequences(self) -> int:
        return len(np.unique(self.layers[0].seq))

    def layer(self, layer: int, site: str | None = None) -> LayerRoutes:
        for routes in self.layers:
            if routes.layer == layer and (site is None or routes.site == site):
                return routes
        raise KeyError(f"no MoE layer {layer} in these routes")

    def split(
        self, fit_fraction: float = 0.5, order: str = "shuffled", seed: int = 0
    ) -> tuple[Routes, Routes, str]:
        """(fit, evaluate, how): a part of the routing to fit a placement on, the rest to judge it on.

        With several sequences the split is by sequence (no sequence on both sides); with one it is by
        token. `order` "shuffled" draws the fit part at random (numpy's default_rng(`seed`)): a corpus lists
        its sequences domain by domain, so the first half would fit on some domains and judge on others;
        "ordered" takes the first `fit_fraction` (the past, to judge on the future). `how` names the split,
        for the screen."""
        if not 0.0 < fit_fraction < 1.0:
            raise InputError(f"fit fraction must be in (0, 1), got {fit_fraction}")
        if order not in SPLIT_ORDERS:
            raise InputError(f"unknown split order {order!r}; choose one of {', '.join(SPLIT_ORDERS)}")
        ids = np.unique(self.layers[0].seq)
        by_sequence = len(ids) >= 2
        units = ids if by_sequence else np.unique(self.layers[0].pos)
        if len(units) < 2:
            raise InputError("one token cannot be split into a fit part and an evaluation part")
        fitted = fit_units(units, fit_fraction, order, seed)
        column = "seq" if by_sequence else "pos"
        fit = [r.take(np.isin(getattr(r, column), fitted)) for r in self.layers]
        rest = [r.take(~np.isin(getattr(r, column), fitted)) for r in self.layers]
        what = "sequences" if by_sequence else "tokens of the one sequence"
        how = split_label(len(fitted), len(units), what, order, seed)
        return replace(self, layers=fit), replace(self, layers=rest), how


SPLIT_ORDERS = ("shuffled", "ordered")


def fit_units(units: np.ndarray, fit_fraction: float, order: str, seed: int) -> np.ndarray:
    """The units (sequence ids, positions, steps) of the fit part, ascending: round(n · fraction) of them,
    at least one on each side; drawn by default_rng(seed) or the first ones."""
    cut = max(1, min(len(units) - 1, round(len(units) * fit_fraction)))
    if order == "ordered":
        return np.asarray(units[:cut])
    return np.sort(np.random.default_rng(seed).permutation(units)[:cut])


def split_label(fitted: int, total: int, what: str, order: str, seed: int) -> str:
    """How a fit/evaluate split was drawn, in words: "fitted on 4 of 8 sequences drawn at random (seed 0),
    evaluated on the other 4"."""
    drawn = f"drawn at random (seed {seed})" if order == "shuffled" else "in order (the first ones)"
    return f"fitted on {fitted} of {total} {what} {drawn}, evaluated on the other {total - fitted}"


def routes_from_trace(trace: Trace, site: str | None = None) -> Routes:
    """The trace's routing, rows sorted by (seq, pos). Encoder-decoders: pick `site` ("encoder"/"decoder")
    or get every site's layers (each keeps its own rows)."""
    layers, skipped, non_finite = [], 0, []
    seq_all = trace.tokens["seq"].to_numpy(dtype=np.int64)
    pos_all = trace.tokens["pos"].to_numpy(dtype=np.int64)
    for routing in trace.layers:
        if site is not None and routing.site != site:
            continue
        if routing.has_logits and not np.isfinite(routing.logits).all():  # an import has no logits
            non_finite.append(f"layer {routing.layer} ({routing.site})")
        seq, pos = seq_all[routing.token_rows], pos_all[routing.token_rows]
        order = np.lexsort((pos, seq))
        experts = routing.experts[order].astype(np.int64)
        zero = experts >= routing.routed_experts  # zero-computation experts: no FFN, no transfer, no weights
        skipped += int(zero.sum())
        layers.append(
            LayerRoutes(
                layer=routing.layer,
                site=routing.site,
                experts=np.where(zero, -1, experts),
                weights=np.where(zero, np.float32(0), routing.weights[order].astype(np.float32)),
                seq=seq[order],
                pos=pos[order],
                num_experts=routing.routed_experts,
                n_group=routing.n_group,
                topk_group=routing.topk_group,
            )
        )
    notes = []
    if skipped:
        slots = sum(r.experts.size for r in layers)
        notes.append(
            f"{skipped / slots:.1%} of the expert slots went to zero-computation experts (no FFN, no "
            "transfer): they are left out of the simulation, like slots the model dropped"
        )
    return Routes(
        model=trace.model.source, layers=layers, source="trace", notes=notes, non_finite=tuple(non_finite)
    )


def sequence_token_ids(trace: Trace) -> list[list[int]]:
    """Each sequence's token ids in position order (the input stream; an encoder-decoder's encoder side), to
    run the model again on the input a trace routed (the evaluation corpus, for quantisation and prefetch).
    InputError when the trace does not record them (an engine import without token ids)."""
    tokens = trace.tokens
    if "stream" in tokens and len(tokens):
        tokens = tokens[tokens["stream"] == tokens["stream"].iloc[0]]
    tokens = tokens.sort_values(["seq", "pos"], kind="stable")
    ids = tokens["token_id"].to_numpy(dtype=np.int64)
    if len(ids) == 0 or (ids < 0).any():
        raise InputError(f"{trace.model.source}: the routing does not record every token id: nothing to run")
    return [group.tolist() for _, group in tokens.groupby("seq", sort=True)["token_id"]]


def routes_from_store(
    store: str | Path,
    model: str | None = None,
    checkpoint: str | None = None,
    layers: list[int] | None = None,
) -> Routes:
    """One run of a corpus store (model/checkpoint; optional when the store holds one run), every sequence
    of it in plan order; `layers` keeps only those MoE layers."""
    from moeviz.store import StoreQuery

    query = StoreQuery(store, model=model, checkpoint=checkpoint)  # checks every part's size and hash
    runs = {(r.model, r.checkpoint) for r in query.runs}
    if len(runs) > 1:
        listing = ", ".join(f"{m}/{c}" for m, c in sorted(runs))
        raise InputError(f"store {store} holds several runs ({listing}); choose one by model and checkpoint")
    (run_model, run_checkpoint), meta = next(iter(runs)), query.layer_meta()
    columns, sites, non_finite = _read_rows(query.files, layers)
    out = []
    group = columns["site"] * 2**16 + columns["layer"]
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    ends = np.r_[starts[1:], len(group)]
    for start, end in zip(starts, ends, strict=True):
        site, layer = sites[int(columns["site"][start])], int(columns["layer"][start])
        info = meta.get((run_model, run_checkpoint, site, layer), {})
        k = int(columns["rank"][start:end].max()) + 1
        if (end - start) % k:
            raise InputError(f"store {store}: layer {layer} has a token without all {k} slot rows")
        shape = (-1, k)
        experts = columns["expert"][start:end].astype(np.int64).reshape(shape)
        num_experts = int(info.get("num_experts") or experts.max() + 1)
        out.append(
            LayerRoutes(
                layer=layer,
                site=site,
                experts=experts,
                weights=columns["weight"][start:end].astype(np.float32).reshape(shape),
                seq=columns["seq"][start:end:k].astype(np.int64),
                pos=columns["pos"][start:end:k].astype(np.int64),
                num_experts=num_experts,
                n_group=info.get("n_group"),
                topk_group=info.get("topk_group"),
            )
        )
    kept = sorted((layer, site) for site, layer in non_finite if layers is None or layer in layers)
    return Routes(
        model=run_model,
        layers=out,
        source="store",
        notes=[f"checkpoint {run_checkpoint}"],
        non_finite=tuple(f"layer {layer} ({site})" for layer, site in kept),
    )


ROW_COLUMNS = ["site", "layer", "seq", "pos", "rank", "expert", "weight"]
FINITE_COLUMNS = ["score", "lse"]  # read only to flag non-finite router scores, never kept


def _non_finite_rows(table, expert: np.ndarray) -> np.ndarray:
    """[rows] bool: the row's router score (a dispatched slot) or its log Σ exp(logits) (rank-0 rows; null
    elsewhere) is not finite. The store keeps these, not the full logits: a NaN or +inf logit makes the lse
    non-finite; a −inf logit of an expert no token chose leaves both finite and goes unflagged."""
    import pyarrow.compute as pc

    bad = np.zeros(len(expert), dtype=bool)
    if "score" in table.column_names:
        score = table.column("score").to_numpy()
        bad |= ~np.isfinite(score) & (expert >= 0)
    if "lse" in table.column_names:
        bad |= ~np.isfinite(pc.fill_null(table.column("lse"), 0.0).to_numpy())
    return bad


def _read_rows(
    files: list[str], layers: list[int] | None
) -> tuple[dict[str, np.ndarray], list[str], set[tuple[str, int]]]:
    """The store's routing columns sorted by (site, layer, seq, pos, rank), site as a code into the returned
    names, and the (site, layer) pairs whose router scores are not finite (`_non_finite_rows`). Read with
    pyarrow in file order: parts hold one batch each, layer by layer, tokens in order, so a stable sort by
    layer usually finishes the job (checked; a full sort otherwise). An SQL ORDER BY over 16 M rows costs
    ~10× more."""
    import pyarrow.parquet as pq

    parts: dict[str, list[np.ndarray]] = {name: [] for name in ROW_COLUMNS}
    sites: list[str] = []
    non_finite: set[tuple[str, int]] = set()
    for file in files:
        present = set(pq.read_schema(file).names)
        table = pq.read_table(file, columns=ROW_COLUMNS + [c for c in FINITE_COLUMNS if c in present])
        site = table.column("site").combine_chunks()
        for name in site.dictionary.to_pylist():
            if name not in sites:
                sites.append(name)
        codes = np.array([sites.index(name) for name in site.dictionary.to_pylist()], dtype=np.int64)
        parts["site"].append(codes[site.indices.to_numpy(zero_copy_only=False)])
        for name in ROW_COLUMNS[1:]:
            parts[name].append(table.column(name).to_numpy())
        bad = _non_finite_rows(table, parts["expert"][-1])
        if bad.any():
            pairs = zip(parts["site"][-1][bad].tolist(), parts["layer"][-1][bad].tolist(), strict=True)
            non_finite |= {(sites[code], int(layer)) for code, layer in set(pairs)}
    columns = {name: np.concatenate(values) if values else np.zeros(0) for name, values in parts.items()}
    columns["site"] = columns["site"].astype(np.int64)
    columns["layer"] = columns["layer"].astype(np.int64)
    if layers is not None:
        keep = np.isin(columns["layer"], layers)
        columns = {name: values[keep] for name, values in columns.items()}
    order = np.argsort(columns["site"] * 2**16 + columns["layer"], kind="stable")
    columns = {name: values[order] for name, values in columns.items()}
    within = (columns["seq"] * (int(columns["pos"].max(initial=0)) + 1) + columns["pos"]) * 128 + columns[
        "rank"
    ]
    same_group = np.diff(columns["site"] * 2**16 + columns["layer"]) == 0
    if np.any(np.diff(within)[same_group] <= 0):  # written out of order: sort fully
        order = np.lexsort(
            (columns["rank"], columns["pos"], columns["seq"], columns["layer"], columns["site"])
        )
        columns = {name: values[order] for name, values in columns.items()}
    return columns, sites, non_finite
