"""Import hygiene: `import surgery` is cheap and touches no global state."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conftest import FreshPython


def test_import_torch_alone_imports_none_of_the_modules_fresh_python_checks_for(
    fresh_python: FreshPython,
) -> None:
    """``fresh_python`` forks from a process that imported torch; the checks below hold only if
    ``import torch`` itself imports none of these."""
    out = fresh_python(
        """
        import sys
        names = ("surgery", "specs", "networkx", "transformers", "torch.distributed.tensor", "torch._dynamo")
        print([name for name in names if name in sys.modules], sys.modules["torch"].cuda.is_initialized())
        """
    )
    assert out == "[] False"


def test_import_does_not_initialize_cuda_or_a_process_group(fresh_python: FreshPython) -> None:
    out = fresh_python(
        """
        import torch, surgery
        import torch.distributed as dist
        print(torch.cuda.is_initialized(), dist.is_available() and dist.is_initialized())
        """
    )
    assert out == "False False"


def test_import_does_not_load_the_catalog_or_networkx(fresh_python: FreshPython) -> None:
    out = fresh_python(
        """
        import sys, surgery
        print('specs' in sys.modules, 'networkx' in sys.modules, 'transformers' in sys.modules)
        """
    )
    assert out == "False False False"


def test_public_names_are_exported() -> None:
    import surgery

    for name in (
        "WeightRenaming",
        "PrefixChange",
        "WeightConverter",
        "register_checkpoint_conversion_mapping",
        "get_model_conversion_mapping",
        "ModuleGraph",
        "load_checkpoint",
        "plan_load",
        "save_checkpoint",
        "revert_state_dict",
        "preview_fusions",
        "apply_fusions",
        "register_fusion",
        "ops",
    ):
        assert name in surgery.__all__
        assert getattr(surgery, name) is not None


def test_import_does_not_import_torch_distributed_tensor(fresh_python: FreshPython) -> None:
    """DTensor support is imported on first tensor-parallel use (it costs about a second)."""
    out = fresh_python(
        """
        import sys, surgery, surgery.parallel, surgery.load
        print('torch.distributed.tensor' in sys.modules)
        """
    )
    assert out == "False"


def test_regions_are_a_leaf_that_ops_imports_without_a_circle(fresh_python: FreshPython) -> None:
    """``surgery.parallel.regions`` imports nothing of surgery; ``ops`` needs only it, ``errors`` and ``meta``."""
    out = fresh_python(
        """
        import sys
        import surgery.parallel.regions
        print(sorted(m for m in sys.modules if m.startswith("surgery.")))
        import surgery.ops
        print(sorted(m for m in sys.modules if m.startswith("surgery.")))
        """
    )
    assert out.splitlines() == [
        "['surgery.parallel', 'surgery.parallel.regions']",
        "['surgery.errors', 'surgery.meta', 'surgery.ops', 'surgery.parallel', 'surgery.parallel.regions']",
    ]


def test_surgery_help_imports_no_torch() -> None:
    """``surgery --help`` and argument errors answer without importing torch (lazy public names)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from surgery.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_public_names_resolve_lazily_and_completely() -> None:
    import surgery

    for name in surgery.__all__:
        assert getattr(surgery, name) is not None
    assert set(surgery.__all__) <= set(dir(surgery))
