"""The command line: inspect, convert, preview, demo, and clear errors with exit code 2."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

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


class Done(NamedTuple):
    """What one command printed and its exit status, as a shell sees them."""

    returncode: int
    stdout: str
    stderr: str


Cli = Callable[..., Done]


@pytest.fixture
def cli(capsys) -> Cli:
    """``cli(*args)``: ``surgery ARGS`` run in this process through :func:`surgery.cli.main`; argparse's
    own exits (``--help``, usage errors) count with their status, as the process would exit.

    The tests that are about the process itself (``python -m surgery``, a closed pipe) start one.
    """

    def run(*args: str) -> Done:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        out, err = capsys.readouterr()
        return Done(code, out, err)

    return run


@pytest.fixture
def in_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``tmp_path`` as the current directory, as a shell there starts ``surgery``; the modules the
    command imports from it are forgotten afterwards, and ``sys.path`` is restored."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def test_version_and_help_name_the_examples_and_the_factory_form(cli: Cli) -> None:
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("surgery ")
    text = cli("--help").stdout
    assert "example-moe" in text and "package.module:factory" in text and "``" not in text
    convert = cli("convert", "--help").stdout
    assert "5GB, 500MB, 2GiB" in convert and "usage: surgery convert" in convert


def test_a_factory_in_the_current_directory_is_found(
    in_directory: Path, moe_checkpoint: Path, cli: Cli
) -> None:
    (in_directory / "mymodels.py").write_text(
        "from surgery.examples.moe import build_moe_model\n\ndef tiny():\n    return build_moe_model()\n"
    )
    done = cli("inspect", str(moe_checkpoint), "--model", "mymodels:tiny")
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
    in_directory: Path, moe_checkpoint: Path, cli: Cli, source, needle
) -> None:
    (in_directory / "broken.py").write_text(source)
    done = cli("inspect", str(moe_checkpoint), "--model", "broken:tiny")
    assert done.returncode == 2
    assert (
        needle in done.stderr
        and len(done.stderr.strip().splitlines()) == 1
        and "Traceback" not in done.stderr
    )
    sys.modules.pop("broken", None)  # a second start of the command imports the module afresh
    verbose = cli("--verbose", "inspect", str(moe_checkpoint), "--model", "broken:tiny")
    assert "Traceback" in verbose.stderr


def test_convert_refuses_to_overwrite_its_source_and_checks_the_shard_size_first(
    moe_checkpoint: Path, tmp_path, cli: Cli
) -> None:
    same = cli("convert", str(moe_checkpoint), str(moe_checkpoint), "--model", "example-moe")
    assert same.returncode == 2 and "replace the checkpoint being read" in same.stderr
    bad = cli(
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


def test_json_and_mermaid_together_are_refused(cli: Cli) -> None:
    done = cli("preview", "--json", "--mermaid")
    assert done.returncode == 2 and "not allowed with argument --json" in done.stderr


def test_output_into_a_pipe_closed_early_ends_quietly(tmp_path: Path) -> None:
    import torch

    write_checkpoint({f"k{i}.w": torch.zeros(1) for i in range(3000)}, tmp_path)  # a plan of ~1 MB of JSON
    done = subprocess.run(
        f"{sys.executable} -m surgery inspect {tmp_path} --model example-moe --json | head -1; "
        "exit ${PIPESTATUS[0]}",
        shell=True,
        capture_output=True,
        text=True,
        timeout=300,
        executable="/bin/bash",
    )
    assert done.stdout == "{\n" and done.stderr == ""
    assert done.returncode == 141  # 128 + SIGPIPE: what a shell reports for `yes | head -1`


def test_catalog_lists_families_and_aliases(capsys) -> None:
    assert main(["catalog"]) == 0
    out = capsys.readouterr().out
    assert "mixtral" in out and "-> LlavaModel" in out


def test_a_requested_fusion_that_fuses_nothing_is_reported(moe_checkpoint: Path, capsys) -> None:
    assert (
        main(["inspect", str(moe_checkpoint), "--model", "example-moe", "--fusion", "patch_embeddings"]) == 0
    )
    assert "fusion 'patch_embeddings' fused nothing in example-moe" in capsys.readouterr().err


def test_bench_counts_must_be_positive(cli: Cli) -> None:
    done = cli("bench", "route", "--keys", "0")
    assert (
        done.returncode == 2
        and "--keys: 0 must be at least 1" in done.stderr
        and "Traceback" not in done.stderr
    )


def test_a_pickle_checkpoint_needs_allow_pickle_on_the_command_line(tmp_path: Path, cli: Cli) -> None:
    import torch

    torch.save({"w": torch.ones(2)}, tmp_path / "model.bin")
    refused = cli("inspect", str(tmp_path / "model.bin"))
    assert refused.returncode == 2 and "--allow-pickle" in refused.stderr
    allowed = cli("inspect", str(tmp_path / "model.bin"), "--allow-pickle")
    assert allowed.returncode == 0 and "1 tensors" in allowed.stdout


# --------------------------------------------------------------------------- one-line errors, exit code 2


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("surgery") and err.count("\n") == 1, err
    return err


def test_a_failed_convert_is_one_line_naming_the_file_with_the_full_report(tmp_path: Path, capsys) -> None:
    state = original_state_dict(build_moe_model())
    state["model.layers.0.extra.weight"] = state.pop("lm_head.weight")  # one missing, one unexpected
    write_checkpoint(state, tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--model", "example-moe"]) == 2
    err = _one_line_error(capsys)
    assert "strict load failed, nothing written" in err and "PROBLEMS: 1 missing, 1 unexpected" in err
    report = Path(err.split("full report: ")[1].split(";")[0])
    try:
        text = report.read_text()
        assert "lm_head.weight" in text and "model.layers.0.extra.weight" in text
    finally:
        report.unlink()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("plan", "says"),
    [("{not json", "--tp-plan is not JSON"), ('["colwise"]', "--tp-plan is a JSON list")],
    ids=["not-json", "not-an-object"],
)
def test_a_bad_tp_plan_is_one_line(moe_checkpoint: Path, capsys, plan: str, says: str) -> None:
    assert (
        main(["inspect", str(moe_checkpoint), "--model", "example-moe", "--tp", "2", "--tp-plan", plan]) == 2
    )
    assert says in _one_line_error(capsys)


@pytest.mark.parametrize("tp", ["0", "-1", "two"])
def test_a_tp_size_below_one_is_refused_in_one_line(moe_checkpoint: Path, capsys, tp: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(moe_checkpoint), "--model", "example-moe", "--tp", tp])
    assert exit_.value.code == 2
    assert "argument --tp" in _one_line_error(capsys)


def test_a_tp_rank_outside_the_ranks_is_refused(moe_checkpoint: Path, capsys) -> None:
    assert (
        main(["inspect", str(moe_checkpoint), "--model", "example-moe", "--tp", "2", "--tp-rank", "2"]) == 2
    )
    assert "the ranks of --tp 2 are 0..1" in _one_line_error(capsys)


def test_a_many_line_error_is_cut_to_its_first_line_unless_verbose(tmp_path: Path, capsys) -> None:
    from surgery.cli import _one_line

    assert _one_line("first\nsecond\nthird", verbose=False) == "first [2 more line(s): surgery --verbose ...]"
    assert _one_line("first\nsecond", verbose=True) == "first\nsecond"


# --------------------------------------------------------------------------- --dtype and --quantization


def _decoder_checkpoint(tmp_path: Path, *, fp8: bool = False) -> Path:
    from fp8_reference import quantize_state

    from surgery.examples.decoder import build_decoder_model

    state = build_decoder_model(seed=0).state_dict()
    write_checkpoint(quantize_state(state, (16, 16)) if fp8 else state, tmp_path / "src")
    config = {"model_type": "example_decoder", "dtype": "float32"}
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    return tmp_path / "src"


def test_convert_dtype_writes_bfloat16_and_says_the_cast_was_lossy(tmp_path: Path, capsys) -> None:
    from surgery.checkpoint import open_checkpoint

    src = _decoder_checkpoint(tmp_path)
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--model", "example-decoder", "--dtype", "bfloat16"]) == 0
    printed = capsys.readouterr().out
    assert "float32 → bfloat16 (lossy:" in printed
    with open_checkpoint(out) as reader:
        assert {reader.info(k).dtype for k in reader} == {__import__("torch").bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("choice", ["auto", "fp8"])
def test_quantization_reads_an_fp8_checkpoint_and_convert_writes_it_back_bit_for_bit(
    tmp_path: Path, capsys, choice: str
) -> None:
    src = _decoder_checkpoint(tmp_path, fp8=True)
    assert main(["inspect", str(src), "--model", "example-decoder", "--quantization", choice]) == 0
    assert "PROBLEMS" not in capsys.readouterr().out
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--model", "example-decoder", "--quantization", choice]) == 0
    assert filecmp.cmp(src / "model.safetensors", out / "model.safetensors", shallow=False)


def test_quantization_auto_reads_a_compressed_tensors_checkpoint_and_convert_writes_it_back(
    tmp_path: Path, capsys
) -> None:
    from ct_reference import compress_state, scheme

    from surgery.examples.decoder import build_decoder_model

    src = tmp_path / "src"
    state = build_decoder_model(seed=0).state_dict()
    compress_state(state, scheme(num_bits=4, strategy="channel"), src, quantized=lambda k: "_proj." in k)
    assert main(["inspect", str(src), "--model", "example-decoder", "--quantization", "auto"]) == 0
    assert "PROBLEMS" not in capsys.readouterr().out
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--model", "example-decoder", "--quantization", "auto"]) == 0
    assert filecmp.cmp(src / "model.safetensors", out / "model.safetensors", shallow=False)


def test_an_fp8_checkpoint_without_a_quantizer_fails_to_convert(tmp_path: Path, capsys) -> None:
    src = _decoder_checkpoint(tmp_path, fp8=True)
    assert main(["convert", str(src), str(tmp_path / "out"), "--model", "example-decoder"]) == 2
    assert "PROBLEMS" in _one_line_error(capsys)


def test_quantization_int8_quantizes_on_the_fly(tmp_path: Path, capsys) -> None:
    from surgery.checkpoint import open_checkpoint

    src = _decoder_checkpoint(tmp_path)
    out = tmp_path / "out"
    args = ["convert", str(src), str(out), "--model", "example-decoder", "--quantization", "int8"]
    assert main([*args, "--runtime-layout"]) == 0
    with open_checkpoint(out) as reader:
        assert str(reader.info("model.layers.0.mlp.up_proj.weight").dtype) == "torch.int8"


def test_quantization_needs_a_model_to_plan_with(tmp_path: Path, capsys) -> None:
    src = _decoder_checkpoint(tmp_path)
    assert main(["inspect", str(src), "--quantization", "auto"]) == 2
    assert "give --model too" in _one_line_error(capsys)


def test_quantization_auto_over_an_unknown_method_names_it(tmp_path: Path, capsys) -> None:
    src = _decoder_checkpoint(tmp_path)
    (src / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "hqq"}}))
    assert main(["inspect", str(src), "--model", "example-decoder", "--quantization", "auto"]) == 2
    assert "quant_method='hqq', which no registered quantizer reads" in _one_line_error(capsys)


# --------------------------------------------------------------------------- --model transformers:auto


def test_transformers_auto_without_a_config_json_is_one_line(moe_checkpoint: Path, capsys) -> None:
    pytest.importorskip("transformers")
    assert main(["inspect", str(moe_checkpoint), "--model", "transformers:auto"]) == 2
    assert f"no config.json in {moe_checkpoint}" in _one_line_error(capsys)


def test_transformers_auto_without_transformers_installed_is_one_line(
    moe_checkpoint: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes `import transformers` raise ImportError, as when absent.
    monkeypatch.setitem(sys.modules, "transformers", None)
    done = cli("inspect", str(moe_checkpoint), "--model", "transformers:auto")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "needs transformers, which is not installed" in done.stderr


def test_preview_full_is_for_the_mermaid_diagram(capsys) -> None:
    assert main(["preview", "--full"]) == 2
    assert "give --mermaid too" in _one_line_error(capsys)
    assert main(["preview", "--mermaid", "--full"]) == 0
    assert "not shown" not in capsys.readouterr().out


def test_an_unexpected_exception_is_one_line_and_verbose_shows_its_traceback(
    in_directory: Path, cli: Cli
) -> None:
    (in_directory / "broken.py").write_text(
        "import torch\n"
        "class Odd(torch.nn.Module):\n"
        "    def named_modules(self, *args, **kwargs):\n"
        "        raise RuntimeError('named_modules failed\\nsecond line')\n"
        "def factory():\n"
        "    return Odd()\n"
    )
    done = cli("preview", "--model", "broken:factory")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        "surgery: error: unexpected RuntimeError: named_modules failed [1 more line(s)"
    )
    verbose = cli("--verbose", "preview", "--model", "broken:factory")
    assert verbose.returncode == 2 and "Traceback (most recent call last)" in verbose.stderr


def test_inspect_mesh_prints_every_ranks_part_of_an_n_d_mesh(moe_checkpoint: Path, capsys) -> None:
    """``--mesh dp_replicate=2,dp_shard=2``: FSDP2 shards every parameter by rows over
    ``dp_shard``; the two replicas plan the same reads."""
    assert (
        main(
            ["inspect", str(moe_checkpoint), "--model", "example-moe", "--mesh", "dp_replicate=2,dp_shard=2"]
        )
        == 0
    )
    plans = capsys.readouterr().out.split("\n\n")
    assert [p.splitlines()[0].split(":")[0] for p in plans] == [
        f"LoadPlan for {moe_checkpoint} on tensor-parallel rank {r} of 4" for r in range(4)
    ]
    experts = [next(line for line in p.splitlines() if "experts.gate_up_proj" in line) for p in plans]
    assert "Shard(0) 0:2" in experts[0] and "Shard(0) 2:4" in experts[1]
    assert plans[0].split("\n", 1)[1] == plans[2].split("\n", 1)[1]  # replicas read alike


def test_inspect_mesh_with_an_ep_dim_plans_whole_experts_per_rank(moe_checkpoint: Path, capsys) -> None:
    """``--mesh ep=2``: the model's ``ep_plan`` (``expert_parallel``), each rank its half of the experts."""
    assert main(["inspect", str(moe_checkpoint), "--model", "example-moe", "--mesh", "ep=2"]) == 0
    plans = capsys.readouterr().out.split("\n\n")
    experts = [next(line for line in p.splitlines() if "experts.gate_up_proj" in line) for p in plans]
    assert "Shard(0) 0:2" in experts[0] and "Shard(0) 2:4" in experts[1]
    attention = [next(line for line in p.splitlines() if "q_proj" in line) for p in plans]
    assert "Shard" not in attention[0]  # the ep_plan leaves attention whole on every rank


@pytest.mark.parametrize(
    ("mesh", "says"),
    [
        ("tp=2,dp_shard=2", "put them in the order dp_replicate, dp_shard, ep, tp"),
        ("ep=2,tp=2", "one tp_plan shards on one model-parallel dim"),
        ("pp=2", "are not ones a dry run plans"),
        ("dp_shard", "give each dim once as name=size"),
        ("dp_shard=0", "give each dim once as name=size"),
    ],
)
def test_a_bad_mesh_is_one_line(moe_checkpoint: Path, capsys, mesh: str, says: str) -> None:
    assert main(["inspect", str(moe_checkpoint), "--model", "example-moe", "--mesh", mesh]) == 2
    assert says in _one_line_error(capsys)
