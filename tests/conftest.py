"""Helpers shared by the test modules, as fixtures."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from surgery.checkpoint import write_checkpoint
from surgery.examples.moe import ExampleMoEConfig, build_moe_model, original_state_dict
from surgery.fusion import fusion_registry_snapshot

WriteOriginal = Callable[..., dict[str, torch.Tensor]]


@pytest.fixture
def isolated_fusion_registry() -> Iterator[None]:
    """Fusions registered by a test are gone after it (the built-in catalog provides patch_embeddings)."""
    with fusion_registry_snapshot():
        yield


def _write_original(
    path: Path, *, dtype: torch.dtype | None = None, **edits: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    sd = original_state_dict(build_moe_model(ExampleMoEConfig(), seed=0, dtype=dtype))
    for key, value in edits.items():
        key = key.replace("__", ".")
        if value is None:
            del sd[key]
        else:
            sd[key] = value
    write_checkpoint(sd, path)
    return sd


@pytest.fixture
def write_original() -> WriteOriginal:
    """``write_original(path, *, dtype=None, **edits)``: the example MoE's per-expert checkpoint.

    ``edits`` replace keys (``None`` drops one; ``__`` stands for ``.`` in the keyword name).
    Returns the state dict written.
    """
    return _write_original


# A zygote: one process per session imports torch (nearly all of a fresh interpreter's ~1.8 s)
# and forks a child per snippet, so that each check still runs in an interpreter where surgery,
# specs, networkx, transformers, torch.distributed.tensor and torch._dynamo are not imported
# (``import torch`` alone imports none of them; test_import checks that). Checks about torch
# itself (``surgery --help`` imports no torch) keep a plain subprocess.
_ZYGOTE = r"""
import json, os, sys, tempfile, traceback
import torch
for line in sys.stdin:
    code = json.loads(line)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
            sys.stdout = os.fdopen(1, "w"); sys.stderr = os.fdopen(2, "w")
            status = 0
            try:
                exec(compile(code, "<fresh>", "exec"), {"__name__": "__main__"})
            except BaseException:
                traceback.print_exc(); status = 1
            sys.stdout.flush(); sys.stderr.flush(); os._exit(status)
        _, status = os.waitpid(pid, 0)
        out.seek(0); err.seek(0)
        reply = [os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()]
    print(json.dumps(reply), flush=True)
"""

FreshPython = Callable[[str], str]


@pytest.fixture(scope="session")
def fresh_python() -> Iterator[FreshPython]:
    """``fresh_python(code)``: run ``code`` in a fresh interpreter that has imported only torch;
    returns its stdout, stripped; a non-zero exit fails the test with the child's stderr."""
    import json
    import subprocess
    import sys
    import textwrap

    root = Path(__file__).resolve().parent.parent
    zygote = subprocess.Popen(
        [sys.executable, "-c", _ZYGOTE], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert zygote.stdin is not None and zygote.stdout is not None

    def run(code: str) -> str:
        zygote.stdin.write(json.dumps(textwrap.dedent(code)) + "\n")
        zygote.stdin.flush()
        status, out, err = json.loads(zygote.stdout.readline())
        assert status == 0, f"the fresh interpreter exited with {status}: {err}"
        return str(out).strip()

    yield run
    zygote.stdin.close()
    zygote.wait(timeout=60)


# The interop modules whose scenarios join the one 4-rank spawn, and the suite each belongs to.
MESH4_INTEROP = {
    "test_nd_loading_interop.py": "nd",
    "test_fsdp_loading_interop.py": "fsdp",
    "test_dcp_interop.py": "dcp",
    "test_expert_parallel_interop.py": "ep",
}


@pytest.fixture(scope="session")
def mesh4_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every 4-rank n-D scenario (``tests/mesh_scenarios.py``) run in one spawn for the session:
    each rank's facts by suite (``"nd"``, ``"fsdp"``, ``"dcp"``, and ``"nd-interop"`` / ``"fsdp-interop"``
    with the ``FAMILIES`` of those interop modules when they are collected and transformers is
    installed)."""
    import importlib.util
    import sys

    families: dict[str, tuple[str, ...]] = {}
    if importlib.util.find_spec("transformers") is not None:
        for item in request.session.items:
            suite = MESH4_INTEROP.get(item.path.name)
            if suite is not None:
                families[suite] = tuple(item.module.FAMILIES)
    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    try:
        import mesh_scenarios
    finally:
        sys.path.remove(here)
    return mesh_scenarios.spawn(tmp_path_factory.mktemp("mesh4"), families)


@pytest.fixture(scope="session")
def tp2_work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The work folder of the one 2-rank spawn: each suite's inputs in ``<tp2_work>/<suite>``."""
    return tmp_path_factory.mktemp("tp2")


@pytest.fixture(scope="session")
def tp2_ranks(request: pytest.FixtureRequest, tp2_work: Path) -> list[dict]:
    """Every 2-rank scenario the collected modules ask for, run in one spawn for the session
    (``tests/tp2_scenarios.py``): a module asks with ``TP2 = (suite, scenario names)``; an
    interop module's suite runs where transformers is installed. Each rank's facts by suite."""
    import importlib.util
    import sys

    has_transformers = importlib.util.find_spec("transformers") is not None
    suites: dict[str, list[str]] = {}
    for item in request.session.items:
        declared = getattr(getattr(item, "module", None), "TP2", None)
        if declared is None or (item.get_closest_marker("interop") and not has_transformers):
            continue
        suite, names = declared
        wanted = suites.setdefault(suite, [])
        wanted.extend(n for n in names if n not in wanted)
    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    try:
        import tp2_scenarios
    finally:
        sys.path.remove(here)
    return tp2_scenarios.spawn(tp2_work, suites)
