"""Does quantising the weights change which experts are chosen? Fake-quantise the router and/or the experts,
run the same tokens through the original and the quantised copy, and compare the routing.

Definitions (docs/deployment-whatifs.md, "Quantisation"): fake-quantisation per output channel (a row of W
in `F.linear`), symmetric absmax; flip rate 1 − |S ∩ S′| / k; top-1 agreement by combination weight; router
margin m = min score(S) − max score(eligible ∉ S) on the original model's selection scores.

The loaded model is never modified (the app shares it between threads): the quantised model is a copy that
shares every untouched tensor with the original and holds new tensors only for the quantised weights.
"""

from __future__ import annotations

import dataclasses
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from moeviz.analysis.margins import margin_quartiles, router_margin  # moved there (torch-free); re-exported
from moeviz.capture.forward import capture, token_batch
from moeviz.capture.layer_progress import watching_layers
from moeviz.errors import InputError
from moeviz.hooks import active_on_thread, shared_hooks
from moeviz.models.loading import LoadedModel
from moeviz.models.sites import MoESite, find_moe_sites
from moeviz.trace import LayerRouting, Trace

DTYPES = ("int8", "fp8", "int4")
TARGETS = ("experts", "router", "both")
FORMATS = ("bf16", "fp8", "int8", "int4")
INT4_GROUP = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Bytes per stored element and per scale. Per-row scales of INT8/FP8 are fp32 (vLLM's per-channel scales);
# INT4 group scales are 16-bit (GPTQ/AWQ store fp16 scales).
ELEMENT_BYTES = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
SCALE_BYTES = {"bf16": 0, "fp8": 4, "int8": 4, "int4": 2}
DEFINITION = (
    "per-output-channel symmetric absmax fake-quantisation (INT8 ±127 round-half-even, FP8 e4m3 scaled "
    "to 448, INT4 ±7 in groups of 128); flip rate = mean 1 − |S∩S′|/k; margin = min score(S) − "
    "max score(eligible ∉ S) on the original selection scores (docs/deployment-whatifs.md)"
)


# ---- fake-quantisation ----------------------------------------------------------------------------------
def fake_quantise(weight: torch.Tensor, dtype: str, input_dim: int = -1) -> torch.Tensor:
    """Weight [..., out, in] (the `F.linear` layout; fused experts [E, out, in]) fake-quantised per output
    channel along `input_dim` (-1; -2 for transposed [E, in, out] expert tensors), returned in the weight's
    dtype. A zero row stays zero.

    INT4 groups of 128 run along the input dim; when it is not a multiple of 128 the last group is shorter
    (the same as zero-padding it to 128: zeros change neither the absmax nor the other values)."""
    if dtype not in DTYPES:
        raise InputError(f"unknown quantisation dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if not weight.is_floating_point():
        raise InputError(f"cannot fake-quantise a {weight.dtype} tensor (already quantised?)")
    w = weight.detach().float().movedim(input_dim, -1)
    if dtype == "int4":
        out = _int4_groups(w)
    else:
        qmax = 127.0 if dtype == "int8" else FP8_MAX
        scale = _scale(w, qmax)
        if dtype == "int8":
            out = torch.clamp(torch.round(w / scale), -qmax, qmax) * scale  # torch.round: half to even
        else:
            out = (w / scale).to(torch.float8_e4m3fn).float() * scale
    return out.movedim(-1, input_dim).to(weight.dtype)


def _scale(w: torch.Tensor, qmax: float) -> torch.Tensor:
    """[..., in] -> [..., 1] absmax / qmax; 1 for an all-zero row (its values quantise to 0 either way)."""
    scale = w.abs().amax(dim=-1, keepdim=True) / qmax
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _int4_groups(w: torch.Tensor) -> torch.Tensor:
    """[..., in] fake-quantised to INT4 (±7, round half to even) in groups of 128 along the last dim."""
    width = w.shape[-1]
    pad = (-width) % INT4_GROUP
    padded = torch.nn.functional.pad(w, (0, pad)) if pad else w
    groups = padded.reshape(*padded.shape[:-1], -1, INT4_GROUP)
    scale = _scale(groups, 7.0)
    quantised = torch.clamp(torch.round(groups / scale), -7.0, 7.0) * scale
    return quantised.reshape(padded.shape)[..., :width]


# ---- which weights ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """One weight to quantise: its name in the model, the parameter, its input dim and its role."""

    name: str
    param: nn.Parameter
    input_dim: int
    role: str  # "router" | "experts"


def target_weights(model: nn.Module, sites: Sequence[MoESite], target: str) -> list[Target]:
    """The weight matrices `target` names: "router" = each MoE site's router weight [E, H]; "experts" = the
    routed experts' weight matrices and tensors (fused [E, out, in] or per-expert Linear) plus the shared
    experts' (not biases, norms or Qwen's shared-expert gate); "both" = both. Dense layers are never
    touched."""
    if target not in TARGETS:
        raise InputError(f"unknown quantisation target {target!r}; choose one of {', '.join(TARGETS)}")
    names = {id(p): n for n, p in model.named_parameters()}
    modules = dict(model.named_modules())
    found: dict[int, Target] = {}

    def add(module: nn.Module | None, role: str) -> None:
        if module is None:
            return
        transposed = bool(getattr(module, "is_transposed", False))  # gpt-oss keeps experts as [E, in, out]
        for param in module.parameters():
            if param.dim() < 2 or id(param) in found:
                continue
            input_dim = -2 if transposed and param.dim() == 3 else -1
            found[id(param)] = Target(names.get(id(param), "?"), param, input_dim, role)

    for site in sites:
        block = modules.get(site.name.rsplit(".", 1)[0]) if "." in site.name else model
        if target in ("router", "both"):
            add(site.router, "router")
        if target in ("experts", "both"):
            add(site.experts if site.experts is not None else getattr(block, "experts", None), "experts")
            shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
            add(shared if isinstance(shared, nn.Module) else None, "experts")
    return list(found.values())


def quantised_copy(loaded: LoadedModel, dtype: str, target: str) -> tuple[LoadedModel, list[Target]]:
    """A LoadedModel whose model is a copy of `loaded.model` with the `target` weights fake-quantised.

    Untouched parameters and buffers are the original tensors (shared, never written); the targeted ones
    are new. Hooks are not carried over: hooks another thread installed on the original write to the
    recorder of whichever thread runs a forward, so a copied one would record into ours."""
    model = loaded.model
    targets = target_weights(model, loaded.sites, target)
    if getattr(model, "_hf_hook", None) is not None:
        raise InputError("quantisation what-ifs need a model loaded on one device (no device_map)")
    with torch.no_grad():
        quantised = {
            id(t.param): nn.Parameter(fake_quantise(t.param, dtype, t.input_dim), requires_grad=False)
            for t in targets
        }
    twin = module_twin(model, quantised)
    twin.eval()
    return dataclasses.replace(loaded, model=twin, sites=find_moe_sites(twin)), targets


HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def module_twin(model: nn.Module, replaced: dict[int, nn.Parameter]) -> nn.Module:
    """A copy of the module tree of `model` that shares every tensor and object a forward only reads, with
    the parameters whose id is in `replaced` swapped for their replacements.

    Every module is a new object (its own parameter, buffer and submodule tables, its other dicts, lists
    and sets copied one level), so nothing set on the copy — a hook, a buffer, an attribute — reaches the
    original; hooks are not carried over (one another thread installed on the original writes to the
    recorder of whichever thread runs a forward, so a copied one would record into ours). Plain attributes
    that point at a module of the tree, and methods bound to one, are pointed at its copy. Cheaper than
    `copy.deepcopy` with a memo of the tensors, which copies every other object of the model (configs,
    tokenizer-free Python state) one by one."""
    twins: dict[int, nn.Module] = {}
    for module in model.modules():  # each module once, shared submodules included
        twin = module.__class__.__new__(module.__class__)
        state = {}
        for name, value in module.__dict__.items():
            if name in HOOK_DICTS:
                value = type(value)()
            elif isinstance(value, (dict, list, set)):
                value = value.copy()  # keeps the type (an OrderedDict stays one)
            state[name] = value
        twin.__dict__.update(state)
        twins[id(module)] = twin
    for twin in twins.values():
        params = twin._parameters
        for name, param in params.items():
            if param is not None and id(param) in replaced:
                params[name] = replaced[id(param)]
        for name, value in list(twin.__dict__.items()):
            if name == "_modules":
                twin._modules = {k: None if m is None else twins.get(id(m), m) for k, m in value.items()}
            elif isinstance(value, nn.Module) and id(value) in twins:
                twin.__dict__[name] = twins[id(value)]
            elif isinstance(value, types.MethodType) and id(value.__self__) in twins:
                twin.__dict__[name] = types.MethodType(value.__func__, twins[id(value.__self__)])
    return twins[id(model)]


# ---- comparison -----------------------------------------------------------------------------------------
def _set_mask(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, k] ids (-1 = dropped) -> [N, E] bool membership."""
    mask = np.zeros((experts.shape[0], num_experts), dtype=bool)
    rows, slots = np.nonzero(experts >= 0)
    mask[rows, experts[rows, slots]] = True
    return mask


def flip_fraction(before: np.ndarray, after: np.ndarray, num_experts: int) -> np.ndarray:
    """Per token [N]: 1 − |S ∩ S′| / k for dispatched ids before/after [N, k] (-1 never matches)."""
    k = before.shape[1]
    common = (_set_mask(before, num_experts) & _set_mask(after, num_experts)).sum(axis=1)
    return 1.0 - common / k


def top1_expert(routing: LayerRouting) -> np.ndarray:
    """[N] the expert with the largest combination weight (slot order is not trusted: group-limited
    routers do not sort their top-k)."""
    slot = np.argmax(routing.weights, axis=1)
    return routing.experts[np.arange(len(slot)), slot]


def _labels(experts: np.ndarray) -> list[str]:
    return [",".join(str(int(e)) for e in sorted(row[row >= 0])) for row in experts]


@dataclass(frozen=True)
class QuantResult:
    """Routing of the original vs the fake-quantised model over the same tokens.

    layers: one row per MoE layer (layer, site, dtype, target, flip_rate, top1_agreement, tokens);
    margins: per layer and quartile of the original margin; flips: one row per token whose set changed;
    delta_logprob: mean over the sequences' positions of log p_q(x_{t+1}) − log p(x_{t+1}) (NaN for
    encoder-decoders);
    bytes: model bytes per format (the targeted weights at that format plus scales, the rest at bf16).
    """

    model: str
    dtype: str
    target: str
    tokens: int
    layers: pd.DataFrame
    margins: pd.DataFrame
    flips: pd.DataFrame
    delta_logprob: float
    bytes: pd.DataFrame
    quantised_params: int
    before: Trace
    after: Trace
    definition: str = DEFINITION

    def layers_frame(self) -> pd.DataFrame:
        return self.layers.copy()

    def margin_frame(self) -> pd.DataFrame:
        return self.margins.copy()

    def flips_frame(self) -> pd.DataFrame:
        return self.flips.copy()

    def bytes_frame(self) -> pd.DataFrame:
        return self.bytes.copy()

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "tokens": int(self.tokens),
            "definition": self.definition,
            "delta_logprob": float(self.delta_logprob),
            "layers": [
                {
                    "layer": int(r.layer),
                    "dtype": self.dtype,
                    "target": self.target,
                    "flip_rate": float(r.flip_rate),
                    "top1_agreement": float(r.top1_agreement),
                }
                for r in self.layers.itertuples()
            ],
        }


def compare_layer(before: LayerRouting, after: LayerRouting) -> dict[str, np.ndarray]:
    """Per token [N] of one layer: flip, top-1 agreement and the original margin (same tokens, same order)."""
    if not np.array_equal(before.token_rows, after.token_rows):
        raise ValueError(f"layer {before.layer}: the two captures routed different tokens")
    return {
        "flip": flip_fraction(before.experts, after.experts, before.num_experts),
        "top1": top1_expert(before) == top1_expert(after),
        "margin": router_margin(before),
    }


def _frames(before: Trace, after: Trace, dtype: str, target: str) -> tuple[pd.DataFrame, ...]:
    layer_rows, margin_rows, flip_parts = [], [], []
    tokens = before.tokens
    for b in before.layers:
        a = after.layer(b.layer, b.site)
        per = compare_layer(b, a)
        layer_rows.append(
            {
                "layer": b.layer,
                "site": b.site,
                "dtype": dtype,
                "target": target,
                "flip_rate": float(per["flip"].mean()) if len(per["flip"]) else float("nan"),
                "top1_agreement": float(per["top1"].mean()) if len(per["top1"]) else float("nan"),
                "tokens": len(per["flip"]),
            }
        )
        quart = margin_quartiles(per["margin"])
        for q in range(1, 5):
            sel = quart == q
            if sel.any():
                m = per["margin"][sel]
                margin_rows.append(
                    {
                        "layer": b.layer,
                        "site": b.site,
                        "quartile": q,
                        "margin_low": float(m.min()),
                        "margin_high": float(m.max()),
                        "flip_rate": float(per["flip"][sel].mean()),
                        "tokens": int(sel.sum()),
                    }
                )
        flipped = np.flatnonzero(per["flip"] > 0)
        rows = b.token_rows[flipped]
        flip_parts.append(
            pd.DataFrame(
                {
                    "layer": b.layer,
                    "site": b.site,
                    "row": rows,
                    "seq": tokens["seq"].to_numpy()[rows],
                    "pos": tokens["pos"].to_numpy()[rows],
                    "token": tokens["token"].to_numpy()[rows],
                    "experts_before": _labels(b.experts[flipped]),
                    "experts_after": _labels(a.experts[flipped]),
                    "margin": per["margin"][flipped],
                }
            )
        )
    flips = pd.concat(flip_parts, ignore_index=True) if flip_parts else pd.DataFrame()
    return pd.DataFrame(layer_rows), pd.DataFrame(margin_rows), flips


def model_bytes(model: nn.Module, targets: Sequence[Target]) -> pd.DataFrame:
    """Bytes of the model's parameters per format: the targeted weights at the format (1 byte FP8/INT8 + an
    fp32 scale per row; 0.5 byte INT4 + a 16-bit scale per group of 128 inputs), every other parameter at
    bf16 (2 bytes). Tied weights count once. Columns format, bytes, quantised_params."""
    targeted = {id(t.param): t for t in targets}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in targeted)
    rows = []
    for fmt in FORMATS:
        total = 2.0 * rest
        for t in targeted.values():
            numel = t.param.numel()
            width = t.param.shape[t.input_dim]
            channels = numel // width
            scales = channels * (-(-width // INT4_GROUP) if fmt == "int4" else 1)
            total += ELEMENT_BYTES[fmt] * numel + SCALE_BYTES[fmt] * scales
        rows.append(
            {
                "format": fmt,
                "bytes": round(total),
                "quantised_params": sum(t.param.numel() for t in targeted.values()),
            }
        )
    return pd.DataFrame(rows)


def _next_token_logprob(loaded: LoadedModel, ids: list[int]) -> np.ndarray:
    """[T-1] log p(x_{t+1} | x_≤t) of one plain forward (fp32 log-softmax)."""
    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([ids], device=loaded.device)).logits[0]
    return _logprob_of(logits, ids)


def _logprob_of(logits: torch.Tensor, ids: list[int]) -> np.ndarray:
    """[T-1] log p(x_{t+1} | x_≤t) from one sequence's logits [T, V] (fp32 log-softmax)."""
    with torch.inference_mode():
        logp = torch.log_softmax(logits.float(), dim=-1)[:-1]
        target = torch.tensor(ids[1:], device=logp.device)
        return logp.gather(1, target[:, None])[:, 0].cpu().numpy()


