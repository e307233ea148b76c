"""The load report: everything a load did not do as asked, nothing left out.

:class:`LoadReport` lists missing, unexpected and mismatched keys, routing conflicts and
conversion errors (each with the transform, the checkpoint keys and the targets involved),
and which parameters were memory-mapped rather than copied. It renders as text and as JSON,
and reads back from JSON (:meth:`LoadReport.from_json`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError

if TYPE_CHECKING:
    from .plan import LoadPlan

__all__ = ["ConversionFailure", "LoadReport", "Mismatch", "TPFallback"]


@dataclass(frozen=True)
class Mismatch:
    """A runtime key whose checkpoint tensor has another shape or dtype than the model's.

    A shape mismatch is not loaded; a dtype mismatch is loaded, cast to the model's dtype (and
    cast back when the model is saved in the original format). A cast that can change values
    (``lossy``: float32 → bfloat16, float → integer, int64 → int32, ...) makes the report not
    ``ok``, so ``strict=True`` refuses it before anything is read; pass ``dtype=`` to ask for it.
    Only a lossless cast comes back bit for bit on save.
    """

    key: str
    kind: str  # "shape" | "dtype"
    checkpoint: str
    model: str
    source_keys: tuple[str, ...] = ()
    loaded: bool = False
    lossy: bool = False

    def __str__(self) -> str:
        src = f" (from {', '.join(self.source_keys[:2])}{' ...' if len(self.source_keys) > 2 else ''})"
        what = (
            ("loaded with a lossy cast" if self.lossy else "loaded with a cast")
            if self.loaded
            else "not loaded"
        )
        return f"{self.key}: checkpoint {self.kind} {self.checkpoint} vs model {self.model}{src}; {what}"


@dataclass(frozen=True)
class ConversionFailure:
    """A converter (or a routing conflict) that could not produce its targets.

    Attributes:
        transform: the converter (``repr``), ``"routing"`` for a conflict, ``"read"`` for a plain
            tensor that could not be read.
        source_keys: the checkpoint keys involved.
        target_keys: the runtime keys that were not loaded.
        message: what went wrong and how to fix it.
    """

    transform: str
    source_keys: tuple[str, ...]
    target_keys: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return (
            f"{self.transform}: {', '.join(self.target_keys[:2])} from "
            f"{', '.join(self.source_keys[:3])}{' ...' if len(self.source_keys) > 3 else ''}: {self.message}"
        )


@dataclass(frozen=True)
class TPFallback:
    """A tensor-parallel target whose sources were read whole: an op had no slice rule.

    Attributes:
        target_keys: the runtime keys.
        op: the op (``repr``) that has no rule for the rank's region.
        extra_bytes: bytes read beyond what the rank keeps.
    """

    target_keys: tuple[str, ...]
    op: str
    extra_bytes: int

    def __str__(self) -> str:
        return f"{', '.join(self.target_keys[:2])}: read whole ({self.extra_bytes} extra bytes) because of {self.op}"


@dataclass
class LoadReport:
    """What :func:`surgery.load_checkpoint` did.

    Attributes:
        checkpoint: the path that was loaded.
        loaded_keys: runtime keys that received a tensor (in the model's order).
        missing_keys: runtime keys the checkpoint does not provide (left as they were: still on
            ``meta`` for a model built there).
        unexpected_keys: checkpoint keys whose target is not in the model.
        mismatched: shape or dtype mismatches.
        conflicts: checkpoint keys landing on one target (none of them is loaded).
        conversion_errors: converters that failed, with transform, keys and message.
        mapped_keys: parameters memory-mapped from the file instead of copied.
        transforms_used: the transforms whose output was loaded.
        decoded_keys: checkpoint keys stored quantized that a quantizer decoded to floats on read
            (with their scales), for the targets that were loaded, in checkpoint order.
        fusions: the fusion config applied before loading, if any.
        bytes_read: bytes of tensor data read (or mapped) from the checkpoint by this process.
        staged_bytes: of those, the bytes that went through the staging ring to their device
            (``load_checkpoint(..., staging_bytes=)``; 0 when reads went straight to their destinations).
        kernels: per ``"<module class> on <device>: <forward>"``, how many quantized modules run
            it (an FP8 block-scaled matmul, an int8 or int4 kernel, or decode + ``F.linear``:
            :func:`~surgery.quantization.kernels.kernel_summary`).
        tp_world_size / tp_rank: the tensor-parallel mesh size and this rank (``None`` if not parallel).
        tp_fallbacks: targets read whole because an op had no slice rule (:class:`TPFallback`).
        notes: what the load decided not to do, and why (e.g. a persisted fusion config it did
            not trust).
        left_on_meta: parameters and buffers still on ``meta`` after the load (no data: the model
            cannot run). Non-persistent buffers are never in a checkpoint; build the model with
            :func:`surgery.init_empty` so they are computed for real.
        seconds: wall time of the load.
        plan: the :class:`~surgery.LoadPlan` that was executed (not part of the JSON form).
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
    decoded_keys: list[str] = field(default_factory=list)
    fusions: dict[str, Any] | None = None
    bytes_read: int = 0
    staged_bytes: int = 0
    kernels: dict[str, int] = field(default_factory=dict)
    tp_world_size: int | None = None
    tp_rank: int | None = None
    tp_fallbacks: list[TPFallback] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    left_on_meta: list[str] = field(default_factory=list)
    seconds: float = 0.0
    plan: LoadPlan | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """True when nothing was missing, unexpected, mismatched in shape, cast lossily, conflicting or failed."""
        return not (
            self.missing_keys
            or self.unexpected_keys
            or any(not m.loaded or m.lossy for m in self.mismatched)
            or self.conflicts
            or self.conversion_errors
            or self.left_on_meta
        )

    def summary(self) -> str:
        """One line: OK, or how many keys of each kind of problem (``str()`` lists them).

        Example:
            >>> LoadReport(checkpoint="ckpt", missing_keys=["a", "b"], unexpected_keys=["c"]).summary()
            'ckpt: 0 loaded; PROBLEMS: 2 missing, 1 unexpected'
        """
        counts = {
            "missing": len(self.missing_keys),
            "unexpected": len(self.unexpected_keys),
            "mismatched": sum(1 for m in self.mismatched if not m.loaded or m.lossy),
            "conflicting": len(self.conflicts),
            "conversion errors": len(self.conversion_errors),
            "left on meta": len(self.left_on_meta),
        }
        problems = ", ".join(f"{n} {what}" for what, n in counts.items() if n)
        return f"{self.checkpoint}: {len(self.loaded_keys)} loaded; {f'PROBLEMS: {problems}' if problems else 'OK'}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (machine-readable report); :meth:`from_dict` reads it back."""
        d: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "plan":
                continue
            value = getattr(self, f.name)
            if f.name in ("mismatched", "conflicts", "conversion_errors", "tp_fallbacks"):
                value = [_plain(item) for item in value]
            elif isinstance(value, list):
                value = list(value)
            elif isinstance(value, dict):
                value = json.loads(json.dumps(value))
            d[f.name] = value
        d["ok"] = self.ok
        return d

    def to_json(self, **kwargs: Any) -> str:
        """The report as JSON text (keyword arguments go to :func:`json.dumps`)."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadReport:
        """Rebuild a report from :meth:`to_dict` output (``ok`` is derived, so it is not read).

        Raises:
            ConfigurationError: ``data`` is not a report dict (the message names the bad field).
        """
        if not isinstance(data, dict):
            raise ConfigurationError(f"LoadReport.from_dict expects a dict, got {type(data).__name__}.")
        known = {f.name for f in fields(cls)} - {"plan"}
        extra = set(data) - known - {"ok"}
        if extra:
            raise ConfigurationError(
                f"LoadReport.from_dict: unknown field(s) {sorted(extra)}; a report has {sorted(known)}."
            )
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["mismatched"] = [_rebuild(Mismatch, m) for m in data.get("mismatched", [])]
        for name in ("conflicts", "conversion_errors"):
            kwargs[name] = [_rebuild(ConversionFailure, c) for c in data.get(name, [])]
        kwargs["tp_fallbacks"] = [_rebuild(TPFallback, c) for c in data.get("tp_fallbacks", [])]
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> LoadReport:
        """Rebuild a report from :meth:`to_json` output.

        Example:
            >>> r = LoadReport(checkpoint="ckpt", missing_keys=["lm_head.weight"])
            >>> LoadReport.from_json(r.to_json()) == r
            True
        """
        return cls.from_dict(json.loads(text))

    def __str__(self) -> str:
        lines = [
            f"LoadReport({self.checkpoint}): {'OK' if self.ok else 'PROBLEMS'}; "
            f"{len(self.loaded_keys)} loaded ({len(self.mapped_keys)} memory-mapped) in {self.seconds:.3f}s"
        ]
        if self.fusions:
            lines.append(f"  fusions applied: {self.fusions}")
        if self.tp_world_size is not None:
            lines.append(
                f"  tensor parallel: rank {self.tp_rank} of {self.tp_world_size}, {self.bytes_read} bytes read"
            )

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
        section("conflicts (not loaded)", self.conflicts)
        section("conversion errors (not loaded)", self.conversion_errors)
        section("tensor-parallel fallbacks (read whole, then sliced)", self.tp_fallbacks)
        section(
            "left on meta (no data, the model cannot run; build it with surgery.init_empty() so buffers are "
            "real, or load or initialize these)",
            self.left_on_meta,
        )
        section("notes", self.notes)
        section("transforms used", self.transforms_used, limit=10)
        section("decoded (stored quantized, dequantized on read)", self.decoded_keys, limit=10)
        return "\n".join(lines)


def _plain(item: Mismatch | ConversionFailure | TPFallback) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(item):
        value = getattr(item, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _rebuild(cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ConfigurationError(f"LoadReport.from_dict: a {cls.__name__} must be a dict, got {data!r}.")
    names = {f.name for f in fields(cls)}
    if set(data) - names:
        raise ConfigurationError(
            f"LoadReport.from_dict: unknown {cls.__name__} field(s) {sorted(set(data) - names)}."
        )
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
