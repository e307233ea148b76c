"""Loading a checkpoint into a (possibly rewritten) module tree.

A load has two phases. Phase 1 (:func:`plan_load`, built in :mod:`surgery.load.planner` by the
passes of :mod:`surgery.load.passes`) reads only headers: it resolves the model's transforms,
routes every checkpoint key once, infers every converter's outputs on ``meta`` tensors and
decides, per target, whether it is memory-mapped (``mmap``), read straight into place
(``direct``), or read and converted (``convert``).

Phase 2 (:func:`load_checkpoint`: prepare, execute, report) executes exactly that plan (each entry by
:func:`surgery.load.execute.execute`) on a thread pool (4 workers by
default; ``SURGERY_SYNC_LOAD=1`` or ``sync=True`` for sequential loading) with bounded read-ahead,
sets each parameter as soon as its tensors are ready and frees the temporaries at once. Entries
that are all Python overhead (memory-mapped ones, and ones whose tensors average under 256 KiB,
such as a thousand tiny experts) run on the calling thread, where the GIL costs no hand-offs, and
the cycle collector is paused for the duration of a load (it only allocates acyclic objects). Ctrl-C
cancels what has not started. A successful load leaves a
:class:`~surgery.record.LoadRecord` in the model's record, which saving reads to invert what happened.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..checkpoint import CheckpointReader, open_checkpoint
from ..collective import Collective
from ..errors import ConfigurationError, ConversionError, LoadError, SurgeryError
from ..fusion import fusion_config_of
from ..model_state import meta_clone, model_device
from ..parallel import from_local, has_dtensors, is_dtensor
from ..parallel.fsdp import FSDPOptions, shard_model
from ..parallel.regions import local_shape
from ..persist import persisted_fusion_config
from ..quantization import QUANTIZATION_METADATA_KEY
from ..quantization.kernels import kernel_summary
from ..record import record_of, update_record
from .execute import execute
from .plan import LoadPlan, Mode
from .planner import Prepared, Work, prepare
from .record import clear_record, record_load
from .report import ConversionFailure, LoadReport, TPFallback
from .sharding import Sharding, TensorParallel, tensor_parallel
from .staging import BUFFERS, Staging, staging_budget

__all__ = ["DEFAULT_WORKERS", "SYNC_ENV", "load_checkpoint", "plan_load"]

DEFAULT_WORKERS = 4
SYNC_ENV = "SURGERY_SYNC_LOAD"
_READ_AHEAD_BYTES = 512 * 2**20
_INLINE_BYTES_PER_TENSOR = 256 * 2**10
"""Entries whose tensors average less than this run on the calling thread: their cost is Python
per-key work that holds the GIL, so worker threads only add hand-offs and GIL contention."""


# --------------------------------------------------------------------------- helpers


def _refuse_meta_device(device: torch.device | str | None, call: str) -> None:
    """``device="meta"`` would load nothing: refused, before the model or its record is touched.

    A ``meta`` tensor holds no data, so a load there would read no byte and report every
    parameter loaded while the model holds no weights. The two things it could mean both have
    their own call: a dry run from headers (:func:`plan_load`, which never changes the model) and
    a model without storage (build it on ``meta``; a load then materializes it on CPU by default).
    """
    if device is None:
        return
    try:
        is_meta = torch.device(device).type == "meta"
    except (RuntimeError, TypeError):
        return  # not a device at all: planning reports it with the valid forms
    if is_meta:
        raise ConfigurationError(
            f"{call}(..., device={device!r}): a meta tensor holds no data, so nothing would be loaded. For a "
            "dry run that reads only headers and never changes the model, call surgery.plan_load(model, path) "
            "without device=; to load, pass a real device ('cpu', 'cuda:0'), or leave device=None: a model "
            "built on meta is then materialized on CPU."
        )


def _reachable_device(device: torch.device | str | None) -> torch.device | str | None:
    """``device``, with the index of this thread's current one when it names none (``"cuda"``: the
    loader's worker threads would otherwise all take device 0).

    Raises:
        ConfigurationError: a device this process cannot reach (no CUDA, an index past the last
            GPU), before the model changes.
    """
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        return device  # not a device at all: planning reports it with the valid forms
    if dev.type in ("cpu", "meta"):
        return device
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise ConfigurationError(
            f"load_checkpoint(..., device={device!r}): this process has no {dev.type} device (torch "
            f"{torch.__version__} {'was built without it' if available is None else 'finds none available'}). "
            "Load to 'cpu', or run where the device is visible (check CUDA_VISIBLE_DEVICES); "
            "surgery.plan_load(model, path, device=...) plans such a load without one."
        )
    count = getattr(backend, "device_count", lambda: 1)()
    if dev.index is not None and dev.index >= count:
        raise ConfigurationError(
            f"load_checkpoint(..., device={device!r}): {dev.type} index {dev.index} does not exist, this process "
            f"sees {count} {dev.type} device(s) ({dev.type}:0 to {dev.type}:{count - 1})."
        )
    return _indexed(dev)


def _indexed(device: torch.device | str | None) -> torch.device | str | None:
    """An accelerator named without an index, as this thread's current one (where there is one)."""
    try:
        dev = torch.device(device) if device is not None else None
    except (RuntimeError, TypeError):
        return device
    if dev is None or dev.index is not None or dev.type in ("cpu", "meta"):
        return device
    backend = getattr(torch, dev.type, None)
    available, current = getattr(backend, "is_available", None), getattr(backend, "current_device", None)
    if callable(available) and available() and callable(current):
        return torch.device(dev.type, current())
    return device


