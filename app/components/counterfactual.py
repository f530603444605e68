"""The three next-token metrics of a counterfactual run (the Why and playground pages)."""

import streamlit as st

from moeviz.interventions import Counterfactual


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
