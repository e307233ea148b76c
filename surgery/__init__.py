"""surgery: PyTorch-native model surgery.

Map of the package:

* ``patterns``, ``ops``, ``transforms``: the reversible weight-transform engine.
* ``routing`` (+ ``fastroute``): sending checkpoint keys through a transform list.
* ``errors``: the :class:`SurgeryError` hierarchy.
"""

from . import ops
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
from .routing import KeyRoute, Routing, TargetGroup, route_keys
from .transforms import PrefixChange, WeightConverter, WeightRenaming, WeightTransform

__all__ = [
    "CheckpointError",
    "ConfigurationError",
    "ConversionError",
    "FusionError",
    "KeyRoute",
    "LoadError",
    "PatternError",
    "PrefixChange",
    "RegistryError",
    "Routing",
    "SurgeryError",
    "TargetGroup",
    "WeightConverter",
    "WeightRenaming",
    "WeightTransform",
    "ops",
    "route_keys",
]

__version__ = "0.1.0"
