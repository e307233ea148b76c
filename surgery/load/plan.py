"""The load plan: what a load will read, convert and set, computed from headers alone.

:func:`surgery.plan_load` returns a :class:`LoadPlan` without reading a byte of tensor data, and
:func:`surgery.load_checkpoint` executes exactly that plan. A plan renders as a compact table in
which keys that differ only by their indices fold into one row (``layers.{0..31}``), and as JSON.

Building the plan (phase 1 of a load) lives in :mod:`surgery.load.planner`; the placement views in
:mod:`surgery.placement`.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any

from ..errors import ConfigurationError
from ..parallel.regions import TPSlice

__all__ = ["LoadPlan", "Mode", "PlanEntry", "Status", "fold_indices"]


class _TextEnum(str, Enum):
    """A string enum whose text is its value, as ``enum.StrEnum`` (Python 3.11) is; 3.10 is supported."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class Mode(_TextEnum):
    """How a target is filled; the value is the text a plan's JSON and table show."""

    MMAP = "mmap"
    """memory-mapped from the file and assigned without a copy"""
    DIRECT = "direct"
    """read straight into the destination (for a converter: into views cut by the inverse chain)"""
    CONVERT = "convert"
    """read, run the op chain, cast or quantize, set"""
    SKIP = "skip"
    """not loaded; the entry's :class:`Status` says why"""


class Status(_TextEnum):
    """Whether an entry loads (``ok``) or why not; the value is the text a plan's JSON shows."""

    OK = "ok"
    UNEXPECTED = "unexpected"
    """a target the model does not have"""
    MISMATCH = "mismatch"
    """the checkpoint's shape differs from the model's"""
    CONFLICT = "conflict"
    """another entry lands on the same parameter"""
    ERROR = "error"
    """the conversion (or a quantizer's check) fails"""


@dataclass
class PlanEntry:
    """One unit of work: the checkpoint keys that produce a set of runtime keys.

    Attributes:
        target_keys: runtime keys produced (wildcards expanded).
        source_keys: checkpoint keys read, in pattern then index order.
        transform: the converter (``repr``), or ``None`` for a plain (possibly renamed) tensor.
        operations: the op chain, as text.
        renamings: the renamings that fired on the source keys.
        nbytes: bytes read from disk.
        source_shapes / source_dtypes: per source key, from the headers.
        target_shapes / target_dtype / device: where the tensors go.
        mode: a :class:`Mode`: ``direct`` (read straight into the destination), ``mmap``
            (memory-mapped, assigned without a copy), ``convert`` (read, run the chain, set) or
            ``skip``.
        status: a :class:`Status`: ``ok``, ``unexpected``, ``mismatch``, ``conflict`` or ``error``.
        message: why, when the status is not ``"ok"``.
        tp: per target under tensor parallelism, its :class:`~surgery.parallel.TPSlice`: the
            placements as text, one per mesh dim, and the dim and half-open intervals of this
            rank's part (``dim=None`` for a replicated target; ``None`` for a plain tensor). A
            packed ``_StridedShard`` has one interval per part. In JSON a slice is
            ``[placements, dim, intervals]`` (:meth:`TPSlice.to_json`).
        companions: checkpoint keys read to decode quantized sources (their block scales);
            their bytes are in ``nbytes``.
        quantized: runtime keys a quantizer produces from the targets (``X.weight``,
            ``X.weight_scale``), quantized after the op chain.
    """

    target_keys: tuple[str, ...]
    source_keys: tuple[str, ...]
    transform: str | None = None
    operations: tuple[str, ...] = ()
    renamings: tuple[str, ...] = ()
    nbytes: int = 0
    source_shapes: tuple[tuple[int, ...], ...] = ()
    source_dtypes: tuple[str, ...] = ()
    target_shapes: tuple[tuple[int, ...] | None, ...] = ()
    target_dtype: str | None = None
    device: str | None = None
    mode: Mode = Mode.CONVERT
    status: Status = Status.OK
    message: str = ""
    tp: tuple[TPSlice | None, ...] = ()
    companions: tuple[str, ...] = ()
    quantized: tuple[str, ...] = ()


