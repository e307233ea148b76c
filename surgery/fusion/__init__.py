"""Fusions: rewrite module instances with torch.fx, with reversible weight transforms.

Map of the package:

* ``spec``: :class:`FusionSpec`, the recipe a family implements (candidates, ``is_fusable``,
  graph match, rewrite, weight transforms) and its declared options.
* ``registry``: :func:`register_fusion` / :func:`get_fusion`; built-in fusions come lazily from
  the ``surgery.catalogs`` entry points.
* ``config``: :func:`validate_fusion_config` (``{"patch_embeddings": True}``, ``{"name": {...}}``).
* ``tracing``: :func:`trace_module` and what lets real model code trace (leaf functions, ...).
* ``variants``: one traced graph per case a forward branches on (train/eval, a cache given or
  ``None``), and the choice among them at each call.
* ``matching``: small matchers and dataflow analyses over fx nodes (reshapes, casts,
  elementwise calls, aliasing, in-place writes) for specs whose patterns call modules.
* ``rewrite``: the on-the-side rewrite and :class:`FusedModule`.
* ``plan``: :class:`FusionPlan`, rendered as text, dict, Mermaid or DOT.
* ``apply``: :func:`preview_fusions`, :func:`apply_fusions` and the record the loader and saver
  read (:func:`fusion_transforms`, :func:`fusion_config_of`, :func:`check_fusion_conflicts`).
"""

from ..record import FusionEntry, FusionRecord
from .apply import (
    apply_fusions,
    check_fusion_conflicts,
    fusion_config_of,
    fusion_transforms,
    preview_fusions,
)
from .config import EnabledFusion, FusionConfig, validate_fusion_config
from .plan import (
    EXCLUDED,
    FUSED,
    SKIPPED,
    WOULD_FUSE,
    FusionCandidate,
    FusionPlan,
    GraphSnapshot,
    TensorSummary,
)
from .registry import find_fusion, fusion_registry_snapshot, get_fusion, list_fusions, register_fusion
from .rewrite import NOTHING_HERE, FusedModule
from .spec import COMMON_OPTIONS, FusionMatch, FusionOption, FusionSpec, GraphRewrite
from .tracing import FusionTracer, register_leaf_function, register_none_argument, trace_module

__all__ = [
    "COMMON_OPTIONS",
    "EXCLUDED",
    "FUSED",
    "NOTHING_HERE",
    "SKIPPED",
    "WOULD_FUSE",
    "EnabledFusion",
    "FusedModule",
    "FusionCandidate",
    "FusionConfig",
    "FusionEntry",
    "FusionMatch",
    "FusionOption",
    "FusionPlan",
    "FusionRecord",
    "FusionSpec",
    "FusionTracer",
    "GraphRewrite",
    "GraphSnapshot",
    "TensorSummary",
    "apply_fusions",
    "check_fusion_conflicts",
    "find_fusion",
    "fusion_config_of",
    "fusion_registry_snapshot",
    "fusion_transforms",
    "get_fusion",
    "list_fusions",
    "preview_fusions",
    "register_fusion",
    "register_leaf_function",
    "register_none_argument",
    "trace_module",
    "validate_fusion_config",
]
