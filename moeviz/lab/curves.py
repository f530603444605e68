"""The Lab's runs view as numbers: several runs' per-step curves in one tidy frame, smoothed as TensorBoard
smooths its scalars (an exponential moving average, debiased), so a page or a script can overlay runs on
shared axes and export them as CSV. No charts and no Streamlit here (`moeviz.charts.lab` draws them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

# The per-step curves of `LabRun.history()` a runs view overlays (in this order).
CURVE_METRICS = (
    "train_loss",
    "heldout_loss",
    "load_entropy",
    "dead_experts_window_sum",
    "z_loss",
    "aux_loss_megatron",
)
CURVE_COLUMNS = ["run", "metric", "step", "value", "smoothed"]
MAX_SMOOTHING = 0.99  # an EMA weight of 1 would never move from its first value


def ema_smooth(values: Sequence[float] | np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's scalar smoothing of one curve [N] → [N]: an exponential moving average with weight
    `weight` (0 = the raw curve, → 1 = ever smoother), debiased so that its start is not pulled towards 0
    (s_n = Σ_i w^(n−i) x_i / Σ_i w^(n−i) over the finite points so far). Non-finite points are left as they
    are and skipped; a constant curve is returned unchanged (TensorBoard does both)."""
    if not 0.0 <= weight <= MAX_SMOOTHING:
        raise ValueError(f"smoothing must be 0 … {MAX_SMOOTHING}, got {weight}")
    raw = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(raw)
    smoothed = raw.copy()
    if weight == 0.0 or not finite.any() or np.all(raw[finite] == raw[finite][0]):
        return smoothed
    # pandas' adjusted EWM is exactly the debiased form: Σ (1−α)^(n−i) x_i / Σ (1−α)^(n−i), α = 1 − w
    smoothed[finite] = pd.Series(raw[finite]).ewm(alpha=1.0 - weight, adjust=True).mean().to_numpy()
    return smoothed


def with_smoothed(history: pd.DataFrame, columns: Sequence[str], smoothing: float) -> pd.DataFrame:
    """`history` (one run's frame) with a `<column>_smoothed` column beside each of `columns` (`ema_smooth`
    over the column's own points: NaN steps stay NaN), for the single-run charts; `history` itself,
    unchanged, when `smoothing` is 0."""
    if not smoothing:
        return history
    frame = history.copy()
    for column in columns:
        frame[f"{column}_smoothed"] = ema_smooth(
            pd.to_numeric(history[column], errors="coerce").to_numpy(dtype=np.float64), smoothing
        )
    return frame


def runs_curves(
    histories: Mapping[str, pd.DataFrame],
    metrics: Sequence[str] = CURVE_METRICS,
    smoothing: float = 0.0,
) -> pd.DataFrame:
    """Several runs' curves in long form, one row per (run, metric, step) where the metric has a value:
    CURVE_COLUMNS = run, metric, step, value, smoothed (`ema_smooth` of each run's metric over its own
    points: the held-out loss is smoothed over its evaluations, not over the NaN steps between them).

    histories: run name → `LabRun.history()` (step and the metric columns; a run lacking a metric just has
    no rows for it). Rows come in the order of `histories`, then `metrics`, then step."""
    parts = []
    for run, history in histories.items():
        for metric in metrics:
            if metric not in history.columns:
                continue
            values = pd.to_numeric(history[metric], errors="coerce").to_numpy(dtype=np.float64)
            has_value = np.isfinite(values)
            if not has_value.any():
                continue
            steps = history["step"].to_numpy()[has_value]
            kept = values[has_value]
            parts.append(
                pd.DataFrame(
                    {
                        "run": run,
                        "metric": metric,
                        "step": steps.astype(np.int64),
                        "value": kept,
                        "smoothed": ema_smooth(kept, smoothing),
                    }
                )
            )
    if not parts:
        return pd.DataFrame({name: pd.Series(dtype=_DTYPES[name]) for name in CURVE_COLUMNS})
    return pd.concat(parts, ignore_index=True)[CURVE_COLUMNS]


_DTYPES = {"run": object, "metric": object, "step": np.int64, "value": np.float64, "smoothed": np.float64}