def _usable_target(
    device: torch.device | str | None, staging_bytes: int | str | None, mmap: bool
) -> tuple[torch.device | str | None, bool]:
    """Check the device and the ring size before the model changes: the device (with its index)
    and whether ``mmap`` stays allowed (not through a ring: every read goes through it)."""
    device = _reachable_device(device)
    if staging_bytes is None:
        return device, mmap
    staging_budget(staging_bytes, [])
    return device, False


@contextlib.contextmanager
def _staging(prep: Prepared, staging_bytes: int | str | None, workers: int) -> Iterator[None]:
    """``prep.staging``, the ring reads go through (to a device other than the CPU, or when asked
    for), while the block runs; then every copy in flight is waited for."""
    budget = staging_budget(staging_bytes, [w.device for w in prep.work])
    if budget is None:
        yield
        return
    pinned = any(w.device.type == "cuda" for w in prep.work) and torch.cuda.is_available()
    prep.staging = Staging(budget, buffers=max(BUFFERS, 2 * workers), pinned=pinned)
    try:
        yield
    finally:
        prep.staging.close()


def _note_devices(report: LoadReport, prep: Prepared, model: nn.Module) -> None:
    """What went through the staging ring, and which kernel each quantized module runs, in the report."""
    report.kernels = kernel_summary(model)
    if report.kernels:
        report.notes.append(
            "quantized forwards: " + "; ".join(f"{n} x {k}" for k, n in report.kernels.items())
        )
    ring = prep.staging
    if ring is None:
        return
    report.staged_bytes = ring.staged_bytes
    devices = ", ".join(sorted({str(w.device) for w in prep.work}))
    report.notes.append(
        f"read through {ring!r}: {ring.staged_bytes} bytes in {ring.pieces} piece(s) to {devices}"
    )


