"""The lab's configuration without training (moeviz.lab): validation messages, the presets' stories by
configuration, and the capacity keep rule against the library's ranking. Training runs:
tests/models/test_lab.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moeviz.errors import InputError
from moeviz.lab import PRESETS, LabConfig
from moeviz.lab.train import capacity_keep
from moeviz.scoring import capacity_ranks, expert_capacity


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"experts": 0}, "experts must be 1 … 64"),
        ({"experts": 65}, "experts must be 1 … 64"),
        ({"experts": 4, "k": 5}, "k must be at most the number of experts (4)"),
        ({"experts": 1, "k": 2}, "dense model: k = 1"),
        ({"experts": True}, "experts must be a whole number"),
        ({"aux_coef": math.nan}, "aux_coef must be a finite number"),
        ({"aux_coef": -2.0}, "aux_coef must be -1 … 1"),
        ({"capacity_factor": 0.0}, "capacity_factor must be"),
        ({"d_model": 60}, "d_model must be a multiple of 8"),
        ({"steps": 0}, "steps must be 1 …"),
        ({"lr": "0.1"}, "lr must be a finite number"),
    ],
)
def test_config_validation(fields, needle):
    with pytest.raises(InputError, match="lab: ") as error:
        LabConfig(**fields)
    assert needle in str(error.value)


def test_presets_tell_their_stories_by_configuration():
    assert PRESETS["healthy"].aux_coef > 0
    assert PRESETS["hub experts"].aux_coef == 0
    assert PRESETS["collapse"].aux_coef < 0
    assert LabConfig(aux_coef=0.0, capacity_factor=None).label() == "E=8 k=2 aux=0 seed=0"


def test_capacity_keep_is_the_library_ranking():
    """The Lab's torch capacity (`capacity_keep`) keeps exactly the slots `moeviz.scoring.capacity_ranks`
    ranks below the capacity, with the router probability of each slot as its priority."""
    generator = torch.Generator().manual_seed(5)
    seq, k, experts, sequences = 16, 2, 4, 3
    probs = torch.softmax(2 * torch.randn(sequences * seq, experts, generator=generator), dim=-1)
    indices = torch.topk(probs, k, dim=-1).indices
    for factor in (0.5, 0.75, 1.0):
        keep = capacity_keep(indices, probs, seq, factor).reshape(-1).numpy()
        group = np.repeat(np.arange(sequences * seq) // seq, k)
        cell = group * experts + indices.reshape(-1).numpy()
        priority = probs.gather(1, indices).reshape(-1).numpy()
        cap = max(1, expert_capacity(seq, k, experts, factor))
        np.testing.assert_array_equal(keep, capacity_ranks(cell, priority) < cap)
        assert not keep.all()
