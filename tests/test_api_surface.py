"""The public surface of ``surgery``: exported names and public signatures.

A change to what users import, or to how they call it, must show up as a diff of this file.
Signatures are compared as text (the annotations as written), so a renamed or re-typed
parameter is visible too.
"""

from __future__ import annotations

import inspect

import pytest

import surgery
from surgery import ops

TOP_LEVEL = [
    "CheckpointError",
    "CheckpointReader",
    "ConfigurationError",
    "ConversionError",
    "ConversionFailure",
    "FusionConflictError",
    "FusionError",
    "FusionPlan",
    "FusionSpec",
    "LoadError",
    "LoadPlan",
    "LoadReport",
    "Mismatch",
    "ModuleGraph",
    "PatternError",
    "PlanEntry",
    "PrefixChange",
    "RegistryError",
    "SurgeryError",
    "VerifyCard",
    "WeightConverter",
    "WeightRenaming",
    "WeightTransform",
    "apply_fusions",
    "explain_model_conversion_mapping",
    "get_checkpoint_conversion_mapping",
    "get_model_conversion_mapping",
    "init_empty",
    "load_checkpoint",
    "open_checkpoint",
    "ops",
    "plan_load",
    "preview_fusions",
    "register_catalog_modules",
    "register_checkpoint_conversion_mapping",
    "register_fusion",
    "registry_snapshot",
    "revert_state_dict",
    "save_checkpoint",
    "verify",
    "write_checkpoint",
]

OPS = [
    "Chunk",
    "Concatenate",
    "Conv3dToLinear",
    "ConversionOp",
    "Interleave",
    "LinearToConv3d",
    "MergeModulelist",
    "OpContext",
    "PermuteForRope",
    "SliceRule",
    "Slot",
    "Split",
    "SplitModulelist",
    "Transpose",
    "reverse_chain",
    "run_chain",
    "stage_contexts",
]

SIGNATURES = {
    "apply_fusions": "(model: 'nn.Module', fusion_config: 'Mapping[str, Any] | FusionConfig | None', *, strict: 'bool' = False) -> 'FusionPlan'",
    "explain_model_conversion_mapping": "(model: 'nn.Module', *, graph: 'ModuleGraph | None' = None) -> 'list[SubmodelResolution]'",
    "get_checkpoint_conversion_mapping": "(key: 'str') -> 'list[WeightTransform]'",
    "get_model_conversion_mapping": "(model: 'nn.Module', *, quantizer: 'object | None' = None, include_legacy: 'bool' = True, graph: 'ModuleGraph | None' = None) -> 'list[WeightTransform]'",
    "load_checkpoint": "(model: 'nn.Module', path: 'str | os.PathLike[str]', *, device: 'torch.device | str | None' = None, dtype: 'torch.dtype | str | None' = None, tp_plan: 'dict[str, Any] | str | None' = None, device_mesh: 'Any' = None, fsdp: 'bool | FSDPOptions | None' = None, quantizer: 'object | None' = None, fusion_config: 'dict[str, Any] | None' = None, strict: 'bool' = False, allow_pickle: 'bool' = False, mmap: 'bool' = True, num_workers: 'int | None' = None, sync: 'bool | None' = None, progress: 'bool | None' = None, staging_bytes: 'int | str | None' = None) -> 'LoadReport'",
    "open_checkpoint": "(path: 'str | os.PathLike[str]', *, allow_pickle: 'bool' = False) -> 'CheckpointReader'",
    "plan_load": "(model: 'nn.Module', path: 'str | os.PathLike[str]', *, device: 'torch.device | str | None' = None, dtype: 'torch.dtype | str | None' = None, tp_plan: 'dict[str, Any] | str | None' = None, device_mesh: 'Any' = None, tp_size: 'int | None' = None, tp_rank: 'int | None' = None, rank: 'int | None' = None, fusion_config: 'dict[str, Any] | None' = None, quantizer: 'object | None' = None, allow_pickle: 'bool' = False, mmap: 'bool' = True) -> 'LoadPlan'",
    "preview_fusions": "(model: 'nn.Module', fusion_config: 'Mapping[str, Any] | FusionConfig | None', *, strict: 'bool' = False) -> 'FusionPlan'",
    "register_catalog_modules": "(*module_prefixes: 'str') -> 'None'",
    "register_checkpoint_conversion_mapping": "(key: 'str', transforms_or_alias: 'Sequence[WeightTransform] | str', overwrite: 'bool' = False) -> 'None'",
    "register_fusion": "(name: 'str', spec: 'FusionSpec', *, overwrite: 'bool' = False) -> 'None'",
    "registry_snapshot": "(*, clear: 'bool' = False, reload_catalogs: 'bool' = False) -> 'Iterator[None]'",
    "revert_state_dict": "(model: 'nn.Module', *, original_format: 'bool' = True, quantization: 'str' = 'as_loaded') -> 'dict[str, torch.Tensor]'",
    "save_checkpoint": "(model: 'nn.Module', path: 'str | os.PathLike[str]', *, original_format: 'bool' = True, max_shard_size: 'int | str' = '5GB', metadata: 'dict[str, str] | None' = None, quantization: 'str' = 'as_loaded', dtype: 'torch.dtype | None' = None) -> 'SavedFiles'",
    "verify": "(model: 'nn.Module | Callable[[], nn.Module]', checkpoint: 'str | os.PathLike[str]', *, fusion_config: 'dict[str, Any] | None' = None, quantizer: 'object | None' = None, tp_plan: 'dict[str, Any] | str | None' = None, device_mesh: 'Any' = None, dtype: 'torch.dtype | str | None' = None, allow: 'Sequence[str]' = (), output: 'str | os.PathLike[str] | None' = None, workdir: 'str | os.PathLike[str] | None' = None, max_shard_size: 'int | str' = '5GB') -> 'VerifyCard'",
    "write_checkpoint": "(state_dict: 'Mapping[str, torch.Tensor]', path: 'str | os.PathLike[str]', *, max_shard_size: 'int | str' = '5GB', metadata: 'Mapping[str, str] | None' = None, specs: 'Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None' = None) -> 'list[Path]'",
    "WeightRenaming": "(source_patterns: 'str | Sequence[str]', target_patterns: 'str | Sequence[str]', *, scope_prefix: 'str | None' = None) -> 'None'",
    "PrefixChange": "(prefix_to_add: 'str | None' = None, prefix_to_remove: 'str | None' = None, model_prefix: 'str | None' = None, *, scope_prefix: 'str | None' = None) -> 'None'",
    "WeightConverter": "(source_patterns: 'str | Sequence[str]', target_patterns: 'str | Sequence[str]', operations: 'Sequence[ConversionOp]' = (), *, scope_prefix: 'str | None' = None) -> 'None'",
    "ModuleGraph": "(model: 'nn.Module') -> 'None'",
}

