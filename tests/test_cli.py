"""The command line: inspect, convert, preview, demo, and clear errors with exit code 2."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from surgery.checkpoint import write_checkpoint
from surgery.cli import main
from surgery.examples.moe import build_moe_model, original_state_dict
from surgery.load.plan import LoadPlan

SHARD = 40_000  # bytes: the example checkpoint (~64 KB) takes two shards


@pytest.fixture
def moe_checkpoint(tmp_path: Path) -> Path:
    """The ``example-moe`` model's original per-expert checkpoint, sharded."""
    write_checkpoint(original_state_dict(build_moe_model()), tmp_path / "src", max_shard_size=SHARD)
    return tmp_path / "src"


def test_inspect_summarizes_a_checkpoint_with_folded_keys(moe_checkpoint: Path, capsys) -> None:
    assert main(["inspect", str(moe_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{moe_checkpoint}: 41 tensors in 2 file(s)")
    assert "model.layers.{0..1}.block_sparse_moe.experts.{0..3}.w1.weight" in out


def test_inspect_with_a_model_prints_the_load_plan(moe_checkpoint: Path, capsys) -> None:
    assert main(["inspect", str(moe_checkpoint), "--model", "example-moe"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"LoadPlan for {moe_checkpoint}: 21 targets")
    assert "model.layers.{0..1}.mlp.experts.gate_up_proj" in out


def test_inspect_json_is_a_load_plan(moe_checkpoint: Path, capsys) -> None:
    assert main(["inspect", str(moe_checkpoint), "--model", "example-moe", "--json"]) == 0
    plan = LoadPlan.from_json(capsys.readouterr().out)
    assert len(plan.entries) == 21 and not plan.problems


def test_convert_round_trips_byte_identically(moe_checkpoint: Path, tmp_path: Path, capsys) -> None:
    assert (
        main(
            [
                "convert",
                str(moe_checkpoint),
                str(tmp_path / "out"),
                "--model",
                "example-moe",
                "--max-shard-size",
                str(SHARD),
            ]
        )
        == 0
    )
    assert "OK" in capsys.readouterr().out
    names = sorted(p.name for p in moe_checkpoint.iterdir())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == names
    assert all(filecmp.cmp(moe_checkpoint / n, tmp_path / "out" / n, shallow=False) for n in names)


def test_convert_to_the_runtime_layout(moe_checkpoint: Path, tmp_path: Path, capsys) -> None:
    assert (
        main(
            [
                "convert",
                str(moe_checkpoint),
                str(tmp_path / "rt"),
                "--model",
                "example-moe",
                "--runtime-layout",
            ]
        )
        == 0
    )
    assert main(["inspect", str(tmp_path / "rt")]) == 0
    assert "model.layers.{0..1}.mlp.experts.gate_up_proj" in capsys.readouterr().out


def test_convert_of_an_incomplete_checkpoint_fails_with_exit_code_2(tmp_path: Path, capsys) -> None:
    write_checkpoint({"lm_head.weight": build_moe_model().lm_head.weight.detach()}, tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--model", "example-moe"]) == 2
    assert "strict load" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_preview_shows_what_the_fusion_would_change(capsys) -> None:
    assert main(["preview"]) == 0
    out = capsys.readouterr().out
    assert "nothing was changed" in out and "patch_embed" in out


def test_preview_json_is_valid(capsys) -> None:
    assert main(["preview", "--json"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), dict)


def test_demo_quick_passes(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--quick", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.count("PASS") == 3  # --quick: without the quantization part


def test_unknown_model_is_a_clear_error_with_exit_code_2(moe_checkpoint: Path, capsys) -> None:
    assert main(["inspect", str(moe_checkpoint), "--model", "example-mo"]) == 2
    err = capsys.readouterr().err
    assert "example-mo" in err and "Did you mean 'example-moe'?" in err


def test_unimportable_model_factory_is_a_clear_error(moe_checkpoint: Path, capsys) -> None:
    assert main(["inspect", str(moe_checkpoint), "--model", "no_such_module:factory"]) == 2
    assert "cannot import 'factory' from 'no_such_module'" in capsys.readouterr().err


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path, capsys) -> None:
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_python_dash_m_surgery_exits_with_code_2_on_a_bad_model(moe_checkpoint: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "surgery", "inspect", str(moe_checkpoint), "--model", "nope"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("surgery: error: --model 'nope' is neither a built-in example")


# --------------------------------------------------------------------------- a CLI that fits a shell


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "surgery", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_version_and_help_name_the_examples_and_the_factory_form() -> None:
    version = _run("--version")
    assert version.returncode == 0 and version.stdout.startswith("surgery ")
    text = _run("--help").stdout
    assert "example-moe" in text and "package.module:factory" in text and "``" not in text
    convert = _run("convert", "--help").stdout
    assert "5GB, 500MB, 2GiB" in convert and "usage: surgery convert" in convert


def test_a_factory_in_the_current_directory_is_found(tmp_path: Path, moe_checkpoint: Path) -> None:
    (tmp_path / "mymodels.py").write_text(
        "from surgery.examples.moe import build_moe_model\n\ndef tiny():\n    return build_moe_model()\n"
    )
    done = _run("inspect", str(moe_checkpoint), "--model", "mymodels:tiny", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "LoadPlan" in done.stdout


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("def tiny(size):\n    return None\n", "must take no arguments"),
        ("def tiny():\n    raise RuntimeError('no GPU here')\n", "tiny() raised RuntimeError: no GPU here"),
        ("raise ImportError('broken module')\n", "cannot import 'tiny'"),
    ],
    ids=["needs-arguments", "raises", "import-fails"],
)
def test_a_broken_factory_is_one_line_with_exit_code_2(
    tmp_path: Path, moe_checkpoint: Path, source, needle
) -> None:
    (tmp_path / "broken.py").write_text(source)
    done = _run("inspect", str(moe_checkpoint), "--model", "broken:tiny", cwd=tmp_path)
    assert done.returncode == 2
    assert (
        needle in done.stderr
        and len(done.stderr.strip().splitlines()) == 1
        and "Traceback" not in done.stderr
    )
    verbose = _run("--verbose", "inspect", str(moe_checkpoint), "--model", "broken:tiny", cwd=tmp_path)
    assert "Traceback" in verbose.stderr


def test_convert_refuses_to_overwrite_its_source_and_checks_the_shard_size_first(
    moe_checkpoint: Path, tmp_path
) -> None:
    same = _run("convert", str(moe_checkpoint), str(moe_checkpoint), "--model", "example-moe")
    assert same.returncode == 2 and "replace the checkpoint being read" in same.stderr
    bad = _run(
        "convert",
        str(moe_checkpoint),
        str(tmp_path / "out"),
        "--model",
        "example-moe",
        "--max-shard-size",
        "5XB",
    )
    assert bad.returncode == 2 and "Cannot parse size '5XB'" in bad.stderr
    assert not (tmp_path / "out").exists()


def test_json_and_mermaid_together_are_refused() -> None:
    done = _run("preview", "--json", "--mermaid")
    assert done.returncode == 2 and "not allowed with argument --json" in done.stderr


def test_a_closed_pipe_is_one_line_with_exit_code_2(tmp_path: Path) -> None:
    import torch

    write_checkpoint({f"k{i}.w": torch.zeros(1) for i in range(3000)}, tmp_path)  # a plan of ~1 MB of JSON
    done = subprocess.run(
        f"{sys.executable} -m surgery inspect {tmp_path} --model example-moe --json | head -c 100 > /dev/null; "
        "exit ${PIPESTATUS[0]}",
        shell=True,
        capture_output=True,
        text=True,
        timeout=300,
        executable="/bin/bash",
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "surgery: error: output closed early (broken pipe)"


def test_catalog_lists_families_and_aliases(capsys) -> None:
    assert main(["catalog"]) == 0
    out = capsys.readouterr().out
    assert "mixtral" in out and "-> LlavaModel" in out


def test_a_requested_fusion_that_fuses_nothing_is_reported(moe_checkpoint: Path, capsys) -> None:
    assert (
        main(["inspect", str(moe_checkpoint), "--model", "example-moe", "--fusion", "patch_embeddings"]) == 0
    )
    assert "fusion 'patch_embeddings' fused nothing in example-moe" in capsys.readouterr().err


def test_bench_counts_must_be_positive() -> None:
    done = _run("bench", "route", "--keys", "0")
    assert (
        done.returncode == 2
        and "--keys: 0 must be at least 1" in done.stderr
        and "Traceback" not in done.stderr
    )


def test_a_pickle_checkpoint_needs_allow_pickle_on_the_command_line(tmp_path: Path) -> None:
    import torch

    torch.save({"w": torch.ones(2)}, tmp_path / "model.bin")
    refused = _run("inspect", str(tmp_path / "model.bin"))
    assert refused.returncode == 2 and "--allow-pickle" in refused.stderr
    allowed = _run("inspect", str(tmp_path / "model.bin"), "--allow-pickle")
    assert allowed.returncode == 0 and "1 tensors" in allowed.stdout
