"""surgery: PyTorch-native model surgery.

Map of the package (one concept per module; ``docs/concepts.md`` has the path of a load):

* ``errors``: the :class:`SurgeryError` hierarchy.
* ``patterns``, ``ops``, ``transforms``, ``converter``, ``routing``: the reversible
  weight-transform engine (the pattern language, tensor ops with exact inverses, renamings,
  converters, and sending every checkpoint key through a transform list once).
* ``registry``, ``graph``, ``resolution``: which conversion mapping applies where.
* ``checkpoint``: the safetensors format, validated lazy reads, atomic streaming writes.
* ``empty``: :func:`init_empty`, build a model with parameters on ``meta`` and real buffers.
* ``load``: plan a load from headers, read straight into place, report.
* ``save``: export back to the original (or the runtime) layout.
* ``fusion``: torch.fx rewrites of module instances, with preview.
* ``cli``, ``demo``, ``examples``, ``bench``: the command line, the demo, example models, benchmarks.
"""

from . import ops
from .checkpoint import CheckpointReader, open_checkpoint, write_checkpoint
from .converter import WeightConverter
from .empty import init_empty
from .errors import (
    CheckpointError,
    ConfigurationError,
    ConversionError,
    FusionError,
    LoadError,
    PatternError,
    RegistryError,
    SurgeryError,
)
from .fusion import FusionPlan, FusionSpec, apply_fusions, preview_fusions, register_fusion
from .graph import ModuleGraph
from .load import ConversionFailure, LoadPlan, LoadReport, Mismatch, PlanEntry, load_checkpoint, plan_load
from .registry import (
    get_checkpoint_conversion_mapping,
    register_catalog_modules,
    register_checkpoint_conversion_mapping,
    registry_snapshot,
)
from .resolution import explain_model_conversion_mapping, get_model_conversion_mapping
from .save import revert_state_dict, save_checkpoint
from .transforms import PrefixChange, WeightRenaming, WeightTransform

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "ConfigurationError",
    "ConversionError",
    "ConversionFailure",
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
    "write_checkpoint",
]

__version__ = "0.1.0"
