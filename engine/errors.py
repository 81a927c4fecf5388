"""The engine's error hierarchy: one base type, one subtype per kind of failure a caller can act on."""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelFormatError(EngineError):
    """The GGUF file is truncated, corrupt, or inconsistent with itself."""


class UnsupportedModel(EngineError):
    """The file is a valid GGUF but holds an architecture or tensor type this engine does not run."""


class RangeError(EngineError):
    """A layer range, slot, or position lies outside what the model or the stage holds."""
