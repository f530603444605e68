"""moeviz: a microscope for Mixture-of-Experts language models.

import moeviz
loaded = moeviz.load_model("sample:mixtral-healthy")
trace = moeviz.capture(loaded, "The quick brown fox")
trace.routing_frame()  # one row per (seq, pos, layer, rank)
"""

from moeviz.capture import capture
from moeviz.errors import MoevizError
from moeviz.models import LoadedModel, list_samples, load_model
from moeviz.trace import LayerRouting, ModelInfo, Trace

__all__ = [
    "LayerRouting",
    "LoadedModel",
    "ModelInfo",
    "MoevizError",
    "Trace",
    "capture",
    "list_samples",
    "load_model",
]
__version__ = "0.1.0"
