"""Failing collective saves, run by every rank of a real 2-process gloo group.

:func:`run` is the body each rank executes (spawned by ``tests/test_distributed_save.py``). The
process group's timeout is :data:`PG_TIMEOUT_S`: a rank left waiting on a collective that a
failed rank never enters would sit there that long, so a scenario that returns in a few seconds
proves nobody waited. Every scenario runs on both ranks, in order, in one group, and records per
rank what the call returned or raised and how long it took, in ``<workdir>/rank<r>.json``.
The scenarios after a failure only pass if the ranks are still in step, so the last one, a
successful save, also checks that no failure left a collective behind.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import surgery
from surgery import WeightConverter, ops
from surgery.checkpoint import write_checkpoint
from surgery.collective import Collective
from surgery.errors import ConversionError
from surgery.examples import dense

PG_TIMEOUT_S = 60
DENSE = dense.ExampleDenseConfig()
WRITE_LIMIT = 16 * 1024  # bytes per file rank 0 may write in the failing-write scenario (the file is ~27 KB)
FILE_BYTES = b"not a directory\n"
PROJECTION_SHARD = 400  # bytes per file: first.weight (768 B), ab.weight (384 B), last.weight (192 B) apart


class RankRefusal(ops.ConversionOp):
    """Identity on every rank but ``rank``, where real (non-meta) tensors raise a ConversionError."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def convert(self, slots, ctx):
        import torch.distributed as dist

        if dist.get_rank() == self.rank and all(s.device.type != "meta" for s in slots):
            raise ConversionError(f"RankRefusal: rank {self.rank} refuses to compute {ctx.where()}.")
        return slots

    @property
    def reverse_op(self) -> ops.ConversionOp:
        return RefusedWhenSaved(self.rank)

    def __repr__(self) -> str:
        return f"RankRefusal({self.rank})"


