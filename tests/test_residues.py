"""Ops that drop data keep what they drop: a load records it, a save puts it back.

A small module registered with a mapping that uses ``Inkling2UnpadVocab`` (the unembedding is
loaded without its padding rows), real safetensors files on disk, no transformers.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import surgery
from specs.inkling2 import Inkling2UnpadVocab
from surgery import WeightConverter
from surgery.checkpoint import open_checkpoint, write_checkpoint
from surgery.errors import ConversionError
from surgery.load.record import clear_record
from surgery.record import record_of
from surgery.registry import register_checkpoint_conversion_mapping, registry_snapshot

VOCAB, KEPT, HIDDEN = 8, 6, 4


class PaddedHead(nn.Module):
    """An embedding and an unembedding that holds only the first ``KEPT`` of ``VOCAB`` rows."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=VOCAB, unpadded_vocab_size=KEPT)
        self.embed = nn.Embedding(KEPT, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, KEPT, bias=False)


@pytest.fixture(autouse=True)
def padded_head_mapping() -> Iterator[None]:
    with registry_snapshot():
        register_checkpoint_conversion_mapping(
            "PaddedHead", [WeightConverter(r"^unembed\.weight$", "lm_head.weight", [Inkling2UnpadVocab()])]
        )
        yield


def _hub_file(directory: Path) -> dict[str, torch.Tensor]:
    """A checkpoint whose padding rows hold values (NaN and -0.0 included), written to ``directory``."""
    g = torch.Generator().manual_seed(0)
    unembed = torch.randn(VOCAB, HIDDEN, generator=g)
    unembed[KEPT, 0], unembed[KEPT + 1, 1] = float("nan"), -0.0
    state = {"embed.weight": torch.randn(KEPT, HIDDEN, generator=g), "unembed.weight": unembed}
    write_checkpoint(state, directory)
    return state


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(directory) as reader:
        return {k: reader.get_tensor(k) for k in reader}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _loaded(directory: Path) -> PaddedHead:
    model = PaddedHead()
    report = surgery.load_checkpoint(model, directory)
    assert report.ok, report
    return model


def test_load_then_save_writes_the_padding_rows_back_bit_for_bit(tmp_path: Path) -> None:
    hub = _hub_file(tmp_path / "hub")
    model = _loaded(tmp_path / "hub")
    assert torch.equal(model.lm_head.weight.detach(), hub["unembed.weight"][:KEPT])
    surgery.save_checkpoint(model, tmp_path / "saved")
    saved = _tensors(tmp_path / "saved")
    assert list(saved) == list(hub)
    for k, t in hub.items():
        assert torch.equal(_bits(saved[k]), _bits(t)), k
    hub_file, saved_file = (next((tmp_path / d).glob("*.safetensors")) for d in ("hub", "saved"))
    assert saved_file.read_bytes() == hub_file.read_bytes()


def test_the_load_record_keeps_only_the_dropped_rows(tmp_path: Path) -> None:
    hub = _hub_file(tmp_path / "hub")
    record = record_of(_loaded(tmp_path / "hub")).load
    assert record is not None
    (residue,) = record.residues.values()
    assert list(record.residues) == ["lm_head.weight"]
    assert torch.equal(_bits(residue), _bits(hub["unembed.weight"][KEPT:]))
    # Its own storage of the two padding rows, not a view keeping the whole read tensor alive.
    assert residue.untyped_storage().nbytes() == (VOCAB - KEPT) * HIDDEN * 4


def test_revert_state_dict_puts_the_padding_rows_back(tmp_path: Path) -> None:
    hub = _hub_file(tmp_path / "hub")
    reverted = surgery.revert_state_dict(_loaded(tmp_path / "hub"))
    assert torch.equal(_bits(reverted["unembed.weight"]), _bits(hub["unembed.weight"]))


def test_edited_weights_are_saved_with_the_recorded_padding_rows(tmp_path: Path) -> None:
    hub = _hub_file(tmp_path / "hub")
    model = _loaded(tmp_path / "hub")
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    surgery.save_checkpoint(model, tmp_path / "saved")
    saved = _tensors(tmp_path / "saved")["unembed.weight"]
    assert torch.equal(saved[:KEPT], hub["unembed.weight"][:KEPT] * 2)
    assert torch.equal(_bits(saved[KEPT:]), _bits(hub["unembed.weight"][KEPT:]))


def test_padding_rows_stay_exact_when_the_model_runs_in_a_narrower_dtype(tmp_path: Path) -> None:
    hub = _hub_file(tmp_path / "hub")
    model = PaddedHead()
    assert surgery.load_checkpoint(model, tmp_path / "hub", dtype=torch.bfloat16).ok
    surgery.save_checkpoint(model, tmp_path / "saved")
    saved = _tensors(tmp_path / "saved")["unembed.weight"]
    assert saved.dtype == torch.float32
    assert torch.equal(_bits(saved[KEPT:]), _bits(hub["unembed.weight"][KEPT:]))
    assert torch.equal(saved[:KEPT], hub["unembed.weight"][:KEPT].bfloat16().float())


def test_a_model_never_loaded_saves_zero_padding_rows_as_transformers_does(tmp_path: Path) -> None:
    model = PaddedHead()
    surgery.save_checkpoint(model, tmp_path / "saved")
    saved = _tensors(tmp_path / "saved")["unembed.weight"]
    assert saved.shape == (VOCAB, HIDDEN)
    assert torch.equal(saved[:KEPT], model.lm_head.weight.detach())
    assert not saved[KEPT:].any()


def test_a_cleared_record_saves_zero_padding_rows(tmp_path: Path) -> None:
    _hub_file(tmp_path / "hub")
    model = _loaded(tmp_path / "hub")
    clear_record(model)
    surgery.save_checkpoint(model, tmp_path / "saved")
    assert not _tensors(tmp_path / "saved")["unembed.weight"][KEPT:].any()


def test_an_unembedding_resized_after_the_load_is_refused_with_the_fix(tmp_path: Path) -> None:
    _hub_file(tmp_path / "hub")
    model = _loaded(tmp_path / "hub")
    model.lm_head = nn.Linear(HIDDEN, KEPT - 1, bias=False)
    with pytest.raises(ConversionError, match=r"changed shape since the load.*clear_record\(model\)"):
        surgery.save_checkpoint(model, tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
