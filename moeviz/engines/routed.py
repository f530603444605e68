"""Per-token engine routing to a Trace: the one assembly every per-token importer ends in.

An importer decodes its format into `RoutedSequence`s (expert ids [R, L, k] of R consecutive positions, in
the engine's own layer axis and logical ids) and hands them to `routed_trace`, which
- places the layer axis (every hidden layer, dense ones holding a sentinel; or the MoE layers only),
- sets aside rows the engine did not run (all -1: prefix-cache hits),
- checks every routed (token, layer) holds exactly k distinct ids in [0, E) (`moeviz.engines.checks`),
- aligns the token ids: T = start + R + 1 ids (the whole sequence: its last sampled token never ran through
  the model, so it has no routing) or T = start + R (only the routed tokens); anything else is refused,
- and builds the Trace: one LayerRouting per MoE layer whose experts are one [N, k] block of a single
  layer-major array in the narrowest integer type that holds the ids (no per-layer copies), logits and
  weights absent unless the format has them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from moeviz.engines.checks import check_expert_sets, layer_axis, unrouted_rows
from moeviz.engines.layout import RoutingLayout
from moeviz.errors import EngineFormatError
from moeviz.trace import TOKEN_COLUMNS, UNKNOWN_TOKEN, LayerRouting, LazyTokens, Trace
from moeviz.trace.records import absent


@dataclass
class RoutedSequence:
    """One sequence's routing as its engine wrote it, decoded from the file.

    - experts [R, L, k] int: logical expert ids of positions start … start+R−1 at each layer of the file's
      layer axis (every hidden layer, or the MoE layers only); all -1 for a row the engine did not run
    - token_ids [T] int | None: the sequence's token ids when the file or the user gives them
    - start: position of row 0 (SGLang's `routed_experts_start_len`, vLLM's `routed_experts_prompt_start`)
    - prompt_len: tokens of the prompt (phase "prompt"; later positions are "generated"); None = unknown
    - weights [R, L, k] float | None: combination weights, where the format records them
    - logits [R, L, E] float | None: raw router logits, where the format records them (Megatron's sidecar)
    - label: how messages name it ("response.json, choice 0")
    """

    experts: np.ndarray
    token_ids: np.ndarray | None = None
    start: int = 0
    prompt_len: int | None = None
    weights: np.ndarray | None = None
    logits: np.ndarray | None = None
    label: str = "sequence"


def narrowest_id_type(num_experts: int) -> type[np.signedinteger]:
    """The narrowest signed integer type that holds every id -1 … num_experts − 1 (int8 up to 128 experts,
    int16 up to 32,768): one or two bytes an id instead of eight, for rollouts of a million tokens."""
    for dtype in (np.int8, np.int16, np.int32):
        if num_experts - 1 <= np.iinfo(dtype).max:
            return dtype
    return np.int64


def routed_trace(
    layout: RoutingLayout,
    sequences: Sequence[RoutedSequence],
    *,
    source: str,
    notes: Sequence[str] = (),
    ranked: bool = True,
    decode_tokens: bool = True,
) -> Trace:
    """A Trace of `sequences` for the model `layout` describes. `source` is the format name (each layer's
    `decision_source`); `notes` go to the trace's ModelInfo; `ranked`: slot 0 is the engine's top choice
    (False: the engine writes a token's experts in another order, so only sets compare).
    `decode_tokens`: the token table decodes ids with the model's tokenizer on first read.

    The sequences are consumed: each one's arrays are dropped once they are copied into the trace, so an
    importer that hands over its only references holds one copy of the ids, not two."""
    if not sequences:
        raise EngineFormatError(f"{source}: the file holds no sequence with routing")
    k, e = layout.top_k, layout.num_experts
    plans = [_plan(layout, seq) for seq in sequences]
    total = sum(int(p.keep.sum()) for p in plans)
    dtype = narrowest_id_type(e)
    experts = np.empty((len(layout.moe_layers), total, k), dtype=dtype)
    with_weights = all(s.weights is not None for s in sequences)
    with_logits = all(s.logits is not None for s in sequences)
    weights = np.empty((len(layout.moe_layers), total, k), np.float32) if with_weights else None
    logits = np.empty((len(layout.moe_layers), total, e), np.float32) if with_logits else None
    token_parts, token_rows, row, offset = [], [], 0, 0
    for index, (seq, plan) in enumerate(zip(sequences, plans, strict=True)):
        block = _moe_rows(seq.experts, plan, plan.layers)  # [n, L_moe, k]
        n = len(block)
        check_expert_sets(block.reshape(-1, k), e, plan.where)
        # converted first, then transposed: a converting strided copy is ~7× slower than the two steps
        experts[:, offset : offset + n] = block.astype(dtype, copy=False).transpose(1, 0, 2)
        if weights is not None and seq.weights is not None:  # with_weights: every sequence has them
            weights[:, offset : offset + n] = _moe_rows(seq.weights, plan, plan.layers).transpose(1, 0, 2)
        if logits is not None and seq.logits is not None:  # with_logits: every sequence has them
            # the logits' layer axis may count the MoE layers only where the ids' counts every hidden layer
            axis = plan.layers if seq.logits.shape[1] == seq.experts.shape[1] else range(len(plan.layers))
            logits[:, offset : offset + n] = _moe_rows(seq.logits, plan, list(axis)).transpose(1, 0, 2)
        tokens = _token_columns(index, seq, plan)
        seq.experts = seq.weights = seq.logits = None  # type: ignore[assignment]  # consumed (see above)
        token_rows.append(row + np.flatnonzero(tokens["routed_row"] >= 0))  # in routing order
        token_parts.append(tokens)
        row += len(tokens["pos"])
        offset += n
    rows = np.concatenate(token_rows) if token_rows else np.zeros(0, np.int64)
    table = _token_table(token_parts)
    layers = [
        LayerRouting(
            layer=layer,
            site="mlp",
            token_rows=rows,
            logits=logits[out] if logits is not None else absent(total, e),
            experts=experts[out],
            weights=weights[out] if weights is not None else absent(total, k),
            score_fn=layout.score_fn,
            decision_source=source,
            top_k=k,
            shared_experts=layout.shared_experts,
            n_group=layout.n_group,
            topk_group=layout.topk_group,
            group_score=layout.group_score,
            has_logits=logits is not None,
            has_weights=weights is not None,
            ranked=ranked,
        )
        for out, layer in enumerate(layout.moe_layers)
    ]
    all_notes = list(notes) + [p.note for p in plans if p.note]
    decoded = LazyTokens(lambda: _decoded(table, layout)) if decode_tokens else _decoded(table, None)
    return Trace(model=layout.model_info(_unique(all_notes)), tokens=decoded, layers=layers)


@dataclass
class _Plan:
    layers: list[int]  # position on the file's layer axis of each MoE layer
    axis: str  # "hidden layers" | "MoE layers"
    keep: np.ndarray  # [R] rows the engine ran
    first_row_pos: int  # position of row 0
    length: int  # tokens of the sequence in the token table
    note: str | None
    label: str

    @functools.cached_property
    def all_kept(self) -> bool:
        return bool(self.keep.all())

    def where(self, row: int) -> str:
        """Names row `row` of the checked [n · L_moe, k] block: (kept row, MoE layer) in row-major order."""
        kept, out = divmod(row, len(self.layers))
        position = self.first_row_pos + int(np.flatnonzero(self.keep)[kept])
        return f"{self.label}, position {position}, MoE layer {out}"


def _moe_rows(values: np.ndarray, plan: _Plan, layers: list[int]) -> np.ndarray:
    """[n, L_moe, …] the kept rows at the MoE layers' positions on the layer axis (views where they can be:
    a whole axis and every row kept take no copy)."""
    if layers != list(range(values.shape[1])):
        values = values[:, layers]
    return values if plan.all_kept else values[plan.keep]


def _plan(layout: RoutingLayout, seq: RoutedSequence) -> _Plan:
    ids = seq.experts
    if ids.ndim != 3:
        shape = list(ids.shape)
        raise EngineFormatError(f"{seq.label}: routing of shape {shape}, expected [tokens, layers, k]")
    if ids.shape[2] != layout.top_k:
        raise EngineFormatError(
            f"{seq.label}: {ids.shape[2]} experts per token in the file, the model routes each token to "
            f"{layout.top_k} (top-k): is --model the model that produced this file?"
        )
    skipped = unrouted_rows(ids)
    keep = ~skipped
    layers, axis = layer_axis(ids, layout.num_hidden_layers, layout.moe_layers, seq.label, routed=keep)
    r = len(ids)
    notes = []
    if skipped.any():
        notes.append(
            f"{int(skipped.sum())} of {r} positions of {seq.label} hold no routing (all -1: tokens the "
            "engine did not run, e.g. prefix-cache hits); they are in the token table without routing"
        )
    length = seq.start + r
    if seq.token_ids is not None:
        t = len(seq.token_ids)
        if t == seq.start + r + 1:
            length = t  # the last sampled token never ran through the model: it has no routing
        elif t != seq.start + r:
            raise EngineFormatError(
                f"{seq.label}: {t} token ids for {r} rows of routing starting at position {seq.start}: "
                f"expected {seq.start + r + 1} (the whole sequence; its last token is never run) or "
                f"{seq.start + r} (only the routed tokens)"
            )
    for name, extra in (("weights", seq.weights), ("logits", seq.logits)):
        if extra is not None and (extra.ndim != 3 or extra.shape[0] != r):
            raise EngineFormatError(
                f"{seq.label}: {name} of shape {list(extra.shape)} for {r} rows of routing"
            )
    return _Plan(layers, axis, keep, seq.start, length, "; ".join(notes) or None, seq.label)


def _token_columns(index: int, seq: RoutedSequence, plan: _Plan) -> dict[str, np.ndarray]:
    n = plan.length
    pos = np.arange(n, dtype=np.int64)
    ids = (
        np.asarray(seq.token_ids, dtype=np.int64)
        if seq.token_ids is not None
        else np.full(n, UNKNOWN_TOKEN, np.int64)
    )
    routed_row = np.full(n, -1, np.int64)
    rows = np.arange(seq.start, seq.start + len(plan.keep))
    routed_row[rows[plan.keep]] = np.arange(int(plan.keep.sum()))
    prompt = seq.prompt_len if seq.prompt_len is not None else n
    generated = pos >= prompt
    return {
        "seq": np.full(n, index, np.int64),
        "pos": pos,
        "token_id": ids,
        "generated": generated,
        "step": np.where(generated, pos - prompt + 1, 0).astype(np.int64),
        "routed_row": routed_row,
    }


def _token_table(parts: list[dict[str, np.ndarray]]) -> pd.DataFrame:
    columns = {name: np.concatenate([p[name] for p in parts]) for name in ("seq", "pos", "token_id", "step")}
    generated = np.concatenate([p["generated"] for p in parts])
    n = len(columns["seq"])
    return pd.DataFrame(
        {
            "seq": columns["seq"],
            "pos": columns["pos"],
            "stream": _strings(np.zeros(n, np.int8), ["input"]),
            "token_id": columns["token_id"],
            "token": _strings(np.zeros(n, np.int8), [""]),
            "phase": _strings(generated.astype(np.int8), ["prompt", "generated"]),
            "step": columns["step"],
            "predicted_id": np.full(n, -1, np.int64),
        }
    )[TOKEN_COLUMNS]


def _strings(codes: np.ndarray, names: list[str]) -> pd.Series:
    """`names[codes]` as pandas' default string column, built in Arrow (~10× faster than Python strings for
    a million rows)."""
    import pyarrow as pa

    array = pa.DictionaryArray.from_arrays(pa.array(codes), pa.array(names)).cast(pa.large_string())
    return pd.Series(pd.array(array, dtype=pd.StringDtype("pyarrow", na_value=np.nan)))


def _decoded(table: pd.DataFrame, layout: RoutingLayout | None) -> pd.DataFrame:
    """The token table with each id decoded on its own by the model's tokenizer (⟨id⟩ without one, ⟨?⟩ for
    an unknown id)."""
    ids = table["token_id"].to_numpy()
    tokenizer = layout.tokenizer() if layout is not None else None
    unique = np.unique(ids)
    known = [int(i) for i in unique if i >= 0]
    if tokenizer is not None and known:
        from moeviz.models.loading import decode_each

        texts = dict(zip(known, decode_each(tokenizer, {}, known), strict=True))
    else:
        texts = {i: f"⟨{i}⟩" for i in known}
    texts[UNKNOWN_TOKEN] = "⟨?⟩"
    codes = np.searchsorted(unique, ids)
    names = np.array([texts.get(int(i), f"⟨{int(i)}⟩") for i in unique], dtype=object)
    table = table.copy()
    table["token"] = names[codes] if len(ids) else table["token"]
    return table


def _unique(notes: list[str]) -> list[str]:
    return list(dict.fromkeys(notes))
