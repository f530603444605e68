"""The three next-token metrics of a counterfactual run (the Why and playground pages), and what the
long model-running actions show before and while they run: their cost estimate, and a progress bar that
is updated between decoder layers (where Streamlit's Stop takes effect)."""

import functools
import time
from collections.abc import Callable, Sequence

import streamlit as st

import moeviz
from moeviz.capture.forward import token_batch
from moeviz.interventions import Counterfactual
from moeviz.interventions.cost import CostEstimate, ForwardTiming, sampled_seconds, time_forward
from moeviz.whatif.quant import fake_quantise, target_weights

PROGRESS_EVERY_S = 0.1  # a bar update (and so a chance to stop) at most this often: no flood of messages


@st.cache_resource(show_spinner="Timing one forward of the model for the cost estimates…", max_entries=16)
def forward_timing(source: str, _loaded: moeviz.LoadedModel, _token_ids: Sequence[int]) -> ForwardTiming:
    """One timed forward of the model of `source` on the first input it is asked for, kept per model and
    shared by all sessions: the per-token price of every estimate on that model."""
    return time_forward(_loaded, _token_ids)


@st.cache_resource(show_spinner=False, max_entries=16)
def quantise_seconds(source: str, _loaded: moeviz.LoadedModel, dtype: str, target: str) -> float:
    """Seconds fake-quantising the `target` weights of `source`'s model to `dtype` takes, from a timed
    sample of them (`sampled_seconds`)."""
    work = [
        (t.param, functools.partial(fake_quantise, dtype=dtype, input_dim=t.input_dim))
        for t in target_weights(_loaded.model, _loaded.sites, target)
    ]
    return sampled_seconds(work)


def rerun_ids(
    loaded: moeviz.LoadedModel, text: str | None = None, token_ids: Sequence[Sequence[int]] | None = None
) -> list[list[int]] | None:
    """The sequences a model-running action will run (the Deployment page's `RerunInput.kwargs`), or None
    where the input is unusable (the action itself then says why)."""
    try:
        return token_batch(loaded, text, token_ids)
    except moeviz.MoevizError:
        return None


def cost_line(estimate: CostEstimate, timing: ForwardTiming) -> str:
    """'Cost: 2 forwards (56 tokens) ≈ 0.1 s (one forward of 28 tokens took 0.05 s on this model).'"""
    return f"Cost: {estimate} ({timing.describe()} on this model)."


def progress_bar(text: str) -> tuple[Callable[[float, str], None], "st.delta_generator.DeltaGenerator"]:
    """A progress bar and its `progress(fraction, message)` callback for `layer_progress`: it redraws at
    most every PROGRESS_EVERY_S (and at the end); each redraw is where Streamlit's Stop or a rerun ends the
    run, so a long action stops within one decoder layer."""
    bar = st.progress(0.0, text=text)
    last = [0.0]

    def update(fraction: float, message: str) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S or fraction >= 1.0:
            last[0] = now
            bar.progress(min(max(fraction, 0.0), 1.0), text=message)

    return update, bar


def next_token_metrics(cf: Counterfactual, *, mean_label: str, mean_help: str, no_later: str) -> None:
    """log p of the prompt's next token after the change, the predicted token, and the mean Δ log p over
    the positions the change can reach (`no_later`: the delta text when there is none), in one row that
    wraps on a narrow screen."""
    row = st.container(horizontal=True, gap="large")
    row.metric(
        f"log p({cf.next_token!r}) after the prompt",
        f"{cf.next_logprob_after:.4f}",
        f"{cf.next_logprob_change:+.4f}",
        width="content",
    )
    row.metric(
        "Predicted next token",
        repr(cf.next_token_after),
        "changed" if cf.next_id_after != cf.next_id else "same",
        delta_color="off",
        delta_arrow="off",  # a word, not a rise: an arrow would read "↑ same"
        width="content",
    )
    row.metric(
        mean_label,
        f"{cf.mean_delta_after:+.4f}" if len(cf.deltas_after) else "—",
        f"max |Δ| {cf.max_abs_delta_after:.4f}" if len(cf.deltas_after) else no_later,
        delta_color="off",
        delta_arrow="off",
        width="content",
        help=mean_help,
    )
