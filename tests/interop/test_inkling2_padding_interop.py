"""Inkling2's padded unembedding: a hub file whose padding rows hold values is saved back bit for bit.

From transformers 5.24 the runtime unembedding holds only the first ``unpadded_vocab_size`` rows
of the hub file's ``model.llm.unembed.weight``, and transformers' save pads it back with zero
rows. Surgery's load records the rows it drops, and its save writes them back: the file
transformers wrote, with random values put into its padding rows, comes back identical. Under
5.23 the runtime unembedding is the whole padded one, and the same round trip holds trivially.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from round_trip import read  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tiny import Candidate, build, candidates  # noqa: E402

from specs.releases import release_tuple  # noqa: E402
from surgery import load_checkpoint, save_checkpoint  # noqa: E402
from surgery.record import record_of  # noqa: E402

pytestmark = pytest.mark.interop

UNEMBED = "model.llm.unembed.weight"
UNPADS = release_tuple(transformers.__version__) >= (5, 24, 0)


def _hub_file_with_padding(candidate: Candidate, directory: Path) -> int:
    """Write the family's hub file with random padding rows; return the runtime row count."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(candidate, seed=0)
        model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False)
        model.save_pretrained(directory)
    kept = model.config.get_text_config().unpadded_vocab_size
    (file,) = directory.glob("*.safetensors")
    with safe_open(file, "pt") as f:
        metadata = f.metadata()
    state = read(directory)
    g = torch.Generator().manual_seed(7)
    padding = state[UNEMBED][kept:]
    if UNPADS:
        assert not padding.any(), "transformers pads with zero rows; the test writes values into them"
    padding.copy_(torch.randn(padding.shape, generator=g))
    save_file({k: v.contiguous() for k, v in state.items()}, file, metadata=metadata)
    return kept


@pytest.mark.parametrize("key", ["inkling2_text", "inkling2"])
def test_a_hub_file_with_nonzero_padding_rows_is_saved_back_bit_for_bit(key: str, tmp_path: Path) -> None:
    (candidate,) = candidates(key)
    kept = _hub_file_with_padding(candidate, tmp_path / "hub")
    hub = read(tmp_path / "hub")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = build(candidate, seed=1)
    report = load_checkpoint(fresh, tmp_path / "hub")
    assert report.ok, report
    head = fresh.lm_head.weight.detach()
    record = record_of(fresh).load
    assert record is not None
    if UNPADS:
        assert torch.equal(head, hub[UNEMBED][:kept])
        assert list(record.residues) == ["lm_head.weight"]
        assert torch.equal(record.residues["lm_head.weight"], hub[UNEMBED][kept:])
    else:
        assert torch.equal(head, hub[UNEMBED]) and record.residues == {}
    save_checkpoint(fresh, tmp_path / "saved")
    saved = read(tmp_path / "saved")
    assert list(saved) == list(hub)
    for k, t in hub.items():
        assert saved[k].dtype == t.dtype and torch.equal(saved[k], t), k


@pytest.mark.skipif(not UNPADS, reason="before transformers 5.24 the runtime unembedding is the padded one")
def test_a_runtime_layout_file_has_no_padding_rows_to_keep(tmp_path: Path) -> None:
    (candidate,) = candidates("inkling2_text")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, fresh = build(candidate, seed=0), build(candidate, seed=1)
    save_checkpoint(model, tmp_path / "runtime", original_format=False)
    assert load_checkpoint(fresh, tmp_path / "runtime").ok
    record = record_of(fresh).load
    assert record is not None and record.residues == {}
    save_checkpoint(fresh, tmp_path / "saved")
    unembed = read(tmp_path / "saved")[UNEMBED]
    # The rows the file had (the recorded shape), padded with zero rows where more are written.
    kept = model.config.get_text_config().unpadded_vocab_size
    assert torch.equal(unembed[:kept], model.lm_head.weight.detach()) and not unembed[kept:].any()
