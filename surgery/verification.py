"""Audit a load → save round trip: the verification card of ``surgery verify``.

:func:`verify` loads a checkpoint into a model, saves it in the original layout into a temporary
directory, loads that back and saves again, then compares tensor by tensor (name, dtype, shape and
a SHA-256 of the bytes) the source against the first output, the first output against the second
(idempotence of save∘load∘save) and the runtime state after the first load against the state after
the second. Tensors are streamed from memory-mapped safetensors files and hashed one at a time:
besides the model, only one tensor (or one save group) is held.

The result is a :class:`VerifyCard`; :meth:`VerifyCard.to_dict` is the JSON card whose schema is
published in ``docs/verify-card.schema.json``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import open_checkpoint
from .empty import init_empty
from .errors import ConfigurationError

__all__ = ["ALLOWANCES", "TensorVerdict", "VerifyCard", "verify"]

CARD_VERSION = 1
ALLOWANCES = ("cast", "requantize")
"""Differences :func:`verify` may be told to accept (``allow=``, ``--allow``)."""

_QUANTIZED_DTYPES = {
    torch.int8,
    torch.uint8,
    *(
        getattr(torch, n)
        for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)
    ),
}


def _digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (row-major, as safetensors stores them)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().data).hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class _Entry:
    dtype: str
    shape: list[int]
    sha256: str


_WORKERS = 4
"""Hashing threads (``hashlib`` releases the GIL on large buffers)."""


def _digests(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor, str]]:
    """``(name, tensor, sha256)`` in input order, hashed by a few threads, at most 2 per thread in flight."""
    with ThreadPoolExecutor(_WORKERS, thread_name_prefix="surgery-verify") as pool:
        pending: collections.deque[tuple[str, torch.Tensor, Future[str]]] = collections.deque()
        for name, t in tensors:
            pending.append((name, t, pool.submit(_digest, t)))
            if len(pending) >= 2 * _WORKERS:
                done = pending.popleft()
                yield done[0], done[1], done[2].result()
        while pending:
            done = pending.popleft()
            yield done[0], done[1], done[2].result()


def _scan(path: Path) -> dict[str, _Entry]:
    """Name → (dtype, shape, hash) of every tensor of a checkpoint, memory-mapped, a few at a time."""
    with open_checkpoint(path) as reader:
        keys = reader.keys()
        views = ((k, reader.get_tensor(k, copy=False)) for k in keys)
        return {k: _Entry(_dtype_name(t.dtype), list(t.shape), h) for k, t, h in _digests(views)}


def _runtime_hashes(model: nn.Module) -> dict[str, str]:
    state = ((k, v) for k, v in model.state_dict().items() if v.device.type != "meta")
    return {k: h for k, _, h in _digests(state)}


@dataclass(frozen=True)
class TensorVerdict:
    """One source tensor compared with its counterpart in the output.

    Attributes:
        name: the checkpoint key.
        verdict: ``"identical"``, ``"requantized"`` (a quantized dtype whose codes changed),
            ``"cast"`` (the output has another dtype), ``"changed"`` (same dtype and shape,
            other bytes, or another shape), ``"missing"`` (not in the output) or ``"extra"``
            (only in the output).
        dtype / shape / sha256: of the source (of the output for ``"extra"``).
        output_dtype / output_shape / output_sha256: of the output (``None`` when missing).
    """

    name: str
    verdict: str
    dtype: str
    shape: list[int]
    sha256: str | None
    output_dtype: str | None
    output_shape: list[int] | None
    output_sha256: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "verdict": self.verdict,
            "dtype": self.dtype,
            "shape": self.shape,
            "sha256": self.sha256,
            "output_dtype": self.output_dtype,
            "output_shape": self.output_shape,
            "output_sha256": self.output_sha256,
        }


@dataclass
class VerifyCard:
    """What :func:`verify` found.

    Attributes:
        checkpoint: the audited checkpoint.
        tensors: one verdict per source tensor (and per extra output tensor), in name order.
        load_modes: per runtime key, how the first load produced it: ``"direct"`` (read or
            mapped as stored), ``"converted"`` (through an op chain) or ``"decoded"`` (dequantized
            from a quantized checkpoint).
        idempotent: the second save wrote exactly what the first wrote (save∘load∘save = save).
        idempotence_differences: tensors that differ between the two saves.
        runtime_identical: the model state after the second load equals the state after the first.
        runtime_differences: runtime keys that differ between the two loads.
        allowed: the differences accepted (``"cast"``, ``"requantize"``).
        seconds: wall time of each step (``load``, ``save``, ``reload``, ``resave``, ``compare``).
        versions: of surgery, torch and transformers (``None`` when not installed).
        load_problems: the first load's report problems (missing, unexpected, mismatched keys...).
    """

    checkpoint: str
    tensors: list[TensorVerdict] = field(default_factory=list)
    load_modes: dict[str, str] = field(default_factory=dict)
    idempotent: bool = True
    idempotence_differences: list[str] = field(default_factory=list)
    runtime_identical: bool = True
    runtime_differences: list[str] = field(default_factory=list)
    allowed: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str | None] = field(default_factory=dict)
    load_problems: list[str] = field(default_factory=list)

    def differences(self) -> list[TensorVerdict]:
        """The tensors that are not identical and not allowed."""
        accepted = {"cast": "cast", "requantize": "requantized"}
        ok = {"identical", *(accepted[a] for a in self.allowed)}
        return [t for t in self.tensors if t.verdict not in ok]

    @property
    def ok(self) -> bool:
        """Every tensor identical (or an allowed difference), saves idempotent, the two loads equal."""
        return (
            not self.differences() and self.idempotent and self.runtime_identical and not self.load_problems
        )

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.verdict] = out.get(t.verdict, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON card (``docs/verify-card.schema.json``)."""
        return {
            "card_version": CARD_VERSION,
            "checkpoint": self.checkpoint,
            "ok": self.ok,
            "counts": self.counts(),
            "allowed": list(self.allowed),
            "tensors": [t.to_dict() for t in self.tensors],
            "load_modes": dict(self.load_modes),
            "load_problems": list(self.load_problems),
            "idempotent": self.idempotent,
            "idempotence_differences": list(self.idempotence_differences),
            "runtime_identical": self.runtime_identical,
            "runtime_differences": list(self.runtime_differences),
            "seconds": dict(self.seconds),
            "versions": dict(self.versions),
        }

    def render(self, *, limit: int = 20) -> str:
        """A short human summary: counts, then one line per non-identical tensor (capped)."""
        counts = ", ".join(f"{n} {v}" for v, n in sorted(self.counts().items()))
        lines = [
            f"verify {self.checkpoint}: {'OK' if self.ok else 'DIFFERENT'} ({counts or 'no tensors'})",
        ]
        odd = [t for t in self.tensors if t.verdict != "identical"]
        for t in odd[:limit]:
            what = f"{t.dtype}{tuple(t.shape)}"
            if t.output_dtype is not None and t.verdict != "extra":
                what += f" -> {t.output_dtype}{tuple(t.output_shape or ())}"
            allowed = " (allowed)" if t not in self.differences() else ""
            lines.append(f"  {t.verdict:<11} {t.name}  {what}{allowed}")
        if len(odd) > limit:
            lines.append(f"  ... and {len(odd) - limit} more non-identical tensor(s) (--json FILE lists all)")
        if self.load_problems:
            lines.extend(f"  load: {p}" for p in self.load_problems[:limit])
        if not self.idempotent:
            lines.append(
                f"  not idempotent: a second save changed {len(self.idempotence_differences)} tensor(s), "
                f"e.g. {self.idempotence_differences[0]}"
            )
        if not self.runtime_identical:
            lines.append(
                f"  the reloaded model differs in {len(self.runtime_differences)} key(s), "
                f"e.g. {self.runtime_differences[0]}"
            )
        secs = ", ".join(f"{k} {v:.2f}s" for k, v in self.seconds.items())
        lines.append(f"  time: {secs}")
        return "\n".join(lines)


