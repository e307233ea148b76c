"""Every 2-rank tensor-parallel scenario in one spawn: fusion (``tests/tp_fusion_scenarios.py``),
FP4 (``tests/fp4_scenarios.py``), ``tp_plan="auto"`` on transformers (``tests/hfplan_scenarios.py``)
and ``surgery verify`` under TP (``tests/verify_tp_scenarios.py``).

Starting 2 processes and importing torch and transformers in each costs seconds per spawn; the
test modules that check these scenarios (``test_parallel_fusion``, ``test_quantization_fp4_parallel``, ``test_verify_parallel``,
``interop/test_parallel_fusion_interop``, ``interop/test_hf_tp_plans_interop``) read one session's
facts instead (the ``tp2_ranks`` fixture in ``tests/conftest.py``), which asks only for the suites
of the modules collected. Each suite runs in its own folder of the work folder (``<work>/<suite>``); each rank's facts
come back split by suite, each the scenario names of its module.
"""

from __future__ import annotations

import functools
import json
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distsave_scenarios import run_scenarios

__all__ = ["WORLD", "run", "spawn"]

WORLD = 2
SEPARATOR = "::"


def _crash_guarded(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except Exception:
        return {"crash": traceback.format_exc()}


def _fusion(work: Path, rank: int, mesh: Any, names: Sequence[str]) -> dict[str, Any]:
    import tp_fusion_scenarios

    return {
        n: functools.partial(_crash_guarded, tp_fusion_scenarios.SCENARIOS[n], work, rank, mesh)
        for n in names
    }


def _fp4(work: Path, rank: int, mesh: Any, _names: Sequence[str]) -> dict[str, Any]:
    import fp4_scenarios

    return fp4_scenarios.scenarios(work, rank, mesh)


def _hfplan(work: Path, _rank: int, mesh: Any, _names: Sequence[str]) -> dict[str, Any]:
    import hfplan_scenarios

    return hfplan_scenarios.scenarios(work, mesh)


def _verify(work: Path, rank: int, mesh: Any, _names: Sequence[str]) -> dict[str, Any]:
    import verify_tp_scenarios

    return verify_tp_scenarios.scenarios(work, rank, mesh)


SUITES = {"fusion": _fusion, "fp4": _fp4, "hfplan": _hfplan, "verify": _verify}


def _write_inputs(work: Path, suite: str, names: Sequence[str]) -> None:
    if suite == "fusion":
        import tp_fusion_scenarios

        tp_fusion_scenarios.write_checkpoints(work, list(names))
    elif suite == "fp4":
        import fp4_scenarios

        fp4_scenarios.write_inputs(work)
    elif suite == "hfplan":
        import hfplan_scenarios

        hfplan_scenarios.write_inputs(work)
    else:
        import verify_tp_scenarios

        verify_tp_scenarios.write_inputs(work)


def _scenarios(work: Path, mesh: Any, rank: int, suites: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for suite, names in suites.items():
        for name, scenario in SUITES[suite](work / suite, rank, mesh, names).items():
            out[f"{suite}{SEPARATOR}{name}"] = scenario
    return out


def run(rank: int, world: int, workdir: str, suites: Mapping[str, Sequence[str]]) -> None:
    """One rank: every requested suite's scenarios, in one gloo group."""
    run_scenarios(rank, world, workdir, functools.partial(_scenarios, rank=rank, suites=suites), barrier=True)


def spawn(
    work: Path, suites: Mapping[str, Sequence[str]], *, deadline_s: float = 900
) -> list[dict[str, dict[str, Any]]]:
    """Write each suite's inputs, run its scenarios on ``WORLD`` spawned ranks, return each rank's
    facts by suite. ``suites``: suite name (``fusion``, ``fp4``, ``hfplan``, ``verify``) to the scenario names
    it runs (only ``fusion`` picks among its scenarios; the others run all of theirs)."""
    import torch.multiprocessing as mp

    suites = {s: list(suites[s]) for s in SUITES if s in suites}  # in SUITES' order
    for suite, names in suites.items():
        (work / suite).mkdir()
        _write_inputs(work / suite, suite, names)
    context = mp.spawn(run, args=(WORLD, str(work), suites), nprocs=WORLD, join=False)
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
        split: dict[str, dict[str, Any]] = {s: {} for s in suites}
        for key, value in f.items():
            suite, name = key.split(SEPARATOR, 1)
            split[suite][name] = value
        by_suite.append(split)
    return by_suite
