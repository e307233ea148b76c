"""surgery: PyTorch-native model surgery.

Map of the package (one concept per module):

* ``patterns``, ``ops``, ``transforms``: the reversible weight-transform engine.
* ``routing`` (+ ``fastroute``, ``digitsafety``): every checkpoint key through a transform list, once.
* ``graph``, ``registry``, ``resolution``: which conversion mapping applies where.
* ``safetensors_format``, ``checkpoint``, ``checkpoint_writer``: the file format; lazy,
  validated reads; atomic, streaming writes of single-file and sharded checkpoints.
* ``plan``, ``planning``, ``placement``, ``loading``, ``report``, ``saving``: plan a load from headers, read
  straight into place, load into rewritten models, report, export back.
* ``fusion``: torch.fx rewrites of module instances, with preview.
* ``examples``, ``demo``, ``cli``, ``benchmarks``: example models, the demo, the command line.
* ``errors``: the :class:`SurgeryError` hierarchy.
"""

from . import ops
from .checkpoint import CheckpointReader, open_checkpoint, write_checkpoint
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
from .loading import load_checkpoint, plan_load
from .plan import LoadPlan
from .registry import (
    get_checkpoint_conversion_mapping,
    register_catalog_modules,
    register_checkpoint_conversion_mapping,
    registry_snapshot,
)
from .report import LoadReport
from .resolution import explain_model_conversion_mapping, get_model_conversion_mapping
from .routing import KeyRoute, Routing, TargetGroup, route_keys
from .saving import revert_state_dict, save_checkpoint
from .transforms import PrefixChange, WeightConverter, WeightRenaming, WeightTransform

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "ConfigurationError",
    "ConversionError",
    "FusionError",
    "FusionPlan",
    "FusionSpec",
    "KeyRoute",
    "LoadError",
    "LoadPlan",
    "LoadReport",
    "ModuleGraph",
    "PatternError",
    "PrefixChange",
    "RegistryError",
    "Routing",
    "SurgeryError",
    "TargetGroup",
    "WeightConverter",
    "WeightRenaming",
    "WeightTransform",
    "apply_fusions",
    "explain_model_conversion_mapping",
    "get_checkpoint_conversion_mapping",
    "get_model_conversion_mapping",
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
    "route_keys",
    "save_checkpoint",
    "write_checkpoint",
]

__version__ = "0.1.0"
