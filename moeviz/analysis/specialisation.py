"""Does routing follow the domain of the text? Mutual information between domain and top-1 expert.

I(D; E) = Σ p(d, e) log2 p(d, e) / (p(d) p(e)) over tokens, with E = the token's top-1 (rank 0) expert.
0 bits = routing ignores the domain; log2(#domains) = the domain alone decides the expert. The null
baseline shuffles the domain labels across tokens (same marginals): a value within its spread is noise.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moeviz.trace import LayerRouting, Trace


def mutual_information_bits(labels: np.ndarray, experts: np.ndarray) -> float:
    """I(labels; experts) in bits from paired integer samples [N]."""
    if len(labels) == 0:
        return 0.0
    _, label_codes = np.unique(labels, return_inverse=True)
    _, expert_codes = np.unique(experts, return_inverse=True)
    joint = np.zeros((label_codes.max() + 1, expert_codes.max() + 1))
    np.add.at(joint, (label_codes, expert_codes), 1)
    joint /= joint.sum()
    outer = joint.sum(1, keepdims=True) * joint.sum(0, keepdims=True)
    nonzero = joint > 0
    return float((joint[nonzero] * np.log2(joint[nonzero] / outer[nonzero])).sum())


def top1_domain_pairs(
    trace: Trace, routing: LayerRouting, seq_domains: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """(domain label [N], top-1 expert [N]) for the tokens of one layer; seq i has domain seq_domains[i]."""
    seqs = trace.tokens["seq"].to_numpy()[routing.token_rows]
    return np.asarray(seq_domains, dtype=object)[seqs], routing.experts[:, 0]


def domain_specialisation_frame(
    trace: Trace, seq_domains: list[str], shuffles: int = 20, seed: int = 0
) -> pd.DataFrame:
    """Per MoE layer: mi_bits, the shuffled-label baseline (mean and std) and mi_max = log2(#domains)."""
    rng = np.random.default_rng(seed)
    rows = []
    for routing in trace.layers:
        labels, experts = top1_domain_pairs(trace, routing, seq_domains)
        null = [mutual_information_bits(rng.permutation(labels), experts) for _ in range(shuffles)]
        rows.append(
            {
                "layer": routing.layer,
                "site": routing.site,
                "mi_bits": mutual_information_bits(labels, experts),
                "null_mean": float(np.mean(null)),
                "null_std": float(np.std(null)),
                "mi_max": float(np.log2(len(set(seq_domains)))),
            }
        )
    return pd.DataFrame(rows)
