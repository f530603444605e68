"""Hooks installed for one call, and the Trace they produce."""

from moeviz.capture.routing import capture

__all__ = ["capture"]
