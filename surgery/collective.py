"""Collective work that fails on every rank together: agreement points between the ranks.

A collective call (a distributed save: the ranks send each other the parts of each group's
DTensors, each writes its files, rank 0 commits) hangs when one rank fails and the others wait in a collective it will never enter:
until the process group's timeout (30 minutes by default), whose error then hides the cause.
:class:`Collective` prevents that with *agreement points*: places in the call that every rank
reaches, in the same order, where the ranks exchange whether one of them failed. Local work
runs inside :meth:`Collective.step`; a failure there is shared at once, at the agreement point
the other ranks reach next, and every rank raises the same error, naming the failed rank and
the cause.

The rule that keeps it free of deadlocks: between two agreement points a rank enters only
collectives that no local failure can make it skip (a group's DTensors are gathered *before*
anything is computed from them). A failed rank's next collective is then an agreement point,
and so is every other rank's.

Example:
    >>> c = Collective(None, what="save_checkpoint to 'out'")  # one process: nothing to agree on
    >>> with c.step():
    ...     pass
    >>> c.agree()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple, NoReturn

import torch

from . import errors
from .errors import CheckpointError, ConfigurationError, SurgeryError
from .parallel import is_dtensor

__all__ = ["Collective"]

_ERROR_CLASSES: dict[str, type[SurgeryError]] = {
    name: cls
    for name in errors.__all__
    if isinstance(cls := getattr(errors, name), type) and issubclass(cls, SurgeryError)
}


class _Failure(NamedTuple):
    """What one rank tells the others: where it failed, the class to raise and the cause."""

    rank: int
    what: str  # the call as that rank names it (its own path, say)
    error_class: str  # a name in :mod:`surgery.errors`
    cause: str


def _error_class(exc: BaseException) -> type[SurgeryError]:
    """The nearest class of :mod:`surgery.errors` ``exc`` is, so every rank can raise it."""
    for cls in type(exc).__mro__:
        if _ERROR_CLASSES.get(cls.__name__) is cls:
            return cls  # type: ignore[return-value]
    return CheckpointError if isinstance(exc, OSError) else SurgeryError


def _raised_from(exc: BaseException, shared: BaseException | None) -> bool:
    """Whether ``exc`` is ``shared``, or was raised from it or while handling it (a cleanup)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and shared is not None and id(current) not in seen:
        if current is shared:
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _cause(exc: BaseException) -> str:
    if isinstance(exc, SurgeryError):
        return str(exc)  # already says what, where and how to fix it
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Collective:
    """A call every rank of ``group`` makes together, whose failure on one rank is raised on all.

    Args:
        group: the ``torch.distributed`` process group; ``None`` for one process (then
            :meth:`step` lets an error through unchanged and :meth:`agree` does nothing).
        what: the call, as an error names it (``"save_checkpoint to 'out/'"``).
        device_type: where the group's collectives take tensors (the mesh's, e.g. ``"cpu"``
            for gloo, ``"cuda"`` for NCCL).
    """

    def __init__(self, group: Any, *, what: str, device_type: str = "cpu") -> None:
        self._group = group
        self.what = what
        self._device_type = device_type
        self._shared: SurgeryError | None = None  # the last error every rank raised

    @classmethod
    def of_tensors(cls, tensors: Iterable[torch.Tensor], *, what: str) -> Collective:
        """The collective over the ranks of the DTensors in ``tensors`` (one process if none).

        DTensors on one 1-D mesh of every rank: its group. On an n-D mesh, a sub-mesh (TP on
        ``mesh["tp"]``, replicated over the other dims) or several meshes (FSDP2 over TP leaves
        some on a sub-mesh of the root mesh): the default process group, so that every rank of
        the root mesh takes part once (not one call per sub-mesh).
        """
        meshes: dict[Any, Any] = {}  # equal meshes are one (DeviceMesh hashes by its ranks and shape)
        for t in tensors:
            if is_dtensor(t):
                mesh = t.device_mesh  # type: ignore[attr-defined]
                meshes.setdefault(mesh, mesh)
        spread = [m for m in meshes.values() if m.size() > 1]
        if not spread:
            return cls(None, what=what)
        mesh = spread[0]
        return cls(_root_group(mesh, several=len(meshes) > 1), what=what, device_type=mesh.device_type)

    @classmethod
    def of_mesh(cls, mesh: Any, *, what: str) -> Collective:
        """The collective over every rank of ``mesh``'s root mesh (one process for a mesh of one).

        Raises:
            ConfigurationError: the root mesh is n-D and covers only some ranks of the default group.
        """
        if mesh.size() <= 1:
            return cls(None, what=what)
        return cls(_root_group(mesh, several=False), what=what, device_type=mesh.device_type)

    @property
    def group(self) -> Any:
        """The ``torch.distributed`` process group (``None`` for one process)."""
        return self._group

    @property
    def rank(self) -> int:
        """This process's rank in the group (0 for one process)."""
        if self._group is None:
            return 0
        import torch.distributed as dist

        return dist.get_rank(self._group)

    @property
    def size(self) -> int:
        """How many ranks the group has (1 for one process)."""
        if self._group is None:
            return 1
        import torch.distributed as dist

        return dist.get_world_size(self._group)

    def global_rank(self, rank: int) -> int:
        """The global rank (``torch.distributed``'s default group) of ``rank`` of this group."""
        if self._group is None:
            return rank
        import torch.distributed as dist

        return dist.get_global_rank(self._group, rank)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Local work (no collective a failure could skip): a failure is shared with every rank now.

        Raises:
            SurgeryError: the work failed here (the error of :meth:`agree`, from the original),
                or it raised the error an agreement point inside it shared.
        """
        try:
            yield
        except BaseException as exc:
            if self._group is None or _raised_from(exc, self._shared):
                raise  # one process, or every rank already raised it and left the call
            self._fail(exc)

    def agree(self) -> None:
        """An agreement point: every rank calls it at the same place; raises if any rank failed.

        Raises:
            SurgeryError: of the failed rank's error class (a class of :mod:`surgery.errors`),
                naming the rank and its cause; the same on every rank.
        """
        if self._group is not None:
            self._exchange(None)

    def compare(self, problems: Mapping[str, str]) -> list[dict[str, str]] | None:
        """What each rank found wrong (``problems``: what → why), in rank order; ``None`` when no rank found any.

        One flag is exchanged; the problems only when a rank has some. Call it where
        :meth:`agree` may be called: each rank then decides the same from the same values.
        """
        mine = dict(problems)
        if self._group is None:
            return [mine] if mine else None
        import torch.distributed as dist

        flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=self._device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if not int(flag.item()):
            return None
        return [dict(p) for p in self.gather(mine)]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank; ``[value]`` in one process.

        A collective no local failure may skip: call it right after :meth:`agree`.
        """
        if self._group is None:
            return [value]
        import torch.distributed as dist

        gathered: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(gathered, value, group=self._group)
        return gathered

    def _fail(self, exc: BaseException) -> NoReturn:
        try:
            self._exchange(_Failure(self.rank, self.what, _error_class(exc).__name__, _cause(exc)))
        except SurgeryError as shared:
            if not isinstance(exc, Exception):
                raise exc from None  # Ctrl-C stays Ctrl-C here; the other ranks raise the error
            raise shared from exc
        raise AssertionError("an exchange with a failure always raises")  # pragma: no cover

    def _device(self) -> torch.device:
        """Where this group's collectives take tensors."""
        if self._device_type == "cpu":
            return torch.device("cpu")
        module = torch.get_device_module(self._device_type)
        return torch.device(self._device_type, module.current_device())

    def _exchange(self, failure: _Failure | None) -> None:
        import torch.distributed as dist

        flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32, device=self._device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if not int(flag.item()):
            return
        gathered: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(gathered, failure, group=self._group)
        error = _shared_error([_Failure(*f) for f in gathered if f is not None], len(gathered))
        self._shared = error
        raise error