@dataclass
class LoadPlan:
    """The full plan of a load, plus everything the report would flag.

    Under tensor parallelism the plan is one rank's (``tp_rank`` of ``tp_world_size``): entry
    bytes are the bytes this rank reads.
    """

    checkpoint: str
    entries: list[PlanEntry] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    transforms: list[str] = field(default_factory=list)
    fusions: dict[str, Any] | None = None
    tp_world_size: int | None = None
    tp_rank: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.status in (Status.OK, Status.MISMATCH))

    @property
    def problems(self) -> list[PlanEntry]:
        return [e for e in self.entries if e.status != Status.OK]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for entry, e in zip(d["entries"], self.entries):
            entry["tp"] = [None if s is None else s.to_json() for s in e.tp]
        d["total_bytes"] = self.total_bytes
        return d

    def to_json(self, **kwargs: Any) -> str:
        """The plan as JSON text (keyword arguments go to :func:`json.dumps`)."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadPlan:
        """Rebuild a plan from :meth:`to_dict` output (``total_bytes`` is derived, so it is not read).

        Raises:
            ConfigurationError: ``data`` is not a plan dict (the message names the bad field).
        """
        if not isinstance(data, dict):
            raise ConfigurationError(f"LoadPlan.from_dict expects a dict, got {type(data).__name__}.")
        known = {f.name for f in fields(cls)}
        extra = set(data) - known - {"total_bytes"}
        if extra:
            raise ConfigurationError(
                f"LoadPlan.from_dict: unknown field(s) {sorted(extra)}; a plan has {sorted(known)}."
            )
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["entries"] = [_entry_from_dict(e) for e in data.get("entries", [])]
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> LoadPlan:
        """Rebuild a plan from :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))

    def render(self, *, max_rows: int = 60) -> str:
        """A compact table; rows whose keys differ only by indices are folded."""
        rows: dict[tuple[Any, ...], list[PlanEntry]] = {}
        for e in self.entries:
            sig = (
                tuple(_template(k) for k in e.target_keys[:1]),
                e.transform,
                e.operations,
                e.mode,
                e.status,
                tuple(_shape(s) for s in e.target_shapes[:1]),
                len(e.source_keys),
            )
            rows.setdefault(sig, []).append(e)
        parallel = self.tp_world_size is not None
        width = max([len("runtime key"), *(len(_row_name(g)) for g in rows.values())])
        width = min(width, 100)  # a longer key overflows its column, but the rest stay aligned
        rank = f" on tensor-parallel rank {self.tp_rank} of {self.tp_world_size}" if parallel else ""
        lines = [
            f"LoadPlan for {self.checkpoint}{rank}: {len(self.entries)} targets, "
            f"{_human(self.total_bytes)} to read, {len(self.problems)} problem(s)"
        ]
        if self.fusions:
            lines.append(f"fusions: {self.fusions}")
        lines.extend(f"note: {n}" for n in self.notes)
        part = f"{'rank part':<28} " if parallel else ""
        header = f"{'runtime key':<{width}} {'mode':<8} {'shape':<18} {part}{'sources':<8} transform"
        lines.append(header)
        lines.append("-" * len(header))
        for i, group in enumerate(rows.values()):
            if i >= max_rows:
                lines.append(f"... {len(rows) - max_rows} more rows")
                break
            e = group[0]
            shape = _shape(e.target_shapes[0]) if e.target_shapes else "?"
            what = "" if e.transform is None else f"{e.transform.split('(')[0]} {', '.join(e.operations)}"
            if e.renamings and not what:
                what = "renamed"
            if e.companions:
                what = f"{what} +dequantize".lstrip()
            if e.quantized:
                what = f"{what} +quantize".lstrip()
            status = "" if e.status == Status.OK else f"  [{e.status}: {e.message}]"
            tp = f"{_part(e.tp[0] if e.tp else None):<28} " if parallel else ""
            lines.append(
                f"{_row_name(group):<{width}} {e.mode:<8} {shape:<18} {tp}{len(e.source_keys):<8} {what}{status}"
            )
        lines.append(
            "mode: mmap = mapped from the file, no copy; direct = read straight into place; convert = read, "
            "convert, set; skip = not loaded (see its status)"
        )
        if self.missing_keys:
            lines.append(f"missing ({len(self.missing_keys)}): {fold_indices(self.missing_keys)}")
        if self.unexpected_keys:
            lines.append(f"unexpected ({len(self.unexpected_keys)}): {fold_indices(self.unexpected_keys)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _row_name(group: list[PlanEntry]) -> str:
    """A table row's key: the group's first targets folded (``layers.{0..31}.x``), ``+N`` more targets."""
    e = group[0]
    name = fold_indices([g.target_keys[0] for g in group]) if e.target_keys else "?"
    return name + (f" +{len(e.target_keys) - 1}" if len(e.target_keys) > 1 else "")


def _entry_from_dict(data: Any) -> PlanEntry:
    if not isinstance(data, dict):
        raise ConfigurationError(f"LoadPlan.from_dict: an entry must be a dict, got {data!r}.")
    names = {f.name for f in fields(PlanEntry)}
    if set(data) - names:
        raise ConfigurationError(f"LoadPlan.from_dict: unknown entry field(s) {sorted(set(data) - names)}.")
    values = {k: _tuples(v) for k, v in data.items() if k != "tp"}
    kinds: dict[str, type[_TextEnum]] = {"mode": Mode, "status": Status}
    for name, kind in kinds.items():
        if name in values:
            try:
                values[name] = kind(values[name])
            except ValueError:
                raise ConfigurationError(
                    f"LoadPlan.from_dict: an entry's {name} is {values[name]!r}; it is one of "
                    f"{[m.value for m in kind]}."
                ) from None
    tp = tuple(None if s is None else TPSlice.from_json(s) for s in data.get("tp", ()))
    return PlanEntry(**values, tp=tp)


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples a :class:`PlanEntry` holds (nested: shapes)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _template(key: str) -> str:
    return _NUM.sub("#", key)


def _part(tp: TPSlice | None) -> str:
    """``Shard(0) 0:32`` for a rank's part (``-`` for a plain tensor, ``whole`` if replicated)."""
    if tp is None:
        return "-"
    if tp.dim is None:
        return "whole"
    if tp.more:  # cut on several dims (an n-D mesh): each dim's intervals
        cuts = [(tp.dim, tp.intervals), *tp.more]
        return " ".join(f"[{d}]" + ",".join(f"{a}:{b}" for a, b in iv) for d, iv in cuts)
    kinds = [p.split("(")[0].lstrip("_") for p in tp.placements if not p.startswith("Replicate")]
    kind = "+".join(dict.fromkeys(kinds)) or "Replicate"  # n-D: the shards nested on the dim, in mesh order
    return f"{kind}({tp.dim}) " + ",".join(f"{a}:{b}" for a, b in tp.intervals)


def _shape(shape: tuple[int, ...] | None) -> str:
    return "?" if shape is None else str(tuple(shape))


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} GiB"


def _ranges(values: list[int]) -> str:
    values = sorted(set(values))
    parts: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}..{prev}")
        if v is not None:
            start = prev = v
    return parts[0] if len(parts) == 1 and ".." not in parts[0] else "{" + ",".join(parts) + "}"


def fold_indices(keys: list[str]) -> str:
    """Fold keys that differ only in numeric components: ``layers.{0..31}.mlp``.

    Example:
        >>> fold_indices(["a.0.w", "a.1.w", "a.2.w"])
        'a.{0..2}.w'
    """
    if not keys:
        return ""
    groups: dict[str, list[list[int]]] = {}
    for k in keys:
        groups.setdefault(_template(k), []).append([int(x) for x in _NUM.findall(k)])
    out: list[str] = []
    for tpl, nums in groups.items():
        pieces = tpl.split("#")
        text = pieces[0]
        for i, piece in enumerate(pieces[1:]):
            text += _ranges([n[i] for n in nums]) + piece
        out.append(text)
    return ", ".join(out)
