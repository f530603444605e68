"""One loaded model serves many sessions: concurrent captures each get exactly their own routing."""

from __future__ import annotations

import threading

import numpy as np

import moeviz

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b",
    "In the beginning God created the heaven and the earth.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10",
    '{"key": "value", "list": [1, 2, 3]}',
    "Routing collapse happens when one expert takes every token.",
    "import os, sys; print(sys.argv)",
    "A B C D E F G H I J K L M N O P",
]


def test_eight_threads_each_get_their_own_routing(sample_model):
    serial = [moeviz.capture(sample_model, text) for text in TEXTS]
    results: dict[int, moeviz.Trace] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(TEXTS))

    def work(i: int) -> None:
        try:
            start.wait()
            for _ in range(3):  # several rounds so forwards overlap
                results[i] = moeviz.capture(sample_model, TEXTS[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(TEXTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for i, expected in enumerate(serial):
        got = results[i]
        assert got.tokens.token_id.tolist() == expected.tokens.token_id.tolist()
        for g, e in zip(got.layers, expected.layers, strict=True):
            np.testing.assert_array_equal(g.experts, e.experts)
            np.testing.assert_allclose(g.logits, e.logits, atol=1e-5)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in sample_model.model.modules()) == 0