ROUTING_INTERNALS = ["route_keys", "KeyRoute", "Routing", "TargetGroup"]


def test_top_level_exports_exactly_the_public_names() -> None:
    assert sorted(surgery.__all__) == TOP_LEVEL
    assert all(getattr(surgery, name) is not None for name in TOP_LEVEL)


def test_ops_exports_exactly_the_op_names() -> None:
    assert sorted(ops.__all__) == OPS


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_public_signature_is_unchanged(name: str) -> None:
    assert str(inspect.signature(getattr(surgery, name))) == SIGNATURES[name]


@pytest.mark.parametrize("name", ROUTING_INTERNALS)
def test_routing_internals_live_in_surgery_routing_only(name: str) -> None:
    import surgery.routing

    assert not hasattr(surgery, name)
    assert hasattr(surgery.routing, name)


def test_every_module_declares_all() -> None:
    import importlib
    import pkgutil

    missing = []
    for info in pkgutil.walk_packages(surgery.__path__, "surgery."):
        if info.name == "surgery.__main__":
            continue
        if not hasattr(importlib.import_module(info.name), "__all__"):
            missing.append(info.name)
    assert missing == []


PARALLEL = [
    "ExpertParallel",
    "ExpertsParallel",
    "FSDPOptions",
    "LocalShards",
    "PackedColwiseParallel",
    "PackedLinearParallel",
    "Region",
    "ResolvedStyle",
    "STYLE_NAMES",
    "TPSlice",
    "check_mesh",
    "dcp_state_dict",
    "dtensor_type",
    "dtensors_of",
    "from_local",
    "full_tensor",
    "has_dtensors",
    "is_dtensor",
    "load_dcp",
    "local_region",
    "local_split_sizes",
    "parallelize",
    "param_placements",
    "resolve_tp_plan",
    "save_dcp",
    "shard_model",
    "strided_shard",
]


def test_parallel_exports_exactly_its_public_names_and_each_resolves() -> None:
    import surgery.parallel

    assert sorted(surgery.parallel.__all__) == PARALLEL
    assert all(getattr(surgery.parallel, name) is not None for name in PARALLEL)


TENSOR_RECORDS = [
    ("surgery.checkpoint", "StoredTensor", ("key", "dtype", "shape", "file", "offset", "nbytes")),
    ("surgery.graph", "ModuleTensor", ("shape", "dtype", "device", "tied_to", "persistent")),
    ("surgery.fusion", "TensorSummary", ("shape", "dtype")),
]


@pytest.mark.parametrize(
    ("module", "name", "fields"), TENSOR_RECORDS, ids=[name for _, name, _ in TENSOR_RECORDS]
)
def test_each_record_about_a_tensor_is_named_for_what_it_describes(
    module: str, name: str, fields: tuple[str, ...]
) -> None:
    import dataclasses
    import importlib

    namespace = importlib.import_module(module)
    assert name in namespace.__all__ and "TensorInfo" not in namespace.__all__
    assert tuple(f.name for f in dataclasses.fields(getattr(namespace, name))) == fields