def _root_group(mesh: Any, *, several: bool) -> Any:
    """The process group of every rank of ``mesh``'s root mesh (the mesh it was sliced from).

    A 1-D root mesh: its own group. Otherwise the default group, which must then hold exactly
    the root mesh's ranks (``torch.distributed`` makes a group over other ranks only with every
    rank of the default group taking part).

    Raises:
        ConfigurationError: the root mesh is n-D and covers only some ranks of the default group.
    """
    import torch.distributed as dist

    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh  # torch's one way to it
    if root.ndim == 1 and not several:
        return root.get_group()
    if root.size() != dist.get_world_size():
        raise ConfigurationError(
            f"The model's DTensors live on a {root.ndim}-D mesh of {root.size()} ranks inside a process "
            f"group of {dist.get_world_size()}; a collective save or revert runs over every rank of the "
            "mesh through the default group. Launch the job with one rank per mesh device, or save from "
            "a model on a 1-D mesh."
        )
    return dist.group.WORLD


def _shared_error(failures: list[_Failure], size: int) -> SurgeryError:
    """The error every rank raises: the lowest failed rank's class and cause, the others' causes after."""
    failures.sort()
    first = failures[0]
    same = [f.rank for f in failures if f.cause == first.cause]
    where = f"rank {same[0]}" if len(same) == 1 else "ranks " + ", ".join(map(str, same))
    others = "".join(f"; rank {f.rank} failed too: {f.cause}" for f in failures if f.cause != first.cause)
    cls = _ERROR_CLASSES.get(first.error_class, SurgeryError)
    return cls(f"{first.what} failed on {where} of {size} (every rank raises this): {first.cause}{others}")
