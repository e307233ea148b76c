"""Audit a load → save round trip: the verification card of ``surgery verify``.

:func:`verify` loads a checkpoint into a model, saves it in the original layout into a temporary
directory, loads that back into the same model and saves again, then compares tensor by tensor
(name, dtype, shape and a SHA-256 of the bytes) the source against the first output, the first
output against the second (idempotence of save∘load∘save) and the runtime state after the first
load against the state after the second. Tensors are streamed from memory-mapped safetensors
files: besides the model, only a few tensors (or one save group) are held.

Each byte is hashed once: the source's tensors are hashed, an output tensor is compared with the
source's bytes and hashed only when they differ, and the second save is compared with the first
byte for byte. Under tensor parallelism (``tp_plan=``, ``device_mesh=``) every rank loads its
shards, the saves gather to rank 0 which writes the files, each rank audits its share of the
tensors, and the ranks exchange their findings, so every rank returns the same card; a failure on
one rank is raised on every rank (:class:`~surgery.collective.Collective`).

The result is a :class:`VerifyCard`; :meth:`VerifyCard.to_dict` is the JSON card whose schema is
published in ``docs/verify-card.schema.json``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from .checkpoint import open_checkpoint
from .collective import Collective
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


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (row-major, as safetensors stores them); a DTensor's local shard."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None:  # a DTensor: each rank compares its own shard
        t = to_local()
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def _digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes."""
    return hashlib.sha256(_bytes(t).numpy().data).hexdigest()


