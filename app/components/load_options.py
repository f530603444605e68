"""How the app loads a model: dtype, device, a device map and a PEFT adapter folder (the model picker's
"Advanced" expander), and the model key that carries them. No Streamlit here.

The app keys every model cache and capture on a *model key*: the source alone for the default options (so
the keys are the sources they always were), else the source, `KEY_MARK` and the non-default options as JSON.
A bfloat16 and a float32 load of one source therefore never share a model, a capture or a trace.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from components import access, warmup
from moeviz.errors import LoadOptionError

DTYPES = ["auto", "float32", "bfloat16", "float16"]
DEVICE_MAPS = ["none", "auto"]
KEY_MARK = " ⚙ "  # between the source and its options in a model key
_SIZE = re.compile(r"^\d+(\.\d+)?\s*([KMGT]i?B|B)?$", re.IGNORECASE)


def devices() -> list[str]:
    """The device choices: auto, the CPU and the devices torch reports available here — once torch is
    imported (`warmup`): the first page is drawn before, with auto and the CPU alone."""
    return ["auto", "cpu", *warmup.accelerators()]


@dataclass(frozen=True)
class LoadOptions:
    """The picker's options as typed (strings); `load_kwargs` checks and converts them."""

    dtype: str = "auto"
    device: str = "auto"
    device_map: str = "none"
    offload_folder: str = ""
    max_memory: str = ""
    adapter: str = ""  # a LoRA adapter folder merged over the model (`moeviz.load_model(adapter=...)`)

    def changed(self) -> dict[str, str]:
        """The options that differ from the defaults."""
        default = asdict(LoadOptions())
        return {name: value for name, value in asdict(self).items() if value != default[name]}

    def key(self, source: str) -> str:
        """The model key of `source` loaded with these options (the source itself for the defaults)."""
        changed = self.changed()
        return source if not changed else source + KEY_MARK + json.dumps(changed, sort_keys=True)

    def label(self) -> str:
        """The non-default options in words ("" for the defaults)."""
        return ", ".join(f"{name}={value}" for name, value in self.changed().items())

    def load_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `moeviz.load_model`; LoadOptionError (or FolderNotAllowedError for an
        adapter or offload folder outside MOEVIZ_MODEL_DIRS) for a value it cannot use."""
        if self.dtype not in DTYPES:
            raise LoadOptionError(f"unknown dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.device_map not in DEVICE_MAPS:
            raise LoadOptionError(f"unknown device map {self.device_map!r}: use none or auto")
        kwargs: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        if self.adapter.strip():  # checked against the model folders' allowlist, as a model folder is
            kwargs["adapter"] = str(access.folder_inside(self.adapter.strip(), "model"))
        folder, budget = self.offload_folder.strip(), self.max_memory.strip()
        if self.device_map == "none":
            if folder or budget:
                raise LoadOptionError("an offload folder and a max memory need device map 'auto'")
            return kwargs
        kwargs["device_map"] = self.device_map
        if folder:
            kwargs["offload_folder"] = str(access.folder_inside(folder, "model"))
        if budget:
            kwargs["max_memory"] = parse_max_memory(budget)
        return kwargs


def parse_max_memory(text: str) -> dict[int | str, str]:
    """`"0=70GiB, cpu=8GiB"` → {0: "70GiB", "cpu": "8GiB"}; LoadOptionError for anything else."""
    budget: dict[int | str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        device, sep, size = (s.strip() for s in part.partition("="))
        if not sep or not device or not _SIZE.match(size):
            raise LoadOptionError(
                f"max memory takes DEVICE=SIZE pairs such as cpu=2GiB or 0=70GiB,cpu=8GiB; got {part!r}"
            )
        budget[int(device) if device.isdigit() else device] = size.replace(" ", "")
    return budget


def split_key(key: str) -> tuple[str, LoadOptions]:
    """A model key → (source, options); the inverse of `LoadOptions.key`."""
    source, mark, options = key.partition(KEY_MARK)
    if not mark:
        return key, LoadOptions()
    return source, LoadOptions(**json.loads(options))


def source_of(key: str) -> str:
    """The source part of a model key."""
    return split_key(key)[0]
