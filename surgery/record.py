"""What happened to a model: the one record that fusing, loading and quantizing leave on it.

A model carries one :class:`ModelRecord` in one attribute (read with :func:`record_of`, written
with :func:`update_record`, never through attributes of its own): the fusions applied to it, what its last load did, and the
quantizer that prepared it. Saving reads it to invert exactly what happened. Each transform a
load used is kept as a :class:`Fired` value with its :class:`Origin`, so a save chooses what to
invert by filtering on the origin, not by comparing text.

Example:
    >>> from torch import nn
    >>> record_of(nn.Linear(2, 2))
    ModelRecord(fusions=None, load=None, quantizer=None)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

import torch
from torch import nn

from .errors import ConfigurationError
from .transforms import WeightTransform

__all__ = [
    "Fired",
    "FusionEntry",
    "FusionRecord",
    "LoadRecord",
    "ModelRecord",
    "Origin",
    "record_of",
    "update_record",
]

_ATTRIBUTE = "_surgery_record"  # the one attribute written on a model; read it with record_of


class Origin(str, Enum):
    """Why a transform was in the list a load routed through.

    Attributes:
        MAPPING: the model's conversion mapping (the catalog or a user's registration), as a
            quantizer's ``update_weight_conversions`` left it.
        LEGACY: a built-in legacy rename (``LayerNorm.gamma`` → ``.weight``).
        BASE_PREFIX_BEFORE: ``base_model_prefix`` added to or stripped from the checkpoint key
            before the renamings ran (the first renaming).
        BASE_PREFIX_AFTER: ``base_model_prefix`` added to or stripped from the renamed key (the
            last renaming).
        QUANTIZER: a conversion the load's quantizer added (``get_weight_conversions``).
        FUSION: a weight transform of a fusion applied to the model.
    """

    MAPPING = "mapping"
    LEGACY = "legacy"
    BASE_PREFIX_BEFORE = "base_prefix_before"
    BASE_PREFIX_AFTER = "base_prefix_after"
    QUANTIZER = "quantizer"
    FUSION = "fusion"


@dataclass(frozen=True)
class Fired:
    """One transform whose output a load put into the model, and where it came from."""

    transform: WeightTransform
    origin: Origin


@dataclass
class LoadRecord:
    """What a load did, so that saving can invert exactly that.

    Attributes:
        fired: the transforms whose output was loaded, in routing order, each with its origin.
        source_dtypes: checkpoint dtype of every checkpoint key that was loaded (checkpoint order:
            shard order, then position in the shard).
        source_shapes: checkpoint shape of every checkpoint key that was loaded (same order).
        source_shards: per loaded checkpoint key, the index of the file that held it, so a save
            with the same ``max_shard_size`` puts every key back into the same shard.
        loaded_keys: runtime keys that were loaded.
        checkpoint: the path loaded.
        companions: per checkpoint key decoded by a quantizer, the companion tensors read with
            it (FP8 block scales), kept so that a save re-encodes with exactly these.
        quantizer: the quantizer of the load (``None`` without one).
        residues: per converter group (its smallest runtime key), what an op of its chain dropped
            at load (:attr:`surgery.ops.OpContext.keep_residue`: the padding rows of an unpadded
            vocabulary), for the reversed op to put back on save. Only the dropped data.
    """

    fired: list[Fired] = field(default_factory=list)
    source_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    source_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    source_shards: dict[str, int] = field(default_factory=dict)
    loaded_keys: set[str] = field(default_factory=set)
    checkpoint: str = ""
    companions: dict[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)
    quantizer: Any = None
    residues: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def transforms(self) -> list[WeightTransform]:
        """The transforms that fired, in order (without their origins)."""
        return [f.transform for f in self.fired]

    def of(self, *origins: Origin) -> list[WeightTransform]:
        """The transforms that fired with one of ``origins``, in order."""
        return [f.transform for f in self.fired if f.origin in origins]


@dataclass(frozen=True)
class FusionEntry:
    """One applied rewrite.

    Attributes:
        fusion: the fusion name.
        path: the dotted path of the fused module.
        original_class / fused_class: class names before and after.
        transforms: the transform prototypes (original → fused layout), scoped to ``path``.
        source_keys: the model-level keys (original layout) the transforms consume.
    """

    fusion: str
    path: str
    original_class: str
    fused_class: str
    transforms: tuple[WeightTransform, ...]
    source_keys: tuple[str, ...]


@dataclass
class FusionRecord:
    """What :func:`apply_fusions` did to one model: the config in force and every rewrite."""

    config: dict[str, Any]
    entries: list[FusionEntry] = field(default_factory=list)


@dataclass
class ModelRecord:
    """Everything `surgery` did to one model.

    Attributes:
        fusions: the fusions applied (:func:`surgery.apply_fusions`), or ``None``.
        load: what the last successful load did, or ``None`` (never loaded, or the last load failed).
        quantizer: the quantizer that prepared the model's modules (an on-the-fly quantizer), so a
            runtime-layout save writes its metadata even when the model was quantized outside a load.
    """

    fusions: FusionRecord | None = None
    load: LoadRecord | None = None
    quantizer: Any = None


def record_of(model: nn.Module) -> ModelRecord:
    """The record of ``model``: what was done to it (an empty record if nothing was).

    Read it here; change it with :func:`update_record` (a model never touched gets no attribute).
    """
    record = model.__dict__.get(_ATTRIBUTE)
    return record if isinstance(record, ModelRecord) else ModelRecord()


def update_record(model: nn.Module, **changes: Any) -> ModelRecord:
    """Set fields of ``model``'s record (``fusions=``, ``load=``, ``quantizer=``) and return it.

    Raises:
        ConfigurationError: a name that is not a field of :class:`ModelRecord`.
    """
    unknown = sorted(set(changes) - {f.name for f in fields(ModelRecord)})
    if unknown:
        raise ConfigurationError(
            f"update_record got {unknown}; the fields of a model's record are fusions, load and quantizer."
        )
    record = model.__dict__.get(_ATTRIBUTE)
    if not isinstance(record, ModelRecord):
        if all(v is None for v in changes.values()):
            return ModelRecord()  # nothing to record: the model stays untouched
        record = model.__dict__[_ATTRIBUTE] = ModelRecord()
    for name, value in changes.items():
        setattr(record, name, value)
    return record
