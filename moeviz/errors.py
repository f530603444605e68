"""Errors moeviz raises for bad input. Each names what was wrong and what to do about it."""


class MoevizError(Exception):
    """Base class: every error a user can cause by bad input."""


class ModelSourceError(MoevizError):
    """The model source could not be opened as an MoE model."""


class ModelNotFoundError(ModelSourceError):
    pass


class NotAModelFolderError(ModelSourceError):
    pass


class UnknownSampleError(ModelSourceError):
    pass


class NotMoEModelError(ModelSourceError):
    pass


class UnsupportedModelError(ModelSourceError):
    """The model type is one moeviz refuses, for the reason its family table gives (a block-diffusion model,
    a token classifier)."""


class CorruptWeightsError(ModelSourceError):
    pass


class UnsafeWeightsError(ModelSourceError):
    pass


class CorruptTokenizerError(ModelSourceError):
    """The folder's tokenizer files exist but do not load (malformed tokenizer.json, ...)."""


class InvalidConfigError(NotAModelFolderError):
    """config.json declares sizes no model can have (a zero or negative size, top-k outside 1 … E), or more
    layers or experts than the weights hold."""


class InsufficientMemoryError(ModelSourceError):
    """The model (at the chosen dtype, plus activations) needs more memory than the device has free."""


class UnsupportedQuantizationError(ModelSourceError):
    """The checkpoint is quantised in a way transformers cannot run or dequantise on this machine."""


class LoadOptionError(ModelSourceError):
    """A load option is unusable: an unknown dtype, or a device this machine does not have."""


class InputError(MoevizError):
    """The text or token ids given for a capture are unusable."""


class PromptTooLongError(InputError):
    pass


class CheckpointSeriesError(InputError):
    """A checkpoint series that is not one training run: full checkpoints mixed with adapters, adapters of
    different bases, or adapters whose base is not given and not found."""


class CaptureError(MoevizError):
    """Hooks did not see what the model computed (e.g. a kernel replaced the forward)."""


class TraceFormatError(MoevizError):
    """A file is not a moeviz trace, or was written by an incompatible version."""


class EngineFormatError(MoevizError):
    """A file of engine routing (`moeviz import`) is not what its format's engine writes, or encodes routing
    that cannot be real (a token without exactly k distinct experts in [0, E), a shape the model's config
    contradicts, token ids that do not match its rows)."""


class StoreError(MoevizError):
    """The store folder is unusable: not a store, corrupt or foreign files, or a mismatched resume."""


class RunFileError(StoreError):
    """A run's run.json cannot be trusted: not a regular file, not JSON, damaged, or not of its schema."""


class SettingsError(MoevizError):
    """A `MOEVIZ_*` variable is set to a value moeviz cannot use."""


class LayoutError(NotMoEModelError):
    """The model's MoE layers differ in a way the importers do not handle (e.g. layers with different
    expert counts), or the model is an encoder-decoder (no engine serves one)."""


class VllmError(MoevizError):
    """vLLM could not give the routing: its environment is missing or broken, the worker died or hung, vLLM
    cannot run the model, or its router has no capture seam."""


class InterventionError(MoevizError):
    """An intervention cannot be applied: unknown layer or expert, or a family whose dispatch moeviz
    cannot rewrite."""


class NoEffectError(InterventionError):
    """The interventions cannot change anything on this input (e.g. disabling an expert no token of it is
    dispatched to): refused before the forward that would only report Δ = 0."""


class LabBusy(MoevizError):
    """The server already runs as many lab trainings (or as much lab memory) as it allows."""


class LabTooLarge(MoevizError):
    """A lab run would need more memory than the server allows lab runs altogether."""


class SnippetError(InputError):
    """A view's choices that no snippet can reproduce (an uploaded file has no path to read it from)."""