def _compare(source: dict[str, _Entry], output: dict[str, _Entry]) -> list[TensorVerdict]:
    out: list[TensorVerdict] = []
    for name in sorted(source.keys() | output.keys()):
        s, o = source.get(name), output.get(name)
        if s is None:
            assert o is not None
            out.append(TensorVerdict(name, "extra", o.dtype, o.shape, None, o.dtype, o.shape, o.sha256))
            continue
        if o is None:
            verdict = "missing"
        elif s.dtype == o.dtype and s.shape == o.shape and s.sha256 == o.sha256:
            verdict = "identical"
        elif s.dtype != o.dtype:
            verdict = "cast"
        elif s.shape == o.shape and s.dtype in {_dtype_name(d) for d in _QUANTIZED_DTYPES}:
            verdict = "requantized"
        else:
            verdict = "changed"
        out.append(
            TensorVerdict(
                name,
                verdict,
                s.dtype,
                s.shape,
                s.sha256,
                o.dtype if o else None,
                o.shape if o else None,
                o.sha256 if o else None,
            )
        )
    return out


def _load_modes(report: Any) -> dict[str, str]:
    modes: dict[str, str] = {}
    plan = getattr(report, "plan", None)
    for entry in getattr(plan, "entries", ()):
        if entry.status != "ok" or entry.mode == "skip":
            continue
        mode = "decoded" if entry.companions else "converted" if entry.mode == "convert" else "direct"
        for key in entry.target_keys:
            modes[key] = mode
    return dict(sorted(modes.items()))


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"torch": torch.__version__}
    for name, dist in (("surgery", "torch-surgery"), ("transformers", "transformers")):
        try:
            out[name] = version(dist)
        except PackageNotFoundError:
            out[name] = None
    return out