BATCH = 8  # sequences per forward: the app routes the evaluation corpus in batches of 8 windows too
_kept = threading.local()  # .logits: this thread's list of model outputs' logits, or None


@contextmanager
def keeping_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Keep the logits [B, T, V] of every forward of `model` this thread runs in the block (a forward hook
    from the shared registry: the model may be shared, and other threads' forwards keep nothing)."""

    def keep(_module: nn.Module, _args: Any, output: Any) -> None:
        kept = getattr(_kept, "logits", None)
        logits = getattr(output, "logits", None)
        if kept is not None and isinstance(logits, torch.Tensor):
            kept.append(logits)

    kept: list[torch.Tensor] = []
    install = lambda: [model.register_forward_hook(keep)]  # noqa: E731
    with shared_hooks(model, "whatif-quant-logits", install), active_on_thread(_kept, "logits", kept):
        yield kept


def _capture_in_batches(
    loaded: LoadedModel, batch: list[list[int]], logprobs: dict[int, np.ndarray] | None = None
) -> Trace:
    """The routing of every sequence of `batch`, BATCH sequences a forward (bounded activations), in one
    trace with the sequences numbered in order. With `logprobs`, a sequence routed alone (no padding: its
    logits are the plain forward's, bit for bit) also gets its next-token log-probabilities from that same
    forward, under its index in `batch`; sequences routed several to a forward get none (padding changes
    their logits in the last bits)."""
    parts = []
    for i in range(0, len(batch), BATCH):
        chunk = batch[i : i + BATCH]
        if logprobs is None or len(chunk) > 1 or len(chunk[0]) < 2:
            parts.append(capture(loaded, token_ids=chunk))
            continue
        with keeping_logits(loaded.model) as kept:
            parts.append(capture(loaded, token_ids=chunk))
        if len(kept) == 1:
            logprobs[i] = _logprob_of(kept[0][0], chunk[0])
    return parts[0] if len(parts) == 1 else Trace.concat(parts)


def quantisation_flips(
    loaded: LoadedModel,
    *,
    text: str | Sequence[str] | None = None,
    token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    dtype: str = "int8",
    target: str = "experts",
    progress: Callable[[float, str], None] | None = None,
) -> QuantResult:
    """Route the input (`text`, or `token_ids`: one sequence, or a list of sequences such as the
    evaluation corpus) through the original and a copy with the `target` weights fake-quantised to `dtype`,
    and compare the routing per MoE layer; delta_logprob is the mean over every sequence's next-token
    positions. `loaded.model` is never modified."""
    if dtype not in DTYPES:
        raise InputError(f"unknown quantisation dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    batch = token_batch(loaded, text, token_ids)
    report = progress or (lambda _f, _m: None)
    report(0.0, f"fake-quantising the {target} weights to {dtype}")
    quantised, targets = quantised_copy(loaded, dtype, target)
    scores = not (loaded.is_encoder_decoder or loaded.is_token_classifier)
    # a sequence routed alone is scored by its capture's own forward: two forwards in all, not four
    kept_before: dict[int, np.ndarray] | None = {} if scores else None
    kept_after: dict[int, np.ndarray] | None = {} if scores else None
    report(0.2, "routing the original model")
    before = _capture_in_batches(loaded, batch, kept_before)
    report(0.45, "routing the quantised model")
    with watching_layers(quantised.model):  # a caller's `layer_progress` (and its cancel) reaches the copy
        after = _capture_in_batches(quantised, batch, kept_after)
    delta = float("nan")
    scored = [i for i, ids in enumerate(batch) if len(ids) > 1]
    if kept_before is not None and kept_after is not None and scored:  # kept only when scoring
        if any(i not in kept_before for i in scored):
            report(0.7, "next-token log-probabilities")

        def logprob(model: LoadedModel, kept: dict[int, np.ndarray], i: int) -> np.ndarray:
            return kept[i] if i in kept else _next_token_logprob(model, batch[i])

        with watching_layers(quantised.model):
            deltas = [logprob(quantised, kept_after, i) - logprob(loaded, kept_before, i) for i in scored]
        delta = float(np.concatenate(deltas).mean())
    layers, margins, flips = _frames(before, after, dtype, target)
    report(1.0, "done")
    return QuantResult(
        model=loaded.info.source,
        dtype=dtype,
        target=target,
        tokens=sum(len(ids) for ids in batch),
        layers=layers,
        margins=margins,
        flips=flips,
        delta_logprob=delta,
        bytes=model_bytes(loaded.model, targets),
        quantised_params=sum(t.param.numel() for t in targets),
        before=before,
        after=after,
    )
