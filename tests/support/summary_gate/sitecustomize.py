"""Test hook for a served app: holds back every attention summary until the test lets it through.

A browser test puts this folder first on the app server's PYTHONPATH, so Python imports this module at the
server's start (`sitecustomize`), and sets ATTENTION_SUMMARY_GATE to a file path. Until that file exists,
`AttentionCapture.token_statistics` (what every per-layer summary of the Attention page goes through: the
head grid, the map's metrics, the KV-cache what-if) waits; it then computes as usual. What the page draws
while the gate is shut is what it draws before any summary. A missing file never hangs the server for
good: the wait gives up after GIVE_UP_S. Nothing here is imported by the app or the library themselves.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

GIVE_UP_S = 300.0
_gate = os.environ.get("ATTENTION_SUMMARY_GATE")

if _gate:
    from moeviz.attention import maps

    _real = maps.AttentionCapture.token_statistics

    def _gated(self, layer, window, global_tokens, geometry=None):
        deadline = time.monotonic() + GIVE_UP_S
        while not Path(_gate).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return _real(self, layer, window, global_tokens, geometry)

    maps.AttentionCapture.token_statistics = _gated
