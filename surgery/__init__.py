"""surgery: PyTorch-native model surgery.

Map of the package (one concept per module; ``docs/concepts.md`` has the path of a load):

* ``errors``: the :class:`SurgeryError` hierarchy.
* ``patterns``, ``ops``, ``transforms``, ``converter``, ``routing``: the reversible
  weight-transform engine (the pattern language, tensor ops with exact inverses, renamings,
  converters, and sending every checkpoint key through a transform list once).
* ``registry``, ``graph``, ``resolution``: which conversion mapping applies where.
* ``checkpoint``: the safetensors format, validated lazy reads, atomic streaming writes.
* ``empty``: :func:`init_empty`, build a model with parameters on ``meta`` and real buffers.
* ``meta``: results on ``meta`` by shape arithmetic, so that planning never imports ``torch._dynamo``.
* ``record``: what happened to a model (fusions, the last load's fired transforms with their
  origins, the quantizer), one typed record read with :func:`~surgery.record.record_of`.
* ``model_state``, ``placement``: runtime tensors and ties, placement views (load and save).
* ``load``: plan a load from headers, read straight into place, report.
* ``save``: export back to the original (or the runtime) layout; ``saved_config``: the
  ``config.json`` it writes, describing the tensors written; ``persist``: the fusion and
  quantizer configs persisted with a checkpoint (one reader, one writer).
* ``casting``: the dtype a save writes and whether each cast changed values.
* ``collective``: agreement points of a collective call, so one rank's failure fails them all.
* ``parallel``: tensor parallelism on ``torch.distributed`` (plans, styles, placements, the
  regions of a target that one rank reads).
* ``quantization``: quantizers on the load and save paths, one module per format.
* ``fusion``: torch.fx rewrites of module instances, with preview.
* ``verification``: :func:`verify`, the audit card of a load → save round trip.
* ``cli``, ``demo``, ``examples``, ``bench``, ``auto_model``: the command line, the demo, example
  models, benchmarks, and a transformers model built from a checkpoint's config for the CLI.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names below are imported on first use: ``surgery --help`` needs no torch
    # ``X as X`` is an explicit re-export: type checkers see every name without a literal __all__
    # (isort would put each ``as`` on a line of its own).
    # isort: off
    from . import ops as ops
    from .checkpoint import (
        CheckpointReader as CheckpointReader,
        open_checkpoint as open_checkpoint,
        write_checkpoint as write_checkpoint,
    )
    from .converter import WeightConverter as WeightConverter
    from .empty import init_empty as init_empty
    from .errors import (
        CheckpointError as CheckpointError,
        ConfigurationError as ConfigurationError,
        ConversionError as ConversionError,
        FusionConflictError as FusionConflictError,
        FusionError as FusionError,
        LoadError as LoadError,
        PatternError as PatternError,
        RegistryError as RegistryError,
        SurgeryError as SurgeryError,
    )
    from .fusion import (
        FusionPlan as FusionPlan,
        FusionSpec as FusionSpec,
        apply_fusions as apply_fusions,
        preview_fusions as preview_fusions,
        register_fusion as register_fusion,
    )
    from .graph import ModuleGraph as ModuleGraph
    from .load import (
        ConversionFailure as ConversionFailure,
        LoadPlan as LoadPlan,
        LoadReport as LoadReport,
        Mismatch as Mismatch,
        PlanEntry as PlanEntry,
        load_checkpoint as load_checkpoint,
        plan_load as plan_load,
    )
    from .registry import (
        get_checkpoint_conversion_mapping as get_checkpoint_conversion_mapping,
        register_catalog_modules as register_catalog_modules,
        register_checkpoint_conversion_mapping as register_checkpoint_conversion_mapping,
        registry_snapshot as registry_snapshot,
    )
    from .resolution import (
        explain_model_conversion_mapping as explain_model_conversion_mapping,
        get_model_conversion_mapping as get_model_conversion_mapping,
    )
    from .save import revert_state_dict as revert_state_dict, save_checkpoint as save_checkpoint
    from .transforms import (
        PrefixChange as PrefixChange,
        WeightRenaming as WeightRenaming,
        WeightTransform as WeightTransform,
    )
    from .verification import VerifyCard as VerifyCard, verify as verify
    # isort: on

_LAZY = {
    "CheckpointError": ".errors",
    "CheckpointReader": ".checkpoint",
    "ConfigurationError": ".errors",
    "ConversionError": ".errors",
    "ConversionFailure": ".load",
    "FusionConflictError": ".errors",
    "FusionError": ".errors",
    "FusionPlan": ".fusion",
    "FusionSpec": ".fusion",
    "LoadError": ".errors",
    "LoadPlan": ".load",
    "LoadReport": ".load",
    "Mismatch": ".load",
    "ModuleGraph": ".graph",
    "PatternError": ".errors",
    "PlanEntry": ".load",
    "PrefixChange": ".transforms",
    "RegistryError": ".errors",
    "SurgeryError": ".errors",
    "WeightConverter": ".converter",
    "WeightRenaming": ".transforms",
    "WeightTransform": ".transforms",
    "apply_fusions": ".fusion",
    "explain_model_conversion_mapping": ".resolution",
    "get_checkpoint_conversion_mapping": ".registry",
    "get_model_conversion_mapping": ".resolution",
    "init_empty": ".empty",
    "load_checkpoint": ".load",
    "open_checkpoint": ".checkpoint",
    "ops": ".ops",
    "plan_load": ".load",
    "preview_fusions": ".fusion",
    "register_catalog_modules": ".registry",
    "register_checkpoint_conversion_mapping": ".registry",
    "register_fusion": ".fusion",
    "registry_snapshot": ".registry",
    "revert_state_dict": ".save",
    "save_checkpoint": ".save",
    "verify": ".verification",
    "VerifyCard": ".verification",
    "write_checkpoint": ".checkpoint",
}
"""Public name -> the module that defines it (imported on first access, then cached)."""


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'surgery' has no attribute {name!r}")
    import importlib

    value = importlib.import_module(module, __name__)
    if name != module.lstrip("."):  # a submodule itself (``ops``) or a name defined in it
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__: list[str] = sorted(_LAZY)
"""Every public name, from :data:`_LAZY` (each one also imported under ``TYPE_CHECKING`` above)."""

__version__ = "0.1.0"
