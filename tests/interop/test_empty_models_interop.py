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


def _qwen2_vl():
    lm = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0},
    )
    return T.Qwen2VLConfig(
        text_config=dict(model_type="qwen2_vl_text", **lm),
        vision_config=dict(
            depth=2,
            embed_dim=16,
            hidden_size=16,
            num_heads=2,
            mlp_ratio=2,
            in_channels=3,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=100,
        video_token_id=101,
        vision_start_token_id=102,
    )


def test_a_qwen2_vl_model_built_with_init_empty_loads_and_matches_from_pretrained(tmp_path: Path) -> None:
    config = _qwen2_vl()
    torch.manual_seed(0)
    T.Qwen2VLForConditionalGeneration(config).save_pretrained(tmp_path)
    reference = T.Qwen2VLForConditionalGeneration.from_pretrained(tmp_path).eval()
    with surgery.init_empty():
        model = T.Qwen2VLForConditionalGeneration(config)
    report = surgery.load_checkpoint(model, tmp_path)
    assert report.ok, report
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_convert_output_loads_in_transformers_and_equals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`surgery convert` with a factory of the user's own: the output has its config and loads in transformers.

    The command runs in this process (``surgery.cli.main``, from the factory's directory, as
    ``python -m surgery`` would find it); ``tests/test_cli.py`` launches the entry point itself."""
    import sys

    from surgery.cli import main

    config_cls, model_cls, extra = FAMILIES["mixtral"]
    torch.manual_seed(0)
    model_cls(config_cls(**COMMON, **extra)).save_pretrained(tmp_path / "src")
    reference = model_cls.from_pretrained(tmp_path / "src").eval()
    (tmp_path / "mixtral_factory.py").write_text(
        "import json, surgery, transformers\n"
        "def build():\n"
        f"    cfg = transformers.MixtralConfig.from_pretrained({str(tmp_path / 'src')!r})\n"
        "    with surgery.init_empty():\n"
        "        return transformers.MixtralForCausalLM(cfg)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code = main(
            ["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--model", "mixtral_factory:build"]
        )
    finally:
        sys.modules.pop("mixtral_factory", None)
    assert code == 0
    assert (tmp_path / "out" / "config.json").is_file()
    again = model_cls.from_pretrained(tmp_path / "out").eval()
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, reference(ids).logits)


def test_a_qwen2_vl_model_built_on_meta_is_reported_as_left_on_meta(tmp_path: Path) -> None:
    config = _qwen2_vl()
    torch.manual_seed(0)
    T.Qwen2VLForConditionalGeneration(config).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = T.Qwen2VLForConditionalGeneration(config)
    report = surgery.load_checkpoint(model, tmp_path)
    assert not report.ok
    left = report.left_on_meta
    assert any("visual" in k and k.endswith("inv_freq") for k in left), left  # the vision tower's rotary
    assert any("language_model" in k and k.endswith("inv_freq") for k in left), left
