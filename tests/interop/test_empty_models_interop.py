"""Interop: transformers models built on meta (as users build them), loaded by surgery, run.

For a Mixtral, a Llama and a Qwen2 model (tiny configs): the checkpoint is written by
``save_pretrained``, the reference is ``from_pretrained``. Built under :func:`surgery.init_empty`
the model loads ``ok`` and its forward output equals the reference's; built under
``torch.device("meta")`` its rotary ``inv_freq`` buffers are left on meta, and the report says so
instead of claiming success.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import surgery  # noqa: E402

pytestmark = pytest.mark.interop

T = transformers
COMMON = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
FAMILIES = {
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
}


def _saved(tmp_path: Path, family: str):
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**COMMON, **extra)
    torch.manual_seed(0)
    model_cls(config).save_pretrained(tmp_path)
    reference = model_cls.from_pretrained(tmp_path).eval()
    return config, model_cls, reference


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_model_built_with_init_empty_loads_and_matches_from_pretrained(tmp_path: Path, family: str) -> None:
    config, model_cls, reference = _saved(tmp_path, family)
    with surgery.init_empty():
        model = model_cls(config)
    report = surgery.load_checkpoint(model, tmp_path)
    assert report.ok, report
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_model_built_on_meta_is_reported_as_left_on_meta(tmp_path: Path, family: str) -> None:
    config, model_cls, _ = _saved(tmp_path, family)
    with torch.device("meta"):
        model = model_cls(config)
    report = surgery.load_checkpoint(model, tmp_path)
    assert not report.ok
    assert any(name.endswith("inv_freq") for name in report.left_on_meta), report.left_on_meta