def _words(raw: torch.Tensor) -> torch.Tensor:
    """``raw`` bytes as the widest integers that tile them: comparing int64 words is ~4x faster."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if raw.numel() % dtype.itemsize == 0:
            with contextlib.suppress(RuntimeError):  # an offset the wider type cannot start at
                return raw.view(dtype)
    return raw


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (a byte compare: cheaper than hashing both)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_words(_bytes(a)), _words(_bytes(b)))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class _Entry:
    dtype: str
    shape: list[int]
    sha256: str


def _entry(t: torch.Tensor, sha256: str) -> _Entry:
    return _Entry(_dtype_name(t.dtype), list(t.shape), sha256)


_WORKERS = 4
"""Hashing threads (``hashlib`` and ``torch.equal`` release the GIL on large buffers)."""

_T = TypeVar("_T")
_R = TypeVar("_R")


def _in_threads(work: Callable[[_T], _R], items: Iterable[_T]) -> Iterator[_R]:
    """``work(item)`` for each item, in input order, by a few threads, at most 2 per thread in flight."""
    with ThreadPoolExecutor(_WORKERS, thread_name_prefix="surgery-verify") as pool:
        pending: collections.deque[Future[_R]] = collections.deque()
        for item in items:
            pending.append(pool.submit(work, item))
            if len(pending) >= 2 * _WORKERS:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _runtime_hashes(model: nn.Module) -> dict[str, str]:
    """Runtime key → SHA-256 of its value (of this rank's shard under tensor parallelism)."""
    state = [(k, v) for k, v in model.state_dict().items() if v.device.type != "meta"]
    return dict(_in_threads(lambda kv: (kv[0], _digest(kv[1])), state))


@dataclass
class _Findings:
    """One rank's audit of its share of the tensors (every tensor in one process)."""

    source: dict[str, _Entry] = field(default_factory=dict)
    output: dict[str, _Entry] = field(default_factory=dict)
    not_idempotent: list[str] = field(default_factory=list)


def _share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """This rank's tensors: the largest first, each to the rank with the fewest bytes so far.

    Every rank computes the same split from the same headers, so each tensor is audited once.
    """
    if world == 1:
        return sorted(sizes)
    load = [0] * world
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += sizes[name]
        if owner == rank:
            mine.append(name)
    return sorted(mine)


def _audit(
    source: Path, output: Path | None, first: Path, second: Path, *, rank: int = 0, world: int = 1
) -> _Findings:
    """Hash the source's tensors of this rank's share; compare the output and the two saves by bytes.

    ``output`` defaults to the first save. An output tensor with the source's bytes has the
    source's hash; one that differs is hashed itself. The second save is compared with the first
    byte for byte (idempotence needs no hash).
    """
    with contextlib.ExitStack() as stack:
        src, a, b = (stack.enter_context(open_checkpoint(p)) for p in (source, first, second))
        out = a if output is None else stack.enter_context(open_checkpoint(output))
        readers = (src, out, a, b)
        sizes: dict[str, int] = {}
        for reader in readers:
            for key in reader:
                sizes[key] = max(sizes.get(key, 0), reader.info(key).nbytes)

        def one(key: str) -> tuple[str, _Entry | None, _Entry | None, bool]:
            s = src.get_tensor(key, copy=False) if key in src else None
            o = out.get_tensor(key, copy=False) if key in out else None
            s_entry = _entry(s, _digest(s)) if s is not None else None
            o_entry = None
            if o is not None:
                same = s is not None and s_entry is not None and _same_bytes(s, o)
                o_entry = _entry(o, s_entry.sha256 if same and s_entry else _digest(o))
            x = a.get_tensor(key, copy=False) if key in a else None
            y = b.get_tensor(key, copy=False) if key in b else None
            idempotent = (x is None and y is None) or (x is not None and y is not None and _same_bytes(x, y))
            return key, s_entry, o_entry, idempotent

        found = _Findings()
        for key, s_entry, o_entry, idempotent in _in_threads(one, _share(sizes, rank, world)):
            if s_entry is not None:
                found.source[key] = s_entry
            if o_entry is not None:
                found.output[key] = o_entry
            if not idempotent:
                found.not_idempotent.append(key)
        return found


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
        load_problems: the problems of either load's report (missing, unexpected, mismatched
            keys...); the second load's are prefixed ``reload``.
        ranks: the processes that audited (the tensor-parallel world size; 1 in one process).
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
    ranks: int = 1

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
            "ranks": self.ranks,
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
    tp_plan: dict[str, Any] | str | None = None,
    device_mesh: Any = None,
    dtype: torch.dtype | str | None = None,
    allow: Sequence[str] = (),
    output: str | os.PathLike[str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    max_shard_size: int | str = "5GB",
) -> VerifyCard:
    """Audit a load → save round trip of ``checkpoint`` through ``model``, tensor by tensor.

    Args:
        model: the model to load into, or a zero-argument factory (called once). The model is
            loaded twice: from ``checkpoint``, then from the first save.
        checkpoint: the source checkpoint (file, directory or index).
        fusion_config, quantizer, dtype: passed to :func:`~surgery.load_checkpoint`.
        tp_plan, device_mesh: a tensor-parallel audit: every rank of ``device_mesh`` calls
            :func:`verify` with the same arguments, loads its shards (``tp_plan`` as
            :func:`~surgery.load_checkpoint` takes it), audits its share of the tensors, and
            gets the same card. The ranks share ``workdir`` (default: a temporary directory rank 0
            creates, so one machine); on several machines pass a directory they all see.
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
            Under tensor parallelism every rank raises it, naming the rank that failed.

    Example:
        >>> card = surgery.verify(build_model, "ckpt/")  # doctest: +SKIP
        >>> card.ok, card.counts()  # doctest: +SKIP
        (True, {'identical': 41})
    """
    from .load.loader import load_checkpoint
    from .save import save_checkpoint

    collective = _collective(device_mesh, checkpoint)
    rank, world = collective.rank, _world(device_mesh)
    card = VerifyCard(
        checkpoint=str(checkpoint), allowed=sorted(set(allow)), versions=_versions(), ranks=world
    )
    options: dict[str, Any] = {"quantizer": quantizer, "dtype": dtype}

    @contextlib.contextmanager
    def step(name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        card.seconds[name] = round(time.perf_counter() - t0, 6)

    scratch: str | None = None
    try:
        with collective.step():  # every rank checks the arguments before the first collective
            bad = [a for a in allow if a not in ALLOWANCES]
            if bad:
                raise ConfigurationError(
                    f"verify(allow={list(allow)!r}): {bad[0]!r} is not one of {', '.join(ALLOWANCES)}."
                )
            if workdir is None and rank == 0:
                scratch = tempfile.mkdtemp(prefix="surgery-verify-")
        collective.agree()
        work = Path(workdir) if workdir is not None else Path(collective.gather(scratch)[0])
        first, second = work / "first", work / "second"
        with collective.step():
            work.mkdir(parents=True, exist_ok=True)
            loaded = model() if not isinstance(model, nn.Module) and callable(model) else model
        collective.agree()
        with step("load"):  # a load agrees across its ranks: a failure on one raises on every rank
            report = load_checkpoint(
                loaded,
                checkpoint,
                fusion_config=fusion_config,
                tp_plan=tp_plan,
                device_mesh=device_mesh,
                **options,
            )
        with collective.step():
            card.load_modes = _load_modes(report)
            card.load_problems = _problems(report)
            del report
            before = _runtime_hashes(loaded)
        collective.agree()
        with step("save"):
            save_checkpoint(loaded, first, max_shard_size=max_shard_size)  # raises on every rank
        with step("reload"):  # into the same model: already fused, and parallel on its own mesh
            report = load_checkpoint(loaded, first, **options)
        with collective.step():
            card.load_problems += [f"reload {p}" for p in _problems(report)]
            after = _runtime_hashes(loaded)
            missing = set(report.missing_keys)  # kept from the first load: not from the save
            changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
            card.runtime_differences = sorted(changed | missing)
        collective.agree()
        with step("resave"):
            save_checkpoint(loaded, second, max_shard_size=max_shard_size)
        del loaded
        with collective.step(), step("compare"):
            found = _audit(
                Path(checkpoint),
                Path(output) if output is not None else None,
                first,
                second,
                rank=rank,
                world=world,
            )
        collective.agree()
        _combine(card, found, collective.gather((card, found)))
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return card


def _world(device_mesh: Any) -> int:
    return int(device_mesh.size()) if device_mesh is not None else 1


def _collective(device_mesh: Any, checkpoint: str | os.PathLike[str]) -> Collective:
    """The ranks of ``device_mesh`` that audit together (one process without a mesh)."""
    what = f"verify '{checkpoint}'"
    if device_mesh is None or device_mesh.size() == 1:
        return Collective(None, what=what)
    return Collective(device_mesh.get_group(), what=what, device_type=device_mesh.device_type)


def _combine(card: VerifyCard, found: _Findings, ranks: list[tuple[VerifyCard, _Findings]]) -> None:
    """Every rank's findings into ``card``: the same card on every rank.

    The tensors each rank audited are put together; the load modes are rank 0's (every rank
    runs the same plan); problems and runtime differences are the union over the ranks; each
    step's time is the slowest rank's.
    """
    source: dict[str, _Entry] = {}
    output: dict[str, _Entry] = {}
    not_idempotent: set[str] = set()
    problems: list[str] = []
    runtime: set[str] = set()
    for rank_card, rank_found in ranks:
        source.update(rank_found.source)
        output.update(rank_found.output)
        not_idempotent.update(rank_found.not_idempotent)
        problems += [p for p in rank_card.load_problems if p not in problems]
        runtime.update(rank_card.runtime_differences)
        for name, seconds in rank_card.seconds.items():
            card.seconds[name] = max(card.seconds.get(name, 0.0), seconds)
    card.load_modes = dict(ranks[0][0].load_modes)
    card.load_problems = problems
    card.tensors = _compare(source, output)
    card.idempotence_differences = sorted(not_idempotent)
    card.idempotent = not not_idempotent
    card.runtime_differences = sorted(runtime)
    card.runtime_identical = not runtime
