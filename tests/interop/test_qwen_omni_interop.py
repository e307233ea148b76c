"""Qwen3-Omni (thinker with a MoE text decoder, audio and vision towers) through transformers' own files.

The omni model, its thinker and the thinker's text model have three model types that share the
``qwen2_moe`` expert merge, so the same converter is resolved at three scopes; they claim the
same keys with the same result, and the innermost scope takes them (this used to fail with
"Two converters claim checkpoint key ..."). The thinker's own entry moves ``audio_tower``,
``visual`` and the text ``model`` under ``model.``. Built without the talker
(``enable_audio_output=False``): transformers 5.24 cannot build its default talker.
"""

from __future__ import annotations

import filecmp
from pathlib import Path
from typing import Any

import pytest
import torch

import surgery
from surgery.routing import route_keys

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.interop

_SMALL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    num_experts=4, moe_intermediate_size=16, num_experts_per_tok=2, head_dim=8, vocab_size=128,
    encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=64, d_model=32, depth=1, num_heads=4,
    out_hidden_size=32, output_dim=32, num_mel_bins=16, downsample_hidden_size=16, max_source_positions=64,
    n_window=4, n_window_infer=8, deepstack_visual_indexes=[0], spatial_merge_size=1, patch_size=4,
    temporal_patch_size=1, num_position_embeddings=16, max_position_embeddings=128,
)  # fmt: skip


def _shrink(config: Any) -> None:
    for name, value in list(vars(config).items()):
        if isinstance(value, transformers.PretrainedConfig):
            _shrink(value)
        elif name in _SMALL and value is not None and not isinstance(value, bool):
            setattr(config, name, _SMALL[name])
    if isinstance(vars(config).get("layer_types"), list):
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "mrope_section" in rope:
        rope["mrope_section"] = [2, 1, 1]


def _omni(seed: int) -> Any:
    config = transformers.Qwen3OmniMoeConfig(enable_audio_output=False)
    _shrink(config)
    torch.manual_seed(seed)
    return transformers.Qwen3OmniMoeForConditionalGeneration(config)


def test_qwen3_omni_loads_what_transformers_loads_and_saves_its_files_back(tmp_path: Path) -> None:
    _omni(seed=1).save_pretrained(tmp_path / "original")
    theirs = type(_omni(seed=0)).from_pretrained(tmp_path / "original")
    model = _omni(seed=2)
    report = surgery.load_checkpoint(model, tmp_path / "original", strict=True)
    assert report.ok, str(report)
    got, want = model.state_dict(), theirs.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    surgery.save_checkpoint(model, tmp_path / "out")
    files = sorted(p.name for p in (tmp_path / "original").glob("*.safetensors"))
    assert files and all(
        filecmp.cmp(tmp_path / "original" / f, tmp_path / "out" / f, shallow=False) for f in files
    )


def test_the_same_converter_at_nested_scopes_is_claimed_by_the_innermost() -> None:
    mapping = surgery.get_model_conversion_mapping(_omni(seed=0))
    down = [
        t for t in mapping if isinstance(t, surgery.WeightConverter) and "down_proj" in t.target_patterns[0]
    ]
    assert len({t.scope_prefix for t in down}) >= 2 and len({repr(t.operations) for t in down}) == 1
    key = "thinker.model.layers.0.mlp.experts.0.down_proj.weight"  # renamed under model.language_model first
    route = route_keys([key], mapping).routes[key]
    assert route.target_key == "thinker.model.language_model.layers.0.mlp.experts.down_proj"
    assert mapping[route.converter].scope_prefix == "thinker.model.language_model"
