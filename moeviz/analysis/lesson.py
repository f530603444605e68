"""The numbers of the guided lesson (the app's Learn page) that no other analysis function gives: one token's
way from router logits to combination weights, the chosen experts and weights of a layer's first tokens,
and the share of tokens each routed or shared expert processes, with the shared experts' share of a token's
expert parameters. (Re-routing at another k or without the bias, and the per-expert aux-loss terms, are
`moeviz.analysis.reroute`'s.) A LayerRouting in, numbers or frames out; definitions:
docs/routing-metrics.md.

- `router_walkthrough`: for one token, per expert: logit, score p = score_fn(logit), selection score
  p + b, whether it is among the k chosen, and its weight renormalised over the chosen ones,
  w_e = p_e / Σ_{j∈S} p_j (what Mixtral and DeepSeek-V3 apply; `model_weight` is what the model applied).
- `token_weights_frame`: the first tokens' chosen experts and weights, one row per slot (for a re-routed
  layer's, e.g.).
- `expert_token_share`: per expert, the share of the layer's tokens it processes: c_e / T for a routed
  expert (k/E on average), 1 for each shared expert (every token runs through it); `expert_parameters` and
  `shared_fraction`: the shared experts' share of the expert parameters a token runs through.
- `*_notice`: each step's "what to notice" line, built from the numbers it describes (every claim in it —
  above / below, more / less even, rises / flat within seed noise — chosen by a comparison, not written in
  advance); `most_uneven_layer`, `largest_aux_layer`, `collapse_contrast_layer`, `bias_contrast_layer`: the
  layer a step opens on, where its point shows most. `sweep_points` / `sweep_notice`: the experts sweep
  (docs/experts-sweep.csv) per (k, experts) over seeds, with the collapses it recorded.
- `too_few_tokens`: on a text of the user's, the sentence a load claim gives way to when the text routes
  too few tokens for it (fewer than the collapse verdict's `min_slots_per_expert` fair-share slots per
  expert): the notices of steps 2–6 then state that instead of comparing loads.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd

from moeviz.analysis.balance import balance_from_counts, balance_stats, expert_counts
from moeviz.analysis.collapse import CollapseThresholds
from moeviz.analysis.reroute import RerouteSettings, aux_terms, reroute
from moeviz.trace import LayerRouting

WALKTHROUGH_COLUMNS = [
    "expert",
    "logit",
    "score",
    "selection_score",
    "chosen",
    "rank",
    "weight",
    "model_weight",
]


def router_walkthrough(routing: LayerRouting, row: int) -> pd.DataFrame:
    """One token (row `row` of the layer) from logits to weights, one row per expert; columns
    WALKTHROUGH_COLUMNS. `chosen` / `rank` (0 = largest weight, -1 = not chosen) are the experts the model
    dispatched (dropped slots refilled by nothing: a dropped expert is not chosen); `weight` =
    p_e / Σ_{chosen} p (0 when not chosen); `model_weight` = the combination weight the model applied."""
    n, e = routing.scores.shape
    if not 0 <= row < n:
        raise IndexError(f"layer {routing.layer} routed {n} tokens; no row {row}")
    experts, weights = routing.experts[row], routing.weights[row]
    scores = np.asarray(routing.scores[row], dtype=np.float64)
    rank = np.full(e, -1, dtype=np.int64)
    model_weight = np.zeros(e, dtype=np.float64)
    order = np.argsort(-np.asarray(weights, dtype=np.float64), kind="stable")
    for r, slot in enumerate(order):
        if experts[slot] >= 0:
            rank[experts[slot]] = r
            model_weight[experts[slot]] = float(weights[slot])
    chosen = rank >= 0
    total = scores[chosen].sum()
    weight = np.where(chosen, scores / total if total > 0 else 0.0, 0.0)
    return pd.DataFrame(
        {
            "expert": np.arange(e),
            "logit": np.asarray(routing.logits[row], dtype=np.float64),
            "score": scores,
            "selection_score": np.asarray(routing.selection_scores[row], dtype=np.float64),
            "chosen": chosen,
            "rank": rank,
            "weight": weight,
            "model_weight": model_weight,
        },
        columns=WALKTHROUGH_COLUMNS,
    )


SHARE_COLUMNS = ["expert", "kind", "tokens", "share"]


def expert_token_share(routing: LayerRouting) -> pd.DataFrame:
    """Per expert of one layer, the share of its T tokens it processes (columns SHARE_COLUMNS): the shared
    experts first (expert "shared" or "shared 1", "shared 2", …: every token, share 1), then each routed
    expert (its id as text: c_e tokens, share c_e / T; the routed shares sum to k minus drops)."""
    t = len(routing.token_rows)
    counts = expert_counts(routing)
    s = routing.shared_experts
    names = ["shared"] if s == 1 else [f"shared {i + 1}" for i in range(s)]
    rows = [{"expert": name, "kind": "shared", "tokens": t, "share": 1.0 if t else np.nan} for name in names]
    rows += [
        {"expert": str(e), "kind": "routed", "tokens": int(c), "share": c / t if t else np.nan}
        for e, c in enumerate(counts)
    ]
    return pd.DataFrame(rows, columns=SHARE_COLUMNS)


def expert_parameters(model, layer: int) -> dict[str, int]:
    """Parameters of block `layer`'s MoE experts in a model (any module with `named_parameters`, e.g.
    `LoadedModel.model`): `routed` (all routed experts, names with `.experts.`), `shared` (names with
    `.shared_expert`), by the block index `.layers.<layer>.` in their names. No torch import."""
    marker = f".layers.{layer}."
    routed = shared = 0
    for name, param in model.named_parameters():
        if marker not in f".{name}":
            continue
        if ".shared_expert" in name:
            shared += param.numel()
        elif ".experts." in name:
            routed += param.numel()
    return {"routed": int(routed), "shared": int(shared)}


def shared_fraction(parameters: dict[str, int], k: int, num_experts: int) -> float:
    """The shared experts' share of the expert parameters one token runs through at a layer:
    shared / (shared + routed · k / E), `parameters` as `expert_parameters` gives them; NaN when none."""
    active = parameters["shared"] + parameters["routed"] * k / num_experts
    return float(parameters["shared"] / active) if active > 0 else float("nan")


WEIGHT_COLUMNS = ["seq", "pos", "token", "rank", "expert", "weight"]


def token_weights_frame(
    tokens: pd.DataFrame, routing: LayerRouting, experts: np.ndarray, weights: np.ndarray, limit: int = 24
) -> pd.DataFrame:
    """The first `limit` tokens of a layer with their chosen experts and weights (e.g. `route_top_k`'s), one
    row per (token, slot), slot rank 0 = largest weight; columns WEIGHT_COLUMNS. `tokens`: the trace's
    `Trace.tokens`; dropped slots (-1) are left out."""
    rows = []
    for i, row in enumerate(routing.token_rows[:limit]):
        token = tokens.iloc[int(row)]
        order = np.argsort(-np.asarray(weights[i], dtype=np.float64), kind="stable")
        for rank, slot in enumerate(order):
            if experts[i, slot] < 0:
                continue
            rows.append(
                {
                    "seq": int(token["seq"]),
                    "pos": int(token["pos"]),
                    "token": str(token["token"]),
                    "rank": rank,
                    "expert": int(experts[i, slot]),
                    "weight": float(weights[i, slot]),
                }
            )
    return pd.DataFrame(rows, columns=WEIGHT_COLUMNS)


# ---- "What to notice": each step's one line, built only from the numbers it describes --------------------
# Every claim below is chosen by the numbers (a comparison, a direction, an order), never written in
# advance: a notice cannot contradict the chart beside it. Each step's default layer is the one where its
# point shows most (`*_layer` functions).


def _pct(value: float) -> str:
    return f"{value:.1%}"


# The load of a text routed into fewer fair-share slots per expert than this is too small a sample to say
# which expert is busy or which routing is more even: the collapse verdict's own floor (5 slots).
MIN_SLOTS_PER_EXPERT = CollapseThresholds.min_slots_per_expert


def tokens_for_load_claims(num_experts: int, k: int) -> int:
    """The fewest tokens a layer must route before a notice compares loads: MIN_SLOTS_PER_EXPERT · E / k
    (k·T slots, at least that many per expert on average)."""
    return math.ceil(MIN_SLOTS_PER_EXPERT * num_experts / max(k, 1))


def too_few_tokens(tokens: int | None, num_experts: int, k: int) -> str | None:
    """The sentence that replaces a load claim when `tokens` (routed at the layer) are too few for it
    (`tokens_for_load_claims`), else None; None also when `tokens` is None (not checked)."""
    need = tokens_for_load_claims(num_experts, k)
    if tokens is None or tokens >= need:
        return None
    return (
        f"your text gives this layer {tokens} token{'s' if tokens != 1 else ''} ({k * tokens} slots for "
        f"{num_experts} experts, under {MIN_SLOTS_PER_EXPERT:g} per expert): too few to tell a busy expert "
        f"or a more even routing from chance, so no claim about the load is made here; a text of at least "
        f"{need} tokens shows one."
    )


def router_notice(walkthrough: pd.DataFrame, num_experts: int) -> str:
    """Step 1 (one token through the router), from `router_walkthrough`'s frame: how many scores survive,
    and whether the model's weights of the chosen experts are the renormalised scores (sum 1) or not."""
    chosen = walkthrough[walkthrough["chosen"]].sort_values("rank")
    k = len(chosen)
    picks = ", ".join(
        f"expert {int(r.expert)}: p = {r.score:.3f} → w = {r.model_weight:.3f}" for r in chosen.itertuples()
    )
    total = float(chosen["model_weight"].sum())
    renormalised = np.allclose(chosen["model_weight"], chosen["weight"], atol=1e-3)
    if renormalised:
        how = "they are rescaled to sum to 1"
    else:
        how = f"the model keeps its own weights (they sum to {total:.3f})"
    return (
        f"only the top {k} of {num_experts} scores survive, and {how} ({picks}). The other experts never "
        "see this token."
    )


def top_k_notice(
    weights: np.ndarray, max_share: float, tokens: int, num_experts: int, *, judge_length: bool = False
) -> str:
    """Step 2 (top-1 vs top-2), from the re-routed weights [T, k] and the busiest expert's share of the kT
    slots: the average weight of each token's 1st (largest-weight) expert, and the busiest expert's share
    (with `judge_length`, only when the T tokens are enough for it: `too_few_tokens`)."""
    k = weights.shape[1]
    first = float(np.max(weights, axis=1).mean()) if len(weights) else float("nan")
    carries = " (all of it)." if k == 1 else f" and the other{'s' if k > 2 else ''} {1 - first:.0%}."
    text = (
        f"with top-{k} each token runs {k} expert FFN{'s' if k > 1 else ''}; its 1st expert carries "
        f"{first:.0%} of the output on average{carries} "
    )
    short = too_few_tokens(tokens if judge_length else None, num_experts, k)
    if short:
        return text + short[0].upper() + short[1:]
    fair = _pct(1 / num_experts)
    return text + f"The busiest expert takes {_pct(max_share)} of the {k * tokens} slots (fair: {fair})."


def load_notice(load: pd.DataFrame, layer: int, *, tokens: int | None = None, k: int = 1) -> str:
    """Step 3 (load and the fair share), from one layer's rows of `expert_balance_frame`: the busiest and the
    quietest expert against 1/E — unless the layer's `tokens` (top-`k`) are too few (`too_few_tokens`)."""
    short = too_few_tokens(tokens, len(load), k)
    even = f"if routing were even every expert would get 1/E = {_pct(1 / len(load))} of the slots"
    if short:
        return f"{even}; {short}"
    busiest, quietest = load.loc[load["share"].idxmax()], load.loc[load["share"].idxmin()]
    return (
        f"if routing were even every expert would get 1/E = {_pct(1 / len(load))} of the slots; at layer "
        f"{layer} expert {int(busiest.expert)} gets {_pct(busiest.share)} ({busiest.utilisation:.2f}× its "
        f"share) and expert {int(quietest.expert)} {_pct(quietest.share)} ({quietest.utilisation:.2f}×)."
    )


def most_uneven_layer(trace) -> tuple[str, int]:
    """The (site, layer) whose load is least even (lowest normalised load entropy): step 3's default."""
    entropy = {key: balance_stats(trace.layer(key[1], key[0])).load_entropy for key in trace.layer_keys}
    return min(entropy, key=lambda key: (entropy[key], key[1]))


def aux_notice(terms: pd.DataFrame, k: int, layer: int, *, tokens: int | None = None) -> str:
    """Step 4 (the auxiliary loss), from one layer's `aux_terms` (columns expert, f, P, term): L against its
    balanced value k, and why the largest term is large (its f against k/E, its P against 1/E) — unless the
    layer's `tokens` are too few to compare loads (`too_few_tokens`): then L alone, and that."""
    e = len(terms)
    loss = float(terms["term"].sum())
    top = terms.loc[terms["term"].idxmax()]
    relation = "at" if np.isclose(loss, k, rtol=1e-9) else ("above" if loss > k else "below")
    short = too_few_tokens(tokens, e, k)
    if short:
        return (
            f"L = E·Σ f·P reads k = {k} when the load is even; at layer {layer} it is {loss:.4f}, "
            f"{loss / k:.3f}× that ({relation} it). But {short}"
        )
    more_tokens, more_probability = bool(top.f > k / e), bool(1 / e < top.P)
    f_word, f_sign = ("more", ">") if more_tokens else ("no more", "≤")
    probability, p_sign = ("more", ">") if more_probability else ("no more", "≤")
    return (
        f"L = E·Σ f·P reads k = {k} when the load is even and grows when the busy experts also get the "
        f"probability; at layer {layer} it is {loss:.4f}, {loss / k:.3f}× that ({relation} it). Expert "
        f"{int(top.expert)} adds the most, {e}·{top.f:.3f}·{top.P:.3f} = {top.term:.3f}: {f_word} than its "
        f"share of the tokens (f = {top.f:.3f} {f_sign} k/E = {k / e:.3f}) and "
        f"{probability} than its share of the probability (P = {top.P:.3f} {p_sign} "
        f"1/E = {1 / e:.3f})."
    )


def largest_aux_layer(trace) -> tuple[str, int]:
    """The (site, layer) with the largest auxiliary loss relative to its balanced value k: step 4's
    default."""
    ratio = {}
    for site, layer in trace.layer_keys:
        routing = trace.layer(layer, site)
        ratio[(site, layer)] = float(aux_terms(routing)["term"].sum()) / routing.k
    return max(ratio, key=lambda key: (ratio[key], -key[1]))


COLLAPSE_COLUMNS = ["site", "layer", "model", "busiest", "entropy", "dead"]


def collapse_layers(traces: dict) -> pd.DataFrame:
    """Step 5 (collapse): per layer of each model (`traces`: name → Trace, from the most to the least
    balancing training), the busiest expert's share of the slots, the normalised load entropy and the dead
    experts; columns COLLAPSE_COLUMNS, models in the dict's order."""
    rows = []
    for name, trace in traces.items():
        for site, layer in trace.layer_keys:
            s = balance_stats(trace.layer(layer, site))
            rows.append((site, layer, name, s.max_share, s.load_entropy, s.dead_experts))
    return pd.DataFrame(rows, columns=COLLAPSE_COLUMNS)


def _closest_pair(layer_rows: pd.DataFrame) -> tuple[str, str, float]:
    """Of a layer's models in order, the two consecutive ones whose load entropies are closest: (first,
    second, first's entropy − second's)."""
    names, entropy = layer_rows["model"].tolist(), layer_rows["entropy"].to_numpy()
    gaps = entropy[:-1] - entropy[1:]
    i = int(np.argmin(gaps))
    return names[i], names[i + 1], float(gaps[i])


def collapse_contrast_layer(frame: pd.DataFrame) -> tuple[str, int]:
    """The (site, layer) where the models differ most: the largest smallest entropy gap between consecutive
    models (so that no two of them look alike there) — step 5's default."""
    gaps = {key: _closest_pair(rows)[2] for key, rows in frame.groupby(["site", "layer"], sort=False)}
    return max(gaps, key=lambda key: (gaps[key], -key[1]))


def collapse_notice(
    frame: pd.DataFrame, site: str, layer: int, num_experts: int, *, tokens: int | None = None, k: int = 1
) -> str:
    """Step 5's line from `collapse_layers` at (site, layer): each model's busiest share and load entropy,
    whether the load gets less even in the models' order, and, when two models look alike here, the layer
    where they differ most — the comparison left out, and said why, when the layer's `tokens` (top-`k`)
    are too few for it (`too_few_tokens`)."""
    rows = frame[(frame["site"] == site) & (frame["layer"] == layer)]
    shares = ", ".join(f"{r.busiest:.0%} ({r.model})" for r in rows.itertuples())
    entropies = ", ".join(f"{r.entropy:.2f}" for r in rows.itertuples())
    text = (
        f"same text, same architecture, {len(rows)} trainings: at layer {layer} the busiest expert takes "
        f"{shares} of the slots, against a fair {_pct(1 / num_experts)}; load entropy {entropies} (1 = even)"
    )
    dead = [f"{r.dead} of {num_experts} experts dead in {r.model}" for r in rows.itertuples() if r.dead]
    text += f"; {', '.join(dead)}." if dead else "."
    short = too_few_tokens(tokens, num_experts, k)
    if short:
        return f"{text} But {short}"
    first, second, gap = _closest_pair(rows)
    if gap > 0:
        text += " The weaker the balancing, the less even the load."
    else:
        text += f" Here {second} is no less even than {first}."
    best_site, best = collapse_contrast_layer(frame)
    if (best_site, best) != (site, layer):
        best_rows = frame[(frame["site"] == best_site) & (frame["layer"] == best)].set_index("model")
        best_gap = float(best_rows.loc[first, "entropy"] - best_rows.loc[second, "entropy"])
        text += (
            f" {first.capitalize()} and {second} differ by {gap:.3f} in load entropy here, by {best_gap:.3f} "
            f"at layer {best}: the contrast is clearest there."
        )
    return text


BIAS_COLUMNS = ["site", "layer", "tokens", "changed", "entropy_with", "entropy_without"]


def bias_effect(routing: LayerRouting):
    """Step 6 (balancing with a bias): the layer's captured routing and the same router (group limit, weight
    rule) with the bias set to 0 → (RerouteResult, BalanceStats with the bias, BalanceStats without)."""
    without = reroute(routing, replace(RerouteSettings.captured(routing), bias=None))
    n, k = len(routing.token_rows), routing.k
    return without, balance_from_counts(without.captured_load, n, k), balance_from_counts(without.load, n, k)


def bias_layers(trace) -> pd.DataFrame:
    """Per biased layer of a trace, the tokens the bias moves and the load entropy with and without it;
    columns BIAS_COLUMNS (layers without a bias are left out)."""
    rows = []
    for site, layer in trace.layer_keys:
        routing = trace.layer(layer, site)
        if routing.bias is None:
            continue
        result, with_bias, no_bias = bias_effect(routing)
        rows.append(
            (
                site,
                layer,
                len(routing.token_rows),
                result.changed_tokens,
                with_bias.load_entropy,
                no_bias.load_entropy,
            )
        )
    return pd.DataFrame(rows, columns=BIAS_COLUMNS)


def bias_contrast_layer(frame: pd.DataFrame) -> tuple[str, int]:
    """The (site, layer) where the bias evens the load most (largest entropy with − without): step 6's
    default."""
    gain = frame["entropy_with"] - frame["entropy_without"]
    best = frame.loc[gain.idxmax()]
    return str(best.site), int(best.layer)


def bias_notice(changed: int, with_bias, no_bias, *, judge_length: bool = False) -> str:
    """Step 6's line from the two BalanceStats (with the bias = the model, without): the tokens moved, whether
    the bias evens the load (normalised entropy), and the quietest and busiest experts both ways — the
    busiest alone can move the other way, which the line then says. With `judge_length`, the load is only
    compared when the tokens are enough for it (`too_few_tokens`)."""
    n, slots = with_bias.tokens, with_bias.tokens * with_bias.top_k
    q_with, q_without = with_bias.counts.min() / slots, no_bias.counts.min() / slots
    b_with, b_without = with_bias.max_share, no_bias.max_share
    h_with, h_without = with_bias.load_entropy, no_bias.load_entropy
    text = (
        f"the bias only moves the choice, not the weights: without it {changed} of {n} tokens "
        f"({changed / n:.0%}) would go to other experts. "
    )
    short = too_few_tokens(n if judge_length else None, len(with_bias.counts), with_bias.top_k)
    if short:
        return text + f"Load entropy {h_with:.3f} with it, {h_without:.3f} without; but {short}"
    if h_with > h_without:
        text += f"With it the load is more even (load entropy {h_with:.3f} vs {h_without:.3f} without): "
    elif h_with < h_without:
        text += f"Here the load is less even with it (load entropy {h_with:.3f} vs {h_without:.3f} without): "
    else:
        text += f"Here it leaves the load as even as it was (load entropy {h_with:.3f}): "
    text += (
        f"the quietest expert gets {_pct(q_with)} of the slots with the bias, {_pct(q_without)} without; "
        f"the busiest takes {_pct(b_with)} with it, {_pct(b_without)} without."
    )
    if h_with > h_without and b_with >= b_without:
        text += " The busiest expert alone does not show the difference; the quietest does."
    elif h_with > h_without and q_with <= q_without:
        text += " The quietest expert alone does not show the difference; the busiest does."
    return text


def shared_notice(shares: pd.DataFrame, fraction: float) -> str:
    """Step 7 (shared experts), from `expert_token_share` and `shared_fraction`: the shared experts' share of
    the tokens against the routed experts' range, and their share of a token's expert weights."""
    shared = shares[shares["kind"] == "shared"]["share"]
    routed = shares[shares["kind"] == "routed"]["share"]
    every = " sees every token" if len(shared) == 1 else f"s (all {len(shared)}) see every token"
    return (
        f"the shared expert{every} ({shared.min():.0%}), each routed expert {routed.min():.0%}–"
        f"{routed.max():.0%} of them; the shared expert{'' if len(shared) == 1 else 's'} hold"
        f"{'s' if len(shared) == 1 else ''} {fraction:.0%} of the expert weights a token runs through."
    )


# ---- step 9: how many experts (the shipped sweep) -------------------------------------------------------
SWEEP_POINT_COLUMNS = ["k", "experts", "heldout_loss", "lowest", "highest", "seeds", "collapses"]


def sweep_points(sweep: pd.DataFrame) -> pd.DataFrame:
    """The experts sweep (docs/experts-sweep.csv: experts, k, heldout_loss, optionally seed and
    collapse_step) as one row per (k, experts): the mean held-out loss over seeds, the lowest and highest
    seed, the number of seeds, and the collapses recorded there ("seed 1 at step 41", …, "" for none);
    columns SWEEP_POINT_COLUMNS."""
    data = sweep.copy()
    if "seed" not in data:
        data["seed"] = np.arange(len(data))
    if "collapse_step" not in data:
        data["collapse_step"] = pd.NA
    rows = []
    for (k, experts), runs in data.groupby(["k", "experts"], sort=True):
        collapsed = runs[runs["collapse_step"].notna()]
        rows.append(
            {
                "k": int(k),
                "experts": int(experts),
                "heldout_loss": float(runs["heldout_loss"].mean()),
                "lowest": float(runs["heldout_loss"].min()),
                "highest": float(runs["heldout_loss"].max()),
                "seeds": len(runs),
                "collapses": ", ".join(
                    f"seed {int(r.seed)} at step {int(r.collapse_step)}" for r in collapsed.itertuples()
                ),
            }
        )
    return pd.DataFrame(rows, columns=SWEEP_POINT_COLUMNS)


def sweep_curve(points: pd.DataFrame, k: int) -> dict:
    """One k's curve of `sweep_points`: its shape against the seed noise. noise = the largest spread
    between seeds at any of its points (NaN with one seed each); shape: "flat" when the means span no more
    than the noise, else "rises" (lowest at the fewest experts), "falls" (highest at the fewest) or "dips"
    (lowest in between). → dict k, shape, span, noise, and the lowest and highest points (experts, loss)."""
    curve = points[points["k"] == k].sort_values("experts")
    means = curve["heldout_loss"].to_numpy()
    noise = float((curve["highest"] - curve["lowest"]).max()) if (curve["seeds"] > 1).all() else float("nan")
    span = float(means.max() - means.min())
    low, high = curve.iloc[int(np.argmin(means))], curve.iloc[int(np.argmax(means))]
    if span <= noise:
        shape = "flat"
    elif low.experts == curve["experts"].iloc[0]:
        shape = "rises"
    elif high.experts == curve["experts"].iloc[0]:
        shape = "falls"
    else:
        shape = "dips"
    return {
        "k": k,
        "shape": shape,
        "span": span,
        "noise": noise,
        "low": (int(low.experts), float(low.heldout_loss)),
        "high": (int(high.experts), float(high.heldout_loss)),
    }


def _experts(n: int) -> str:
    return f"{n} expert{'s' if n != 1 else ''}"


def _curve_text(curve: dict) -> str:
    """One k's curve in words: its shape, its ends, and the seed noise it was judged against."""
    (lo_e, lo), (hi_e, hi) = curve["low"], curve["high"]
    if np.isnan(curve["noise"]):
        noise = "one seed: no noise estimate"
    else:
        noise = f"seeds differ by up to {curve['noise']:.3f}"
    where = {
        "flat": f"is flat within seed noise ({lo:.3f}–{hi:.3f}, a span of {curve['span']:.3f}; {noise})",
        "rises": f"rises, from {lo:.3f} at {_experts(lo_e)} to {hi:.3f} at {_experts(hi_e)} ({noise})",
        "falls": f"falls, from {hi:.3f} at {_experts(hi_e)} to {lo:.3f} at {_experts(lo_e)} ({noise})",
        "dips": f"is lowest in between, {lo:.3f} at {_experts(lo_e)}, highest {hi:.3f} at {_experts(hi_e)} "
        f"({noise})",
    }[curve["shape"]]
    return f"k = {curve['k']} {where}"


def _k_comparison(points: pd.DataFrame) -> str:
    """k = 2 against k = 1 at the experts both were run with: which is lower, by how much, and whether by
    more than the seeds differ there ("" when the sweep has not both)."""
    wide = points.pivot(index="experts", columns="k", values="heldout_loss")
    if not {1, 2} <= set(wide.columns) or wide[[1, 2]].dropna().empty:
        return ""
    gain = (wide[1] - wide[2]).dropna()  # > 0: k = 2 is lower
    shared = points[points["experts"].isin(gain.index) & points["k"].isin([1, 2])]
    spread = float((shared["highest"] - shared["lowest"]).max()) if (shared["seeds"] > 1).all() else np.nan
    beyond = f", more than the seeds differ there (up to {spread:.3f})" if spread < gain.abs().min() else ""
    if (gain > 0).all():
        return f" At the same experts k = 2 beats k = 1 by {gain.min():.3f}–{gain.max():.3f}{beyond}."
    if (gain < 0).all():
        return f" At the same experts k = 1 beats k = 2 by {-gain.max():.3f}–{-gain.min():.3f}{beyond}."
    lower = int((gain > 0).sum())
    return f" Neither k wins everywhere: k = 2 is lower at {lower} of {len(gain)} numbers of experts."


def _collapse_text(sweep: pd.DataFrame, points: pd.DataFrame) -> str:
    """The collapses the sweep recorded (column collapse_step), where and when; "" when it has no such
    column."""
    if "collapse_step" not in sweep:
        return ""
    collapsed = points[points["collapses"] != ""]
    if collapsed.empty:
        return " No run collapsed."
    runs = int(sweep["collapse_step"].notna().sum())
    where = "; ".join(
        f"{_experts(int(r.experts))}, k = {int(r.k)} ({r.collapses})" for r in collapsed.itertuples()
    )
    return f" {runs} run{'s' if runs > 1 else ''} of {len(sweep)} collapsed (ringed on the chart): {where}."


def sweep_notice(sweep: pd.DataFrame) -> str:
    """Step 9's line from the sweep table: each k's curve (its shape against the seed noise), the lowest
    mean held-out loss, how k = 2 compares with k = 1 at the same experts, and the collapses recorded."""
    points = sweep_points(sweep)
    curves = [sweep_curve(points, int(k)) for k in sorted(points["k"].unique())]
    best = points.loc[points["heldout_loss"].idxmin()]
    text = "; ".join(_curve_text(c) for c in curves)
    where = f"{_experts(int(best.experts))} with k = {int(best.k)}"
    text += f". The lowest mean, {best.heldout_loss:.3f}, is at {where}"
    flat = {c["k"] for c in curves if c["shape"] == "flat"}
    text += ", inside the seed noise of its curve." if int(best.k) in flat else "."
    return text + _k_comparison(points) + _collapse_text(sweep, points)
