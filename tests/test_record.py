"""The model's record: what fusing, loading and quantizing did, each fired transform with its origin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.errors import ConfigurationError
from surgery.examples import build_vision_tower
from surgery.record import Fired, Origin, record_of, update_record
from surgery.transforms import PrefixChange, legacy_renamings


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.LayerNorm = nn.LayerNorm(2)


class WithHead(nn.Module):
    base_model_prefix = "model"

    def __init__(self) -> None:
        super().__init__()
        self.model = Body()
        self.head = nn.Linear(2, 2)


def test_reading_the_record_of_a_model_never_touched_leaves_it_untouched() -> None:
    model = nn.Linear(2, 2)
    before = set(model.__dict__)
    record = record_of(model)
    assert (record.fusions, record.load, record.quantizer) == (None, None, None)
    assert set(model.__dict__) == before
    update_record(model, load=None)  # nothing to record: still untouched
    assert set(model.__dict__) == before


def test_update_record_refuses_a_field_the_record_does_not_have_naming_the_fields() -> None:
    with pytest.raises(ConfigurationError, match=r"\['fusion'\].*fusions, load and quantizer"):
        update_record(nn.Linear(2, 2), fusion=None)


def test_a_load_records_each_fired_transform_with_its_origin(tmp_path: Path) -> None:
    # A bare base model's checkpoint with legacy LayerNorm names, loaded into the model with a head.
    state = {"LayerNorm.gamma": torch.ones(2), "LayerNorm.beta": torch.zeros(2)}
    state |= {"head.weight": torch.eye(2), "head.bias": torch.zeros(2)}
    write_checkpoint(state, tmp_path)
    model = WithHead()
    assert surgery.load_checkpoint(model, tmp_path, strict=True).ok
    fired = record_of(model).load.fired
    assert fired == [
        Fired(legacy_renamings()[0], Origin.LEGACY),
        Fired(legacy_renamings()[1], Origin.LEGACY),
        Fired(PrefixChange(prefix_to_add="model"), Origin.BASE_PREFIX_AFTER),
    ]
    assert surgery.revert_state_dict(model).keys() == state.keys()  # saving inverts exactly these


def test_fusion_transforms_are_recorded_as_fusions_and_the_fusion_config_in_the_record(
    tmp_path: Path,
) -> None:
    write_checkpoint(build_vision_tower(depth=1, seed=0).state_dict(), tmp_path)
    model = build_vision_tower(depth=1, seed=1)
    surgery.load_checkpoint(model, tmp_path, fusion_config={"patch_embeddings": True})
    record = record_of(model)
    assert record.fusions is not None and record.fusions.config == {"patch_embeddings": True}
    origins = {f.origin for f in record.load.fired}
    assert Origin.FUSION in origins and record.load.of(Origin.FUSION)