class RefusedWhenSaved(ops.ConversionOp):
    """Identity when loading; its inverse, run by a save, is :class:`RankRefusal`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def convert(self, slots, ctx):
        return slots

    @property
    def reverse_op(self) -> ops.ConversionOp:
        return RankRefusal(self.rank)

    def __repr__(self) -> str:
        return f"RefusedWhenSaved({self.rank})"


class Projections(nn.Module):
    """Colwise Linears ``first``, ``a``, ``b`` (and ``last``); ``a`` and ``b`` are one checkpoint key.

    ``ab.weight`` is cut in two at load; saving gathers ``a`` and ``b`` (two DTensors, one group)
    and concatenates them, and the mapping's :class:`RankRefusal` then fails on rank 1 only: in
    the middle of the save, or with ``with_last=False`` in its last group. Saved with
    :data:`PROJECTION_SHARD` bytes per file, each key is a file: ``first`` (the largest) goes to
    rank 0, ``ab.weight`` (and ``last``) to rank 1, which computes them.
    """

    def __init__(self, *, with_last: bool = True) -> None:
        super().__init__()
        self.first = nn.Linear(8, 24, bias=False)
        self.a = nn.Linear(8, 6, bias=False)
        self.b = nn.Linear(8, 6, bias=False)
        if with_last:
            self.last = nn.Linear(8, 6, bias=False)
        self.tp_plan = {name: "colwise" for name, _ in self.named_children()}


def register_projections_mapping() -> None:
    surgery.register_checkpoint_conversion_mapping(
        "Projections",
        [WeightConverter("ab.weight", ["a.weight", "b.weight"], [RefusedWhenSaved(1), ops.Chunk(dim=0)])],
        overwrite=True,
    )


def write_inputs(work: Path) -> None:
    """What the scenarios read: the dense checkpoint, a file where a directory goes, an old checkpoint."""
    write_checkpoint(dense.original_state_dict(dense.build_dense_model(DENSE, seed=1)), work / "dense")
    (work / "a-file").write_bytes(FILE_BYTES)
    write_checkpoint(dense.original_state_dict(dense.build_dense_model(DENSE, seed=5)), work / "previous")


def _attempt(call: Callable[[], Any]) -> dict[str, Any]:
    """What ``call`` returned or raised, and how long it took."""
    start = time.monotonic()
    try:
        value = call()
    except Exception as exc:
        return {
            "raised": type(exc).__name__,
            "surgery_error": isinstance(exc, surgery.SurgeryError),
            "message": str(exc),
            "elapsed": time.monotonic() - start,
        }
    names = [Path(p).name for p in value] if isinstance(value, list) else type(value).__name__
    return {"returned": names, "elapsed": time.monotonic() - start}


def _dense_tp(work: Path, mesh: Any) -> nn.Module:
    model = dense.build_dense_model(DENSE, seed=None, device="meta")
    report = surgery.load_checkpoint(model, work / "dense", tp_plan="auto", device_mesh=mesh)
    assert report.ok, report
    return model


def _projections_tp(mesh: Any, *, with_last: bool = True) -> nn.Module:
    from surgery.parallel import parallelize

    register_projections_mapping()
    torch.manual_seed(0)  # the same weights on both ranks; each keeps its own shard
    model = Projections(with_last=with_last)
    parallelize(model, "auto", mesh)
    return model


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()} if path.is_dir() else {}


@contextlib.contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """A real write failure: the kernel refuses writes past ``limit`` bytes of any file (EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def scenarios(work: Path, rank: int, mesh: Any) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    """``(name, scenario)`` in the order every rank runs them."""
    model = _dense_tp(work, mesh)
    out = work / "out"

    def path_is_a_file() -> dict[str, Any]:
        facts = _attempt(lambda: surgery.save_checkpoint(model, work / "a-file"))
        facts["file_unchanged"] = (work / "a-file").read_bytes() == FILE_BYTES
        return facts

    def path_under_a_file() -> dict[str, Any]:
        return _attempt(lambda: surgery.save_checkpoint(model, work / "a-file" / "out"))

    def path_is_a_file_on_rank_1_only() -> dict[str, Any]:
        path = work / ("a-file" if rank == 1 else "rank0-out")
        facts = _attempt(lambda: surgery.save_checkpoint(model, path))
        facts["rank0_path_exists"] = (work / "rank0-out").exists()
        return facts

    def bad_shard_size_on_rank_1_only() -> dict[str, Any]:
        size = "5 parsecs" if rank == 1 else "5GB"
        facts = _attempt(lambda: surgery.save_checkpoint(model, out, max_shard_size=size))
        facts["out_exists"] = out.exists()
        return facts

    def different_failures_on_both_ranks() -> dict[str, Any]:
        path, size = (work / "a-file", "5GB") if rank == 1 else (out, "5 parsecs")
        facts = _attempt(lambda: surgery.save_checkpoint(model, path, max_shard_size=size))
        facts["out_exists"] = out.exists()
        return facts

    def meta_tensor_on_rank_1_only() -> dict[str, Any]:
        broken = _dense_tp(work, mesh)
        if rank == 1:  # a replicated parameter this rank never materialized
            norm = broken.model.norm
            norm.weight = nn.Parameter(torch.empty_like(norm.weight, device="meta"))
        facts = _attempt(lambda: surgery.save_checkpoint(broken, out))
        facts["out_exists"] = out.exists()
        return facts

    def rank_0_write_fails() -> dict[str, Any]:
        before = _files(work / "previous")
        if rank == 0:
            with _file_size_limit(WRITE_LIMIT):
                facts = _attempt(lambda: surgery.save_checkpoint(model, work / "previous"))
        else:
            facts = _attempt(lambda: surgery.save_checkpoint(model, work / "previous"))
        facts["previous_unchanged"] = _files(work / "previous") == before
        facts["previous_size"] = sum(len(b) for b in before.values())
        return facts

    def conversion_error_on_rank_1_only() -> dict[str, Any]:
        projections = _projections_tp(mesh)
        target = work / "projections"
        facts = _attempt(
            lambda: surgery.save_checkpoint(projections, target, max_shard_size=PROJECTION_SHARD)
        )
        facts["target_exists"] = target.exists()
        return facts

    def conversion_error_on_rank_1_only_in_the_last_group() -> dict[str, Any]:
        projections = _projections_tp(mesh, with_last=False)
        target = work / "projections-last"
        facts = _attempt(
            lambda: surgery.save_checkpoint(projections, target, max_shard_size=PROJECTION_SHARD)
        )
        facts["target_exists"] = target.exists()
        return facts

    def foreign_error_in_a_step_on_rank_1_only() -> dict[str, Any]:
        collective = Collective(mesh.get_group(), what="a step")
        causes: list[str] = []

        def step() -> None:
            try:
                with collective.step():
                    if rank == 1:
                        raise RuntimeError("rank 1 ran out of luck")
                collective.agree()
            except Exception as exc:
                causes.append(type(exc.__cause__).__name__)
                raise

        facts = _attempt(step)
        facts["cause"] = causes
        return facts

    def ctrl_c_in_a_step_on_rank_1_only() -> dict[str, Any]:
        collective = Collective(mesh.get_group(), what="a step")

        def step() -> None:
            with collective.step():
                if rank == 1:
                    raise KeyboardInterrupt
            collective.agree()

        try:
            return _attempt(step)
        except KeyboardInterrupt:
            return {"raised": "KeyboardInterrupt"}

    def revert_fails_on_rank_1_only() -> dict[str, Any]:
        projections = _projections_tp(mesh)
        return _attempt(lambda: surgery.revert_state_dict(projections))

    def then_a_save_succeeds() -> dict[str, Any]:
        target = work / "after"
        facts = _attempt(lambda: surgery.save_checkpoint(model, target))
        facts["identical_to_the_original"] = _files(target) == _files(work / "dense")
        return facts

    yield from {
        "path_is_a_file": path_is_a_file,
        "path_under_a_file": path_under_a_file,
        "path_is_a_file_on_rank_1_only": path_is_a_file_on_rank_1_only,
        "bad_shard_size_on_rank_1_only": bad_shard_size_on_rank_1_only,
        "different_failures_on_both_ranks": different_failures_on_both_ranks,
        "meta_tensor_on_rank_1_only": meta_tensor_on_rank_1_only,
        "rank_0_write_fails": rank_0_write_fails,
        "conversion_error_on_rank_1_only": conversion_error_on_rank_1_only,
        "conversion_error_on_rank_1_only_in_the_last_group": conversion_error_on_rank_1_only_in_the_last_group,
        "foreign_error_in_a_step_on_rank_1_only": foreign_error_in_a_step_on_rank_1_only,
        "ctrl_c_in_a_step_on_rank_1_only": ctrl_c_in_a_step_on_rank_1_only,
        "revert_fails_on_rank_1_only": revert_fails_on_rank_1_only,
        "then_a_save_succeeds": then_a_save_succeeds,
    }.items()


def run(rank: int, world: int, workdir: str) -> None:
    run_scenarios(rank, world, workdir, lambda work, mesh: dict(scenarios(work, rank, mesh)))


def run_scenarios(
    rank: int,
    world: int,
    workdir: str,
    make: Callable[[Path, Any], dict[str, Callable[[], Any]]],
    *,
    barrier: bool = False,
) -> None:
    """One rank's body: join the gloo group, run ``make(work, mesh)``'s scenarios in order, write
    their facts to ``<workdir>/rank<r>.json``, leave. ``barrier``: wait for every rank before the
    group is destroyed (when no scenario leaves a rank behind)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    work = Path(workdir)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{work}/pg",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    mesh = init_device_mesh("cpu", (world,))
    facts: dict[str, Any] = {}
    try:
        for name, scenario in make(work, mesh).items():
            facts[name] = scenario()
    except Exception:
        facts["crash"] = traceback.format_exc()
    (work / f"rank{rank}.json").write_text(json.dumps(facts, default=str))
    if barrier:
        dist.barrier()
    dist.destroy_process_group()
    _leave_before_interpreter_teardown()


def _leave_before_interpreter_teardown() -> None:
    """End this rank now that its facts are on disk and its process group is destroyed.

    ``destroy_process_group`` does not free the gloo group: DTensor's sharding cache keeps the
    DTensor specs, their ``DeviceMesh`` and through it the group alive until the interpreter
    clears its modules at exit, and a gloo group destroyed there can abort the process
    ("terminate called without an active exception", SIGABRT; pytorch#65231), by thread timing,
    so rarely and more often on a loaded machine. The likely cause of a CI run that lost a rank
    to that abort (13 checks errored in setup). Nothing a test here checks happens after this
    point: a failure in a scenario is in the facts, and a rank that never gets here still fails.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
