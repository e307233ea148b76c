"""Interop: the command line builds a transformers model from a checkpoint's config.json (``transformers:auto``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from surgery.cli import build_model, main  # noqa: E402

pytestmark = pytest.mark.interop


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved by transformers itself (float32, with its config.json)."""
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_transformers_auto_builds_the_architecture_of_config_json_on_meta(llama_dir: Path) -> None:
    model = build_model("transformers:auto", checkpoint=llama_dir / "model.safetensors")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # config.json's dtype
    assert all(b.device.type == "cpu" for b in model.buffers())  # rotary inv_freq: computed, not meta


def test_convert_with_transformers_auto_writes_what_transformers_wrote(
    llama_dir: Path, tmp_path: Path
) -> None:
    assert main(["convert", str(llama_dir), str(tmp_path / "out"), "--model", "transformers:auto"]) == 0
    written, original = (
        load_file(tmp_path / "out" / "model.safetensors"),
        load_file(llama_dir / "model.safetensors"),
    )
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[k], original[k]) for k in original)


def test_convert_to_bfloat16_loads_in_transformers_as_bfloat16(
    llama_dir: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "bf16"
    assert (
        main(["convert", str(llama_dir), str(out), "--model", "transformers:auto", "--dtype", "bfloat16"])
        == 0
    )
    assert "float32 → bfloat16 (lossy:" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out)
    assert reloaded.dtype == torch.bfloat16
    original = load_file(llama_dir / "model.safetensors")
    for k, t in reloaded.state_dict().items():
        assert torch.equal(t, original[k].to(torch.bfloat16)), k


def test_transformers_auto_builds_in_the_dtype_config_json_names(llama_dir: Path, tmp_path: Path) -> None:
    config = json.loads((llama_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    model = build_model("transformers:auto", checkpoint=tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
