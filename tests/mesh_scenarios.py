"""Every 4-rank n-D scenario in one spawn: ``tests/nd_scenarios.py``, ``tests/fsdp_scenarios.py``,
``tests/dcp_scenarios.py`` and ``tests/ep_scenarios.py``, the example models and, when asked, the transformers families of
the first two.

Starting 4 processes (and importing torch and transformers in each) costs seconds per spawn; the
test modules that check these scenarios (``test_nd_loading``, ``test_fsdp_loading``, their
``interop`` twins, ``test_dcp`` and ``test_expert_parallel``) read one session's facts instead (the ``mesh4_ranks`` fixture in
``tests/conftest.py``). Each rank's facts come back split by suite: ``"nd"``, ``"fsdp"``,
``"dcp"``, ``"ep"``, and their ``-interop`` twins, each the scenario names of its module.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dcp_scenarios
import ep_scenarios
import fsdp_scenarios
import nd_scenarios
import torch
from distsave_scenarios import run_scenarios

from surgery.checkpoint import write_checkpoint

__all__ = ["SUITES", "WORLD", "run", "spawn"]

WORLD = 4
SUITES = {
    "nd": nd_scenarios.scenarios,
    "fsdp": fsdp_scenarios.scenarios,
    "dcp": dcp_scenarios.scenarios,
    "ep": ep_scenarios.scenarios,
}
SEPARATOR = "::"


def _scenarios(work: Path, mesh: Any, families: Mapping[str, tuple[str, ...]]) -> dict[str, Any]:
    """Each suite's scenarios under ``<suite>::<name>``, then its interop ones (when it has
    families) under ``<suite>-interop::<name>``; a suite's scenarios keep their order."""
    out: dict[str, Any] = {}
    for suite, make in SUITES.items():
        for name, scenario in make(work, mesh, ()).items():
            out[f"{suite}{SEPARATOR}{name}"] = scenario
        if families.get(suite):
            for name, scenario in make(work, mesh, families[suite]).items():
                out[f"{suite}-interop{SEPARATOR}{name}"] = scenario
    return out


def run(rank: int, world: int, workdir: str, families: Mapping[str, tuple[str, ...]]) -> None:
    """One rank: every suite's scenarios, in one gloo group."""
    run_scenarios(rank, world, workdir, functools.partial(_scenarios, families=families), barrier=True)


def spawn(
    work: Path, families: Mapping[str, tuple[str, ...]] | None = None, *, deadline_s: float = 900
) -> list[dict[str, dict[str, Any]]]:
    """Write the inputs, run every scenario on ``WORLD`` spawned ranks, return each rank's facts
    by suite. ``families``: the transformers families each suite's interop scenarios load."""
    import torch.multiprocessing as mp

    families = dict(families or {})
    nd_scenarios.write_inputs(work, tuple(sorted({f for s, fs in families.items() if s != "ep" for f in fs})))
    write_checkpoint({f"layers.{i}.weight": torch.ones(8, 4) for i in range(2)}, work / "blocks")
    ep_scenarios.write_inputs(work, families.get("ep", ()))
    context = mp.spawn(run, args=(WORLD, str(work), families), nprocs=WORLD, join=False)
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=max(deadline - time.monotonic(), 0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"the ranks did not finish within {deadline_s} s")
    facts = [json.loads((work / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for f in facts:
        if "crash" in f:
            raise AssertionError(f["crash"])
    by_suite: list[dict[str, dict[str, Any]]] = []
    for f in facts:
        split: dict[str, dict[str, Any]] = {}
        for key, value in f.items():
            suite, name = key.split(SEPARATOR, 1)
            split.setdefault(suite, {})[name] = value
        by_suite.append(split)
    return by_suite
