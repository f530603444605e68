"""Hooks installed for one call, and the Trace they produce."""

from moeviz.capture.forward import RoutingWarning, capture, routing_warning

__all__ = ["RoutingWarning", "capture", "routing_warning"]
