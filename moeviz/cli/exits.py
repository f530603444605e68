"""How a `moeviz` command ends: its exit code and, when it fails, the one line it prints on stderr.

Exit codes: 0 success, 2 bad flags or bad input (nothing written), 3 `report --fail-on` verdict reached,
130 interrupted (Ctrl-C), 1 an unexpected failure (a traceback).
"""

from __future__ import annotations

import argparse
import errno
import os

EXIT_BAD_INPUT = 2
EXIT_VERDICT = 3  # `report --fail-on`: the routing verdict reached the given level
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT): every command that can be interrupted exits with it
# a full disk, a quota, an unwritable or read-only output: exit 2 with one line, not a traceback
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR}

# transformers' trailing advice points at a report the one-line refusal does not show; say what it means
_MISMATCH = "You set `ignore_mismatched_sizes` to `False`, thus raising an error. "
_TRANSFORMERS_ADVICE = {
    f"{_MISMATCH}For details look at the above report!": "some weights have other shapes than config.json "
    "declares (the MISMATCH rows of the load report above)",
    "We encountered some issues during automatic conversion of the weights. For details look at the "
    "`CONVERSION` entries of the above report!": "transformers could not convert some weights (the "
    "CONVERSION rows of the load report above)",
    "You may consider adding `ignore_mismatched_sizes=True` to `from_pretrained(...)` if appropriate.": "",
    "For details look at the above report!": "",
}


def one_line(message: str) -> str:
    """A refusal on one line: transformers' advice replaced by what it means, line breaks folded."""
    for advice, meaning in _TRANSFORMERS_ADVICE.items():
        message = message.replace(advice, meaning)
    return " ".join(message.split()).rstrip(" :;")


def environment_message(args: argparse.Namespace | None, exc: OSError) -> str:
    """One line for a full disk or an unwritable output (a traceback would only say where it was noticed)."""
    where = f" ({exc.filename})" if exc.filename else ""
    out = getattr(args, "out", None) or getattr(args, "store", None)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        if getattr(args, "command", None) == "trace":
            return f"no space left on device; continue with --resume once there is room{where}"
        return f"no space left on device{f' writing {out}' if out else ''}{where}; nothing was written"
    reason = (exc.strerror or (os.strerror(exc.errno) if exc.errno is not None else str(exc))).lower()
    return f"cannot write {out}: {reason}{where}" if out else f"{reason}{where}"