def _sync_requested(sync: bool | None) -> bool:
    if sync is not None:
        return sync
    return os.environ.get(SYNC_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------- execution


class _Progress:
    """A one-line progress bar on a terminal, silent otherwise."""

    def __init__(self, total: int, enabled: bool | None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = 0.0
        self._lock = threading.Lock()

    def advance(self, nbytes: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.done += nbytes
            now = time.monotonic()
            if now - self._last < 0.1 and self.done < self.total:
                return
            self._last = now
            frac = self.done / self.total
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\rloading [{bar:<30}] {frac:6.1%}")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _distributed(prep: Prepared, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (this rank's part of ``key``) as the DTensor the model holds, under tensor parallelism."""
    tp = prep.tp
    placements = None if tp is None else prep.placements.get(key)
    if tp is None or placements is None:
        return tensor
    old = prep.runtime[key]
    mesh = old.device_mesh if is_dtensor(old) else tp.mesh  # type: ignore[attr-defined]
    return from_local(tensor, mesh, placements, old.shape)


def _set_tensor(model: nn.Module, key: str, tensor: torch.Tensor, old: torch.Tensor) -> None:
    module_path, _, name = key.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(tensor, requires_grad=old.requires_grad)
    elif name in module._buffers:
        module._buffers[name] = tensor
    else:
        raise LoadError(f"{key!r} is neither a parameter nor a buffer of {type(module).__name__}.")


def _retie(model: nn.Module, key: str, tied: dict[str, list[str]]) -> None:
    aliases = tied.get(key)
    if not aliases:
        return
    module_path, _, name = key.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    value = module._parameters.get(name) if name in module._parameters else module._buffers.get(name)
    for alias in aliases:
        if alias == key:
            continue
        mp, _, n = alias.rpartition(".")
        m = model.get_submodule(mp) if mp else model
        if n in m._parameters:
            m._parameters[n] = value  # type: ignore[assignment]
        else:
            m._buffers[n] = value  # type: ignore[assignment]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cycle collector for one load.

    Parsing a 100k-entry header, routing and planning allocate hundreds of thousands of dicts,
    lists and tuples and build no reference cycles; every collector pass would rescan all of
    them (docs/benchmarks.md, *The cycle collector during a load*, measures what the pause saves).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def _opened(path: str | os.PathLike[str], allow_pickle: bool) -> Iterator[CheckpointReader]:
    reader = open_checkpoint(path, allow_pickle=allow_pickle)
    try:
        yield reader
    finally:
        reader.close()


# --------------------------------------------------------------------------- public API


def plan_load(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    tp_plan: dict[str, Any] | str | None = None,
    device_mesh: Any = None,
    tp_size: int | None = None,
    tp_rank: int | None = None,
    rank: int | None = None,
    fusion_config: dict[str, Any] | None = None,
    quantizer: object | None = None,
    allow_pickle: bool = False,
    mmap: bool = True,
) -> LoadPlan:
    """Plan a load from the headers (plus a quantizer's small scale tensors) without changing ``model``.

    Args:
        model: the module tree to load into (any device, ``meta`` included).
        path: a ``.safetensors`` file, a directory with ``model.safetensors``, or a sharded
            checkpoint directory with ``model.safetensors.index.json``.
        device: where loaded tensors go (default: each parameter's device; CPU for ``meta``);
            ``"meta"`` is refused, as by :func:`load_checkpoint`.
        dtype: cast floating tensors to this dtype; ``"checkpoint"`` keeps each checkpoint dtype;
            default: the model parameter's dtype.
        tp_plan / device_mesh: plan this rank's part of a tensor-parallel load (see
            :func:`load_checkpoint`); the plan is applied to a meta copy, never to ``model``.
        tp_size / tp_rank: plan a ``tp_plan`` for rank ``tp_rank`` of ``tp_size`` without any
            process group (pure arithmetic; style names only).
        rank: with ``device_mesh`` given as dim sizes (``{"dp_shard": 2, "tp": 2}``; names
            ``dp_replicate``, ``dp_shard``, ``tp``, torchtitan's), plan rank ``rank`` of that
            n-D mesh without any process group: ``tp_plan`` on ``tp``, then FSDP2's ``Shard(0)``
            on every parameter over the dp dims (docs/parallel.md).
        fusion_config: fusions to apply first (on a meta copy of the model for the dry run).
        quantizer: as in :func:`load_checkpoint` (applied to a meta copy for the dry run).
        allow_pickle: accept ``.bin``/``.pt`` files (loaded with ``weights_only=True``).
        mmap: as in :func:`load_checkpoint`.

    Returns:
        The :class:`~surgery.LoadPlan`: per runtime target its checkpoint keys, transform and op
        chain, bytes, target shape/dtype/device, mode, and every problem the report would flag.
        :func:`load_checkpoint` with the same arguments executes exactly this plan.

    Example:
        >>> plan = surgery.plan_load(model, "ckpt/")  # doctest: +SKIP
        >>> print(plan.render())  # doctest: +SKIP
    """
    _refuse_meta_device(device, "plan_load")
    device = _indexed(device)  # as load_checkpoint plans it
    tp = tensor_parallel(
        model, tp_plan=tp_plan, device_mesh=device_mesh, tp_size=tp_size, tp_rank=tp_rank, rank=rank
    )
    with _collector_paused(), _opened(path, allow_pickle) as reader:
        needs_fusion = fusion_config is not None or (
            fusion_config_of(model) is None and persisted_fusion_config(reader) is not None
        )
        quantized = quantizer is not None or QUANTIZATION_METADATA_KEY in reader.metadata
        target, stand_in = model, None
        if (
            needs_fusion or quantized or (tp is not None and (tp.spec is not None or tp.planned is not None))
        ):  # a meta copy, never the model
            target, stand_in = meta_clone(model), model_device(model)
        prep = prepare(
            target,
            path,
            device=device,
            dtype=dtype,
            fusion_config=fusion_config,
            reader=reader,
            stand_in=stand_in,
            tp=tp,
            mmap=mmap,
            quantizer=quantizer,
        )
        return prep.plan


def load_checkpoint(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    tp_plan: dict[str, Any] | str | None = None,
    device_mesh: Any = None,
    fsdp: bool | FSDPOptions | None = None,
    quantizer: object | None = None,
    fusion_config: dict[str, Any] | None = None,
    strict: bool = False,
    allow_pickle: bool = False,
    mmap: bool = True,
    num_workers: int | None = None,
    sync: bool | None = None,
    progress: bool | None = None,
    staging_bytes: int | str | None = None,
) -> LoadReport:
    """Load a checkpoint into ``model`` through its conversion mapping (and fusions).

    Args:
        model: the module tree; a model built on ``meta`` is materialized straight from the file
            (parameters the checkpoint lacks stay on ``meta`` and are reported missing).
        path: a ``.safetensors`` file, a directory with ``model.safetensors``, or a sharded
            checkpoint directory with ``model.safetensors.index.json``.
        device: where loaded tensors go (default: each parameter's device; CPU for ``meta``).
            ``"meta"`` is refused (a :class:`~surgery.ConfigurationError`): it holds no data, so
            nothing would be loaded; :func:`plan_load` is the dry run.
        dtype: cast floating tensors to this dtype; ``"checkpoint"`` keeps the checkpoint dtypes;
            default: the parameter's dtype (differences are reported and undone on save).
        tp_plan: tensor parallelism: module patterns (dotted paths, ``*`` = one component) to
            style names (``colwise``, ``rowwise``, ``colwise_gather``, ``replicate``,
            ``packed_colwise``, ``experts``) or ``ParallelStyle`` instances; ``"auto"`` takes the
            model's ``tp_plan`` attribute. The model is parallelized after fusions and each rank
            reads only its part of every sharded tensor (:mod:`surgery.parallel`). A model whose
            parameters are already DTensors loads by their placements, on any number of mesh
            dims (FSDP2 over TP, HSDP: docs/parallel.md; leave ``tp_plan`` out).
        device_mesh: the 1-D ``DeviceMesh`` of the ranks (needed with ``tp_plan``); local tensors
            go to its device. A model already parallelized needs none (its DTensors name theirs).
        fsdp: ``True`` or a :class:`~surgery.parallel.fsdp.FSDPOptions`, with a ``device_mesh``
            whose dims are named (``("dp_shard", "tp")``, ``("dp_replicate", "dp_shard", "tp")``,
            ``("dp_shard",)``): ``tp_plan`` on ``mesh["tp"]``, then FSDP2's ``fully_shard`` per
            decoder layer and at the root over the data-parallel dims (HSDP with both), checked
            before anything changes (:func:`~surgery.parallel.fsdp.shard_model`), then each rank
            reads its shards. Not with ``fusion_config`` (fuse, then parallelize by hand).
        quantizer: a :class:`~surgery.quantization.Quantizer`: decodes a checkpoint quantized on
            disk before the op chains (:class:`~surgery.quantization.FP8BlockQuantizer`) and/or
            quantizes after them (:class:`~surgery.quantization.Int8WeightOnlyQuantizer`, which
            swaps the targeted ``nn.Linear`` modules first). By default, the quantizer a
            runtime-layout save persisted is rebuilt. Quantizing on the fly loads sequentially.
        fusion_config: fusions to apply before loading, e.g. ``{"patch_embeddings": True}``; by
            default, the fusions persisted with a runtime-layout checkpoint are re-applied.
        strict: raise :class:`~surgery.LoadError` (carrying the report) when the report is not ok.
            Problems the headers already show (missing, unexpected, shape-mismatched or
            conflicting keys, failed conversions) raise before any tensor is read, leaving the
            model unchanged; problems found while reading raise after the load.
        allow_pickle: accept ``.bin``/``.pt`` files (loaded with ``weights_only=True``).
        mmap: allow the ``mmap`` mode (default). A memory-mapped parameter is a private
            copy-on-write mapping of the file: pages not yet touched follow later in-place writes
            to the file, and a file truncated afterwards kills the process with ``SIGBUS`` on
            access. ``mmap=False`` reads every tensor into owned memory instead (``direct``).
        num_workers: reader threads (default 4).
        sync: load sequentially (also ``SURGERY_SYNC_LOAD=1``).
        progress: show a progress bar on stderr (default: when stderr is a terminal).
        staging_bytes: the host memory a load to an accelerator reads through: a ring of
            buffers (pinned for CUDA) whose copies to the device overlap the next reads, so the
            host never holds more of the model than that (:mod:`surgery.load.staging`; default
            256 MiB, e.g. ``"1GiB"``). Given for a CPU load, the same ring runs there too (reads
            are otherwise straight into their destinations, and ``mmap`` is not used).

    Returns:
        A :class:`~surgery.LoadReport`; its ``plan`` is the plan that was executed (the one
        :func:`plan_load` returns for the same arguments).

    Raises:
        LoadError: ``strict=True`` and the report lists problems.
        CheckpointError: the checkpoint is missing, corrupt or unsafe.
        ConfigurationError: the mapping is inconsistent (e.g. two converters claim one key), or
            ``device="meta"``.
        KeyboardInterrupt: passed on after pending reads are cancelled; the model then holds a
            partial load and no :class:`LoadRecord`.

    Example:
        >>> report = surgery.load_checkpoint(model, "ckpt/")  # doctest: +SKIP
        >>> report.ok  # doctest: +SKIP
        True
    """
    start = time.perf_counter()
    _refuse_meta_device(device, "load_checkpoint")
    device, mmap = _usable_target(device, staging_bytes, mmap)
    if fsdp not in (None, False) or _named_nd_mesh(device_mesh):
        _shard_first(model, device_mesh, tp_plan=tp_plan, fsdp=fsdp, fusion_config=fusion_config)
        tp_plan = device_mesh = None
    tp = tensor_parallel(model, tp_plan=tp_plan, device_mesh=device_mesh)
    if tp is not None and tp.planned is not None:
        raise ConfigurationError(
            f"device_mesh={device_mesh!r} gives dim sizes, which plan a dry run (plan_load(..., rank=r)); a load "
            "needs the DeviceMesh of the launched ranks (init_device_mesh(...))."
        )
    if tp is not None and tp.mesh is not None and device is None:
        device = tp.mesh.device_type if tp.mesh.device_type == "cpu" else _mesh_device(tp.mesh)
    clear_record(model)  # a failed or interrupted load leaves no record behind
    ranks = _ranks(model, tp, path)
    with _collector_paused(), contextlib.ExitStack() as opened:
        with _undo_on_error(model):
            with ranks.step():  # opening the checkpoint too: a rank that cannot fails every rank
                reader = opened.enter_context(_opened(path, allow_pickle))
                prep = prepare(
                    model,
                    path,
                    device=device,
                    dtype=dtype,
                    fusion_config=fusion_config,
                    reader=reader,
                    tp=tp,
                    mmap=mmap,
                    quantizer=quantizer,
                )
            ranks.agree()
            _same_problems(
                ranks, prep.failures, "planning", "before setting any parameter (the model is unchanged)"
            )
            if strict:  # what planning already shows fails the load before a parameter is set
                _refuse_planned_problems(model, path, prep, start)
        sequential = _sync_requested(sync)
        with ranks.step(), _staging(prep, staging_bytes, 1 if sequential else num_workers or DEFAULT_WORKERS):
            done = _execute(
                model,
                prep,
                workers=num_workers or DEFAULT_WORKERS,
                sequential=sequential,
                progress=progress,
            )
        ranks.agree()
        _same_problems(
            ranks, done.failures, "reading", "after setting the rest (each rank holds a partial load)"
        )
        report = _report(path, prep, done.loaded, done.mapped, done.failures)
        report.left_on_meta = _left_on_meta(model)
        report.bytes_read = reader.bytes_read
        _note_devices(report, prep, model)
        report.transforms_used = record_load(model, prep, [done.work[i] for i in sorted(done.work)], path)
        report.seconds = time.perf_counter() - start
    if strict and not report.ok:
        raise LoadError(f"strict load of {path} failed:\n{report}", report)
    return report


def _ranks(model: nn.Module, tp: TensorParallel | None, path: str | os.PathLike[str]) -> Collective:
    """The ranks that load together: the tensor-parallel mesh's, or those of the model's DTensors.

    A failure on one rank (an error raised, or a tensor only it reads that fails to convert) is
    then raised on every rank, so that none goes on to a collective the others never enter.
    """
    what = f"load_checkpoint of '{os.fspath(path)}'"
    mesh = tp.mesh if tp is not None else None
    try:
        if mesh is not None:
            return Collective.of_mesh(mesh, what=what)
        return Collective.of_tensors(itertools.chain(model.parameters(), model.buffers()), what=what)
    except ConfigurationError:  # an n-D mesh over some ranks of the job: no group holds exactly them
        return Collective(None, what=what)


def _same_problems(
    ranks: Collective, failures: list[tuple[int, ConversionFailure]], phase: str, state: str
) -> None:
    """Every rank found the same conversion failures in ``phase``, or every rank raises.

    A failure every rank has is the report's (the load goes on without those keys, as in one
    process); one that only some ranks found (a NaN scale in a block only one rank reads) would
    leave the ranks with different models, so the load stops on all of them.

    Raises:
        ConversionError: naming the ranks that found a problem and the first one, on every rank.
    """
    seen = ranks.compare({", ".join(f.target_keys): f.message for _, f in failures})
    if seen is None or all(s.keys() == seen[0].keys() for s in seen):
        return
    differ = [k for k in sorted({k for s in seen for k in s}) if not all(k in s for s in seen)]
    found = [r for r, s in enumerate(seen) if differ[0] in s]
    raise ConversionError(
        f"{ranks.what}: {phase} failed on rank{'s' if len(found) > 1 else ''} {', '.join(map(str, found))} of "
        f"{len(seen)} only (every rank raises this, {state}): {differ[0]}: {seen[found[0]][differ[0]]}"
        + (f"; and {len(differ) - 1} more problem(s) not found on every rank" if len(differ) > 1 else "")
    )


def _named_nd_mesh(device_mesh: Any) -> bool:
    """A ``DeviceMesh`` of several dims (FSDP2 and/or TP by dim name)."""
    return getattr(device_mesh, "ndim", 1) > 1 and not isinstance(device_mesh, Mapping)


def _shard_first(model: nn.Module, device_mesh: Any, *, tp_plan: Any, fsdp: Any, fusion_config: Any) -> None:
    """``fsdp=``: TP and FSDP2 applied before planning (TP undone if a check then fails)."""
    if fusion_config:
        raise ConfigurationError(
            "fsdp= with fusion_config=: apply the fusions first (surgery.fusion), then parallelize and shard by hand "
            "(docs/parallel.md) and load with neither."
        )
    if has_dtensors(model):
        raise ConfigurationError(
            "fsdp=: the model is already parallelized; load it with neither tp_plan nor fsdp."
        )
    with _undo_on_error(model):
        shard_model(model, device_mesh, tp_plan=tp_plan, fsdp=fsdp)


def _refuse_planned_problems(
    model: nn.Module, path: str | os.PathLike[str], prep: Prepared, start: float
) -> None:
    """A strict load refuses what the plan already shows (the model is still unchanged)."""
    early = _report(path, prep, [], [], list(prep.failures))
    early.left_on_meta = _left_on_meta(model, _planned(prep))
    if not early.ok:
        early.seconds = time.perf_counter() - start
        raise LoadError(
            f"strict load of {path} refused before setting any parameter (the model is unchanged):\n{early}",
            early,
        )


@dataclass
class _Executed:
    """What running the work list did: the keys set (and memory-mapped), the failures, the work done."""

    failures: list[tuple[int, ConversionFailure]]
    loaded: list[str] = field(default_factory=list)
    mapped: list[str] = field(default_factory=list)
    work: dict[int, Work] = field(default_factory=dict)


def _execute(
    model: nn.Module, prep: Prepared, *, workers: int, sequential: bool, progress: bool | None
) -> _Executed:
    """Run the work list, setting each target in the model as soon as its tensors are ready.

    Sequential when asked, or when a quantizer quantizes on the fly; else on a thread pool.
    """
    done = _Executed(failures=list(prep.failures))
    progress_bar = _Progress(sum(w.entry.nbytes for w in prep.work), progress)

    def finish(w: Work, results: list[tuple[str, torch.Tensor, bool]]) -> None:
        for key, tensor, fresh in results:
            if fresh:
                _set_tensor(model, key, _distributed(prep, key, tensor), prep.runtime[key])
                _retie(model, key, prep.tied)
            done.loaded.append(key)
            if w.entry.mode == Mode.MMAP:
                done.mapped.append(key)
        done.work[w.index] = w
        progress_bar.advance(w.entry.nbytes)

    def fail(w: Work, exc: BaseException) -> None:
        transform = w.entry.transform or "read"
        done.failures.append(
            (w.index, ConversionFailure(transform, w.entry.source_keys, w.entry.target_keys, str(exc)))
        )

    if sequential or any(w.quantizing is not None and w.quantizing.produced for w in prep.work):
        for w in prep.work:
            try:
                results = execute(prep, w)
            except SurgeryError as exc:
                fail(w, exc)
                continue
            finish(w, results)
    else:
        _run_pool(prep, workers, finish, fail)
    return done


def _report(
    path: str | os.PathLike[str],
    prep: Prepared,
    loaded: list[str],
    mapped: list[str],
    failures: list[tuple[int, ConversionFailure]],
) -> LoadReport:
    order = {k: i for i, k in enumerate(prep.runtime)}
    return LoadReport(
        checkpoint=str(path),
        loaded_keys=sorted(loaded, key=order.__getitem__),
        missing_keys=list(prep.plan.missing_keys),
        unexpected_keys=list(prep.plan.unexpected_keys),
        mismatched=list(prep.mismatches),
        conflicts=list(prep.conflicts),
        conversion_errors=[f for _, f in sorted(failures, key=lambda p: p[0])],
        mapped_keys=sorted(mapped, key=order.__getitem__),
        decoded_keys=_decoded(prep, set(loaded)),
        fusions=prep.plan.fusions,
        tp_world_size=prep.plan.tp_world_size,
        tp_rank=prep.plan.tp_rank,
        tp_fallbacks=[
            TPFallback(w.dest_keys, w.sharding.fallback, _fallback_extra(prep, w, w.sharding))
            for w in prep.work
            if w.sharding is not None and w.sharding.fallback is not None
        ],
        notes=list(prep.plan.notes),
        plan=prep.plan,
    )


def _decoded(prep: Prepared, loaded: set[str]) -> list[str]:
    """The checkpoint keys a quantizer decoded for loaded targets, in checkpoint order."""
    keys = {
        k
        for w in prep.work
        if w.quantizing is not None and loaded.intersection(w.dest_keys)
        for k in w.entry.source_keys
        if k in w.quantizing.companions
    }
    return [k for k in prep.reader if k in keys]


def _left_on_meta(model: nn.Module, filled: set[str] | None = None) -> list[str]:
    """Parameters and buffers (persistent or not) on ``meta``, minus ``filled`` (the planned targets)."""
    out = []
    for name, t in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    ):
        if t.device.type == "meta" and (filled is None or name not in filled):
            out.append(name)
    return out


def _planned(prep: Prepared) -> set[str]:
    """Runtime keys the work list fills (tied aliases included)."""
    keys = {k for w in prep.work for k in (*w.dest_keys, *w.entry.quantized)}
    return keys | {alias for k in keys for alias in prep.tied.get(k, ())}


def _fallback_extra(prep: Prepared, w: Work, sh: Sharding) -> int:
    """Bytes a fallback reads beyond the rank's part of its targets."""
    kept = 0
    for key, region in zip(w.dest_keys, sh.regions):
        t = prep.runtime[key]
        kept += math.prod(local_shape(tuple(t.shape), region)) * t.dtype.itemsize
    return max(0, w.entry.nbytes - kept)


def _mesh_device(mesh: Any) -> torch.device:
    """The device this rank's local tensors go to (``cuda:<current>`` for a CUDA mesh)."""
    module = getattr(torch, mesh.device_type, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    return torch.device(mesh.device_type, index)


@contextlib.contextmanager
def _undo_on_error(model: nn.Module) -> Iterator[None]:
    """Planning applies fusions and a tp_plan first; if planning then fails, undo both.

    A load that raises before reading anything must leave the model exactly as it was, fusions
    and parameters included (a fused model would otherwise persist a fusion that never loaded,
    a parallelized one keep DTensors nobody asked for).
    """
    modules = dict(model.named_modules())
    parameters = {path: dict(m._parameters) for path, m in modules.items()}
    hooks = {path: (dict(m._forward_pre_hooks), dict(m._forward_hooks)) for path, m in modules.items()}
    fusions = record_of(model).fusions
    try:
        yield
    except BaseException:
        # Restore parents before children so every path resolves against the original tree.
        for path, original in sorted(modules.items(), key=lambda item: item[0].count(".")):
            if not path:
                continue
            parent_path, _, name = path.rpartition(".")
            parent = modules[parent_path]
            if parent._modules.get(name) is not original:
                parent._modules[name] = original
        for path, original in modules.items():
            original._parameters.clear()
            original._parameters.update(parameters[path])
            pre, post = hooks[path]
            original._forward_pre_hooks.clear()
            original._forward_pre_hooks.update(pre)
            original._forward_hooks.clear()
            original._forward_hooks.update(post)
        update_record(model, fusions=fusions)
        raise


def _run_pool(prep: Prepared, workers: int, finish, fail) -> None:
    """Execute the work list with bounded read-ahead; Ctrl-C cancels what has not started."""
    pending: dict[Future, Work] = {}
    in_flight = 0
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="surgery-load") as pool:
        try:
            for w in prep.work:
                if _runs_inline(w):
                    try:
                        results = execute(prep, w)
                    except SurgeryError as exc:
                        fail(w, exc)
                    else:
                        finish(w, results)
                    continue
                cost = w.entry.nbytes if w.entry.mode == Mode.CONVERT else 0
                while pending and (
                    len(pending) >= 2 * workers or in_flight + cost > max(_READ_AHEAD_BYTES, cost)
                ):
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for f in done:
                        fw = pending.pop(f)
                        in_flight -= fw.entry.nbytes if fw.entry.mode == Mode.CONVERT else 0
                        _collect(f, fw, finish, fail)
                pending[pool.submit(execute, prep, w)] = w
                in_flight += cost
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    _collect(f, pending.pop(f), finish, fail)
        except BaseException:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _runs_inline(w: Work) -> bool:
    """Memory-mapped entries (no I/O) and entries of small tensors are not worth a thread hand-off."""
    entry = w.entry
    return entry.mode == Mode.MMAP or entry.nbytes < _INLINE_BYTES_PER_TENSOR * max(1, len(entry.source_keys))


def _collect(f: Future, w: Work, finish, fail) -> None:
    try:
        results = f.result()
    except SurgeryError as exc:
        fail(w, exc)
        return
    finish(w, results)
