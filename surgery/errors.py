"""One exception hierarchy for everything `surgery` raises on purpose.

Every error the library raises deliberately derives from :class:`SurgeryError`, so callers
can catch one type. Messages name the key, pattern, file or module path involved and end
with how to fix the problem.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigurationError",
    "ConversionError",
    "FusionConflictError",
    "FusionError",
    "ImmutableError",
    "LoadError",
    "PatternError",
    "RegistryError",
    "SurgeryError",
]


class SurgeryError(Exception):
    """Base class of every error raised deliberately by `surgery`."""


class ConfigurationError(SurgeryError, ValueError):
    """A mapping, transform list or option is inconsistent (e.g. two converters claim one key)."""


class PatternError(ConfigurationError):
    """A source or target pattern is invalid: bad regex, dangling back-reference, not reversible."""


class RegistryError(ConfigurationError, KeyError):
    """A registry lookup missed, or a registration collided with an existing entry."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class ImmutableError(SurgeryError, AttributeError):
    """An attribute of a value object (a :class:`~surgery.WeightTransform`) was assigned after construction."""


class ConversionError(SurgeryError):
    """A `ConversionOp` could not run on the tensors it was given (shape, count, dtype)."""


class CheckpointError(SurgeryError, OSError):
    """A checkpoint file or index is missing, corrupt, unsafe or inconsistent."""


class LoadError(SurgeryError):
    """A strict load found problems; ``report`` holds the full :class:`~surgery.LoadReport`."""

    def __init__(self, message: str, report: object | None = None) -> None:
        super().__init__(message)
        self.report = report


class FusionError(SurgeryError):
    """A fusion config is invalid, or a rewrite could not be applied."""


class FusionConflictError(FusionError, ConfigurationError):
    """A fusion's weight transforms and the model's conversion mapping claim the same checkpoint key.

    Both a :class:`FusionError` (a fusion cannot be loaded through) and a
    :class:`ConfigurationError` (two converters claim one key).
    """
