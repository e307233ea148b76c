"""The load report: everything a load did not do as asked, nothing left out.

:class:`LoadReport` lists missing, unexpected and mismatched keys, routing conflicts and
conversion errors (each with the transform, the checkpoint keys and the targets involved),
and which parameters were memory-mapped rather than copied. It renders as text and as JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Mismatch", "ConversionFailure", "LoadReport"]


@dataclass(frozen=True)
class Mismatch:
    """A runtime key whose checkpoint tensor has another shape or dtype than the model's.

    A shape mismatch is not loaded; a dtype mismatch is loaded, cast to the model's dtype (and
    cast back when the model is saved in the original format).
    """

    key: str
    kind: str  # "shape" | "dtype"
    checkpoint: str
    model: str
    source_keys: tuple[str, ...] = ()
    loaded: bool = False

    def __str__(self) -> str:
        src = f" (from {', '.join(self.source_keys[:2])}{' ...' if len(self.source_keys) > 2 else ''})"
        what = "loaded with a cast" if self.loaded else "not loaded"
        return f"{self.key}: checkpoint {self.kind} {self.checkpoint} vs model {self.model}{src}; {what}"


@dataclass(frozen=True)
class ConversionFailure:
    """A converter (or a routing conflict) that could not produce its targets."""

    transform: str
    source_keys: tuple[str, ...]
    target_keys: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return (
            f"{self.transform}: {', '.join(self.target_keys[:2])} from "
            f"{', '.join(self.source_keys[:3])}{' ...' if len(self.source_keys) > 3 else ''}: {self.message}"
        )


@dataclass
class LoadReport:
    """What :func:`surgery.load_checkpoint` did.

    Attributes:
        checkpoint: the path that was loaded.
        loaded_keys: runtime keys that received a tensor.
        missing_keys: runtime keys the checkpoint did not provide (left as they were).
        unexpected_keys: checkpoint keys whose target is not in the model.
        mismatched: shape or dtype mismatches.
        conflicts: two checkpoint keys landing on one target (neither second one is loaded).
        conversion_errors: converters that failed, with transform, keys and message.
        mapped_keys: parameters memory-mapped from the file instead of copied.
        transforms_used: the transforms whose output was loaded.
        fusions: the fusion config applied before loading, if any.
        seconds: wall time of the load.
    """

    checkpoint: str = ""
    loaded_keys: list[str] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    mismatched: list[Mismatch] = field(default_factory=list)
    conflicts: list[ConversionFailure] = field(default_factory=list)
    conversion_errors: list[ConversionFailure] = field(default_factory=list)
    mapped_keys: list[str] = field(default_factory=list)
    transforms_used: list[str] = field(default_factory=list)
    fusions: dict[str, Any] | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when nothing was missing, unexpected, mismatched in shape, conflicting or failed."""
        return not (
            self.missing_keys
            or self.unexpected_keys
            or any(not m.loaded for m in self.mismatched)
            or self.conflicts
            or self.conversion_errors
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (machine-readable report)."""
        d = asdict(self)
        d["ok"] = self.ok
        return d

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [
            f"LoadReport({self.checkpoint}): {'OK' if self.ok else 'PROBLEMS'}; "
            f"{len(self.loaded_keys)} loaded ({len(self.mapped_keys)} memory-mapped) in {self.seconds:.3f}s"
        ]
        if self.fusions:
            lines.append(f"  fusions applied: {self.fusions}")

        def section(title: str, items: list[Any], limit: int = 20) -> None:
            if not items:
                return
            lines.append(f"  {title} ({len(items)}):")
            lines.extend(f"    - {item}" for item in items[:limit])
            if len(items) > limit:
                lines.append(f"    ... {len(items) - limit} more")

        section("missing keys (not in the checkpoint, left as they were)", self.missing_keys)
        section("unexpected keys (in the checkpoint, not in the model)", self.unexpected_keys)
        section("mismatched", self.mismatched)
        section("conflicts", self.conflicts)
        section("conversion errors", self.conversion_errors)
        section("transforms used", self.transforms_used, limit=10)
        return "\n".join(lines)