def _problems(report: Any) -> list[str]:
    out = [f"missing: {k}" for k in report.missing_keys]
    out += [f"unexpected: {k}" for k in report.unexpected_keys]
    out += [f"mismatched: {m}" for m in report.mismatched]
    out += [f"conflict: {c}" for c in report.conflicts]
    out += [f"conversion error: {c}" for c in report.conversion_errors]
    return out


def verify(
    model: nn.Module | Callable[[], nn.Module],
    checkpoint: str | os.PathLike[str],
    *,
    fusion_config: dict[str, Any] | None = None,
    quantizer: object | None = None,
    dtype: torch.dtype | str | None = None,
    allow: Sequence[str] = (),
    output: str | os.PathLike[str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    max_shard_size: int | str = "5GB",
) -> VerifyCard:
    """Audit a load → save round trip of ``checkpoint`` through ``model``, tensor by tensor.

    Args:
        model: the model to load into, or a zero-argument factory (then each load gets a fresh
            model, built after the previous one is released). A model instance is loaded twice.
        checkpoint: the source checkpoint (file, directory or index).
        fusion_config, quantizer, dtype: passed to :func:`~surgery.load_checkpoint`. A
            tensor-parallel audit (each rank its files) is not supported yet: the load runs in one
            process.
        allow: differences to accept: ``"cast"`` (the output has another dtype) and/or
            ``"requantize"`` (quantized codes changed).
        output: a converted checkpoint to audit against the source instead of the first save
            (e.g. what ``surgery convert`` wrote); the round trip still runs for idempotence.
        workdir: where the two saves go (default: a temporary directory, deleted afterwards).
        max_shard_size: of the two saves.

    Returns:
        The :class:`VerifyCard`; ``card.ok`` is the verdict.

    Raises:
        ConfigurationError: an unknown ``allow`` value.
        SurgeryError: whatever loading or saving raises (a missing file, a refused checkpoint).
    """
    from .load.loader import load_checkpoint
    from .save import save_checkpoint

    bad = [a for a in allow if a not in ALLOWANCES]
    if bad:
        raise ConfigurationError(
            f"verify(allow={list(allow)!r}): {bad[0]!r} is not one of {', '.join(ALLOWANCES)}."
        )
    card = VerifyCard(checkpoint=str(checkpoint), allowed=sorted(set(allow)), versions=_versions())

    def build() -> nn.Module:
        return model() if not isinstance(model, nn.Module) and callable(model) else model

    options: dict[str, Any] = {"quantizer": quantizer, "dtype": dtype}

    @contextlib.contextmanager
    def step(name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        card.seconds[name] = round(time.perf_counter() - t0, 6)

    scratch = tempfile.TemporaryDirectory(prefix="surgery-verify-") if workdir is None else None
    try:
        work = Path(scratch.name if scratch is not None else workdir)  # type: ignore[arg-type]
        work.mkdir(parents=True, exist_ok=True)
        first, second = work / "first", work / "second"
        loaded = build()
        with step("load"):
            report = load_checkpoint(loaded, checkpoint, fusion_config=fusion_config, **options)
        card.load_modes = _load_modes(report)
        card.load_problems = _problems(report)
        del report
        before = _runtime_hashes(loaded)
        with step("save"):
            save_checkpoint(loaded, first, max_shard_size=max_shard_size)
        reload_fusions = None  # an instance is already fused
        if not isinstance(model, nn.Module):
            del loaded  # the first model is released before the second is built
            with init_empty():  # on meta: every parameter must come from the first save
                loaded = build()
            reload_fusions = fusion_config
        with step("reload"):
            load_checkpoint(loaded, first, fusion_config=reload_fusions, **options)
        after = _runtime_hashes(loaded)
        card.runtime_differences = sorted(
            k for k in before.keys() | after.keys() if before.get(k) != after.get(k)
        )
        card.runtime_identical = not card.runtime_differences
        with step("resave"):
            save_checkpoint(loaded, second, max_shard_size=max_shard_size)
        del loaded
        with step("compare"):
            source = _scan(Path(checkpoint))
            a = _scan(first)
            out = _scan(Path(output)) if output is not None else a
            card.tensors = _compare(source, out)
            b = _scan(second)
            card.idempotence_differences = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            card.idempotent = not card.idempotence_differences
    finally:
        if scratch is not None:
            scratch.cleanup()
    return card
