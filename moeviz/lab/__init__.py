"""The lab: train a small Mixtral-style MoE on the bundled sample corpus and watch its routing evolve.

`LabConfig` (and `PRESETS`) say what to train, `LabRun` trains it step by step and records the history,
`LabRunner` runs it in a background thread with pause / resume / stop under a server-wide limit (`LabBusy`).
No Streamlit here: the Lab page drives these.
"""

from moeviz.lab.config import PRESETS, LabConfig
from moeviz.lab.runner import MAX_RUNS, LabBusy, LabRunner, LabTooLarge, max_runs
from moeviz.lab.train import HISTORY_COLUMNS, LOAD_COLUMNS, LabRun

__all__ = [
    "HISTORY_COLUMNS",
    "LOAD_COLUMNS",
    "MAX_RUNS",
    "PRESETS",
    "LabBusy",
    "LabConfig",
    "LabRun",
    "LabRunner",
    "LabTooLarge",
    "max_runs",
]
