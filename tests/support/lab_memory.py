"""Run as a script: build a LabRun for the JSON LabConfig fields in argv[1], train two steps, and print the
peak resident memory the run added (bytes) and moeviz's estimate, as JSON.

The peak is the kernel's VmHWM of this process: ru_maxrss would not do, since Linux keeps it across
execve, so a child of a large test worker would start from the worker's peak."""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path

import torch

from moeviz.lab.budget import memory_estimate
from moeviz.lab.config import LabConfig
from moeviz.lab.data import lab_corpus
from moeviz.lab.train import LabRun


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024


def main() -> None:
    torch.set_num_threads(1)
    config = LabConfig(**json.loads(sys.argv[1]))
    corpus = lab_corpus()
    gc.collect()
    before = peak_rss()
    run = LabRun(config)
    run.step()
    run.step()
    added = peak_rss() - before
    print(json.dumps({"measured": added, "estimate": memory_estimate(config, corpus.vocab_size).total}))


if __name__ == "__main__":
    main()
