"""A model that was already parallelized (DTensor parameters) is refused before anything is read.

Sharding on read is not built yet; until it is, loading into DTensors must fail loudly instead
of writing through the wrapper's ``data_ptr()`` (CPU) or silently replacing every DTensor with a
full plain tensor (``meta``). Runs a real one-process gloo group in a subprocess, so this
process's ``torch.distributed`` state stays untouched.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import surgery
    from surgery.checkpoint import write_checkpoint

    work = sys.argv[1]
    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    plain = nn.Sequential(nn.Linear(4, 4))
    write_checkpoint(plain.state_dict(), f"{work}/ckpt")
    out = {}
    for device in ("cpu", "meta"):
        with torch.device(device):
            model = nn.Sequential(nn.Linear(4, 4))
        parallelize_module(model, mesh, {"0": ColwiseParallel()})
        before = {k: type(v).__name__ for k, v in model.state_dict().items()}
        results = []
        for call in (surgery.plan_load, surgery.load_checkpoint):
            try:
                call(model, f"{work}/ckpt")
                results.append(["returned", ""])
            except surgery.ConfigurationError as exc:
                results.append(["ConfigurationError", str(exc)])
            except Exception as exc:
                results.append([type(exc).__name__, str(exc)])
        after = {k: type(v).__name__ for k, v in model.state_dict().items()}
        out[device] = {"results": results, "unchanged": before == after, "types": sorted(set(after.values()))}
    dist.destroy_process_group()
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("dtensor")
    script = Path(work) / "run.py"
    script.write_text(_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(work)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_plan_and_load_refuse_dtensor_parameters_naming_one(outcome: dict, device: str) -> None:
    for kind, message in outcome[device]["results"]:
        assert kind == "ConfigurationError"
        assert "'0.weight' is a DTensor" in message
        assert "parallelize" in message


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_refused_model_keeps_its_dtensors(outcome: dict, device: str) -> None:
    assert outcome[device]["unchanged"]
    assert outcome[device]["types"] == ["DTensor"]
