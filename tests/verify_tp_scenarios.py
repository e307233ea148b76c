"""``surgery verify`` from a tensor-parallel launch, run by every rank of a real 2-process gloo group.

:func:`scenarios` lists what each rank executes (the session's one 2-rank spawn, ``tests/tp2_scenarios.py``). Every
scenario runs on both ranks, in order, in one process group whose timeout is
:data:`distsave_scenarios.PG_TIMEOUT_S`, and records per rank what :func:`surgery.verify` (or the ``surgery verify``
command, in the rank's own process) returned, printed or raised, in ``<workdir>/rank<r>.json``.
A rank left waiting on a collective that a failed rank never enters would wait that long and
then raise the timeout instead of the failed rank's error; the last scenario, an audit that
passes after the failures, shows that no failure left the ranks out of step.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import surgery
from surgery.checkpoint import open_checkpoint, write_checkpoint
from surgery.cli import main
from surgery.examples import dense

PERTURBED = "model.layers.1.self_attn.o_proj.weight"


def write_inputs(work: Path) -> None:
    """The dense example's checkpoint, and a copy of it with one element of :data:`PERTURBED` changed."""
    write_checkpoint(dense.original_state_dict(dense.build_dense_model(seed=1)), work / "dense")
    with open_checkpoint(work / "dense") as reader:
        state = {k: reader.get_tensor(k) for k in reader.keys()}  # noqa: SIM118 (the reader is not a dict)
    state[PERTURBED][0, 0] += 1e-3
    write_checkpoint(state, work / "perturbed")


def _card(call: Callable[[], surgery.VerifyCard]) -> dict[str, Any]:
    """The card ``call`` returned (as JSON), or what it raised."""
    try:
        return {"card": call().to_dict()}
    except Exception as exc:
        return {
            "raised": type(exc).__name__,
            "surgery_error": isinstance(exc, surgery.SurgeryError),
            "message": str(exc),
        }


def _cli(*argv: str | Path) -> dict[str, Any]:
    """``surgery verify ...`` in this rank's process: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["verify", *map(str, argv)])
    return {"rc": rc, "out": out.getvalue(), "err": err.getvalue()}


def scenarios(work: Path, rank: int, mesh: Any) -> dict[str, Callable[[], dict[str, Any]]]:
    """Name → scenario, in the order every rank runs them."""
    source = work / "dense"

    def dense_on_meta() -> torch.nn.Module:
        return dense.build_dense_model(seed=None, device="meta")

    def fails_on_rank_1() -> torch.nn.Module:
        if rank == 1:
            raise surgery.ConfigurationError("rank 1 cannot build the model")
        return dense_on_meta()

    return {
        "identical": lambda: _card(
            lambda: surgery.verify(dense_on_meta, source, tp_plan="auto", device_mesh=mesh)
        ),
        "cli_identical": lambda: _cli(
            source, "--model", "example-dense", "--tp", "2", "--json", work / "card.json"
        ),
        "cli_perturbed": lambda: _cli(
            source, "--model", "example-dense", "--tp", "2", "--output", work / "perturbed"
        ),
        "build_fails_on_rank_1_only": lambda: _card(
            lambda: surgery.verify(fails_on_rank_1, source, tp_plan="auto", device_mesh=mesh)
        ),
        "output_missing_on_rank_1_only": lambda: _card(
            lambda: surgery.verify(
                dense_on_meta,
                source,
                tp_plan="auto",
                device_mesh=mesh,
                output=work / ("nowhere" if rank == 1 else "dense"),
            )
        ),
        "then_an_audit_passes": lambda: _card(
            lambda: surgery.verify(
                dense_on_meta, source, tp_plan="auto", device_mesh=mesh, max_shard_size=20_000
            )
        ),
    }
