"""The lab's data: the bundled sample corpus (`sample_models/eval/<domain>.txt`, the only text moeviz ships),
tokenised with the bundled sample tokenizer (the one of `sample:mixtral-healthy`, a 2,048-token byte-level
BPE), split per domain into a training part (the first 90% of its tokens) and a held-out part (the last
10%). Read and tokenised once per process.

Batches are drawn with a numpy Generator, so the same seed gives the same batches in the same order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeviz.errors import InputError
from moeviz.models.loading import sample_models_dir
from moeviz.samples import DOMAINS, eval_dir

TOKENIZER_SAMPLE = "mixtral-healthy"  # the sample whose tokenizer the lab uses
HELDOUT_FRACTION = 0.1
HELDOUT_WINDOWS = 4  # held-out windows per domain in the fixed evaluation batch

_LOCK = threading.Lock()
_CACHE: dict[str, LabCorpus] = {}


@dataclass(frozen=True)
class LabCorpus:
    """Token ids per domain: `train[domain]` and `heldout[domain]` (int64 arrays), and the tokenizer."""

    tokenizer: Any
    train: dict[str, np.ndarray]
    heldout: dict[str, np.ndarray]

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(self.train)

    def tokens(self) -> dict[str, tuple[int, int]]:
        """(training tokens, held-out tokens) per domain."""
        return {d: (len(self.train[d]), len(self.heldout[d])) for d in self.train}

    def train_batch(self, rng: np.random.Generator, batch: int, seq: int) -> torch.Tensor:
        """[batch, seq] random training windows; each row's domain is drawn uniformly (the domains differ
        in size), then its start."""
        rows = []
        for _ in range(batch):
            ids = self.train[self.domains[int(rng.integers(len(self.domains)))]]
            start = int(rng.integers(0, len(ids) - seq + 1))
            rows.append(ids[start : start + seq])
        return torch.from_numpy(np.stack(rows))

    def heldout_batch(self, seq: int) -> tuple[torch.Tensor, list[str]]:
        """The fixed evaluation batch: up to HELDOUT_WINDOWS evenly spaced windows of `seq` held-out tokens
        per domain, and the domain of each row."""
        rows, domains = [], []
        for domain, ids in self.heldout.items():
            fit = len(ids) // seq
            for i in np.linspace(0, fit - 1, min(HELDOUT_WINDOWS, fit)).round().astype(int):
                rows.append(ids[i * seq : (i + 1) * seq])
                domains.append(domain)
        return torch.from_numpy(np.stack(rows)), domains

    def check_seq(self, seq: int) -> None:
        short = min(min(len(ids) for ids in self.train.values()), min(len(i) for i in self.heldout.values()))
        if seq > short:
            raise InputError(f"lab: seq {seq} is longer than the shortest corpus part ({short} tokens)")


def lab_tokenizer():
    """The bundled sample tokenizer (offline)."""
    from transformers import AutoTokenizer

    folder = sample_models_dir() / TOKENIZER_SAMPLE
    if not (folder / "tokenizer.json").is_file():
        raise InputError(f"the lab needs the bundled sample tokenizer: {folder}/tokenizer.json is missing")
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def lab_corpus() -> LabCorpus:
    """The tokenised, split sample corpus (cached per process and per sample folder)."""
    key = str(eval_dir())
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _build()
        return _CACHE[key]


def _build() -> LabCorpus:
    tokenizer = lab_tokenizer()
    train, heldout = {}, {}
    for domain in DOMAINS:
        path = eval_dir() / f"{domain}.txt"
        if not path.is_file():
            raise InputError(f"the lab's corpus slice {path} is missing")
        ids = np.asarray(tokenizer(path.read_text(encoding="utf-8"))["input_ids"], dtype=np.int64)
        cut = round(len(ids) * (1 - HELDOUT_FRACTION))
        train[domain], heldout[domain] = ids[:cut], ids[cut:]
    return LabCorpus(tokenizer, train, heldout)
