"""GTE saves the hub's layout: the base model under ``new.``, the head beside it, a bare base model bare.

The hub files were written by the remote-code ``NewModel`` family: a head model holds the base
model as ``new`` and its head at the root (``new.embeddings.*``, ``new.encoder.layer.N.*``,
``lm_head.*`` / ``classifier.*``), a base model is saved with no prefix. transformers' mapping
strips ``new.``; inverting that adds ``new.`` to every key (``new.gte.embeddings.*``,
``new.lm_head.*``), a layout no file has. These tests write the hub files by hand from a tiny
model's own tensors, so they do not depend on what any transformers release writes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import surgery

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.interop

_CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=48,
    max_position_embeddings=64,
    type_vocab_size=2,
)


def _model(cls: str, seed: int) -> Any:
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(transformers.GteConfig(**_CONFIG, num_labels=3)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # norms and biases too: a swapped pair must not compare equal
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _hub_keys(runtime: str) -> str:
    """The hub name of a runtime key, written from the NewModel layout (not from any mapping)."""
    key = re.sub(r"^gte\.", "new.", runtime)
    key = re.sub(r"\blayers\.(\d+)\.", r"encoder.layer.\1.", key)
    key = key.replace("self_attn.o_proj", "attention.o_proj")
    key = key.replace("post_attention_layernorm", "attn_ln").replace("post_mlp_layernorm", "mlp_ln")
    return key.replace("lm_head.layer_norm", "lm_head.norm")


def _hub_file(model: Any, directory: Path) -> dict[str, torch.Tensor]:
    """``model``'s tensors in the hub layout: fused ``qkv_proj`` and ``up_gate_proj`` (up first)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.decoder.weight"}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if re.search(r"self_attn\.[kv]_proj|mlp\.gate_proj", key):
            continue
        if m := re.search(r"^(.*)self_attn\.q_proj\.(\w+)$", key):
            parts = [state[f"{m[1]}self_attn.{x}_proj.{m[2]}"] for x in "qkv"]
            out[_hub_keys(f"{m[1]}attention.qkv_proj.{m[2]}")] = torch.cat(parts)
        elif m := re.search(r"^(.*)mlp\.up_proj\.(\w+)$", key):
            parts = [value, state[f"{m[1]}mlp.gate_proj.{m[2]}"]]
            out[_hub_keys(f"{m[1]}mlp.up_gate_proj.{m[2]}")] = torch.cat(parts)
        else:
            out[_hub_keys(key)] = value
    directory.mkdir()
    save_file(out, directory / "model.safetensors", metadata={"format": "pt"})
    return out


def _saved(model: Any, directory: Path) -> dict[str, torch.Tensor]:
    surgery.save_checkpoint(model, directory)
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("cls", ["GteForMaskedLM", "GteForSequenceClassification"])
def test_a_head_model_loads_the_hub_file_and_saves_it_back_exactly(cls: str, tmp_path: Path) -> None:
    hub = _hub_file(_model(cls, seed=0), tmp_path / "hub")
    assert any(k.startswith("new.embeddings.") for k in hub)
    assert not any(k.startswith(("new.gte.", "new.lm_head.", "new.classifier.")) for k in hub)

    model = _model(cls, seed=1)
    report = surgery.load_checkpoint(model, tmp_path / "hub", strict=True)
    assert report.ok, report
    _same({k: v for k, v in model.state_dict().items()}, _model(cls, seed=0).state_dict())
    _same(_saved(model, tmp_path / "saved"), hub)


@pytest.mark.parametrize("cls", ["GteForMaskedLM", "GteForSequenceClassification"])
def test_a_head_model_never_loaded_saves_the_hub_layout(cls: str, tmp_path: Path) -> None:
    model = _model(cls, seed=0)
    hub = _hub_file(model, tmp_path / "hub")
    _same(_saved(model, tmp_path / "saved"), hub)


def test_transformers_reloads_the_saved_head_model_exactly(tmp_path: Path) -> None:
    model = _model("GteForMaskedLM", seed=0)
    _hub_file(model, tmp_path / "hub")
    loaded = _model("GteForMaskedLM", seed=1)
    surgery.load_checkpoint(loaded, tmp_path / "hub", strict=True)
    surgery.save_checkpoint(loaded, tmp_path / "saved")
    model.config.save_pretrained(tmp_path / "saved")
    theirs, info = transformers.GteForMaskedLM.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    _same(dict(theirs.state_dict()), model.state_dict())


def test_a_bare_base_model_reads_the_head_models_hub_file_and_saves_bare_when_never_loaded(
    tmp_path: Path,
) -> None:
    hub = _hub_file(_model("GteForMaskedLM", seed=0), tmp_path / "hub")
    base = _model("GteModel", seed=1)
    report = surgery.load_checkpoint(base, tmp_path / "hub")
    assert not report.missing_keys, report
    assert sorted(report.unexpected_keys) == sorted(k for k in hub if k.startswith("lm_head."))
    # What was loaded goes back under the names it was read from.
    saved = _saved(base, tmp_path / "saved")
    _same(saved, {k: v for k, v in hub.items() if k.startswith("new.")})

    bare = _saved(_model("GteModel", seed=0), tmp_path / "bare")
    assert bare and not any(k.startswith(("new.", "gte.")) for k in bare)


@pytest.mark.parametrize("cls", ["GteForMaskedLM", "GteForSequenceClassification"])
def test_transformers_own_file_saves_back_as_transformers_wrote_it_never_half_of_each(
    cls: str, tmp_path: Path
) -> None:
    model = _model(cls, seed=0)
    # transformers' write after a load through its mapping: new.gte.*, new.<head>.*
    from transformers.conversion_mapping import get_model_conversion_mapping

    model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False)
    model.save_pretrained(tmp_path / "theirs")
    theirs = {
        k: v for f in sorted((tmp_path / "theirs").glob("*.safetensors")) for k, v in load_file(f).items()
    }
    assert theirs and all(k.startswith("new.") for k in theirs)
    assert any(k.startswith("new.gte.") for k in theirs)

    loaded = _model(cls, seed=1)
    report = surgery.load_checkpoint(loaded, tmp_path / "theirs", strict=True)
    assert report.ok, report
    _same(dict(loaded.state_dict()), model.state_dict())
    saved = _saved(loaded, tmp_path / "saved")
    _same(saved, theirs)
    hub = _hub_file(model, tmp_path / "hub")  # and never a mix: no hub key beside transformers' ones
    assert not set(saved) & set(hub)
