"""The CLI's progress display: a tqdm bar on a terminal, one line per stage anywhere else.

A bar redraws itself on every update; written into a file or a pipe (CI logs, `2> log`), that is hundreds of
carriage-return frames. Off a terminal, `progress_bar` prints a line when the stage changes instead.
"""

from __future__ import annotations

import re
import sys
from typing import Any, TextIO

_NUMBER = re.compile(r"\d+")


class StageLines:
    """tqdm's interface, as the CLI uses it, written as one line per stage: `desc: postfix` each time the
    postfix changes other than in its numbers (MiB loaded is one stage, printed when it starts); a bar
    without stages writes one line when it closes (`desc: n/total unit`)."""

    def __init__(self, desc: str, file: TextIO, total: int, unit: str) -> None:
        self.desc, self.file, self.total, self.unit = desc, file, total, unit
        self.n, self._closed = 0, False
        self._stage: str | None = None

    def __enter__(self) -> StageLines:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def set_postfix_str(self, text: str) -> None:
        stage = _NUMBER.sub("#", text)
        if stage != self._stage:
            self._stage = stage
            print(f"{self.desc}: {text}", file=self.file, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        if self._stage is None and not self._closed:
            print(f"{self.desc}: {self.n:,}/{self.total:,} {self.unit}", file=self.file, flush=True)
        self._closed = True


def progress_bar(*, total: int, desc: str, unit: str = "it", file: TextIO | None = None, **options: Any):
    """A tqdm bar on stderr when it is a terminal, else `StageLines` (same calls, one line per stage)."""
    stream = sys.stderr if file is None else file
    if not stream.isatty():
        return StageLines(desc, stream, total, unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=stream, leave=False, **options)
