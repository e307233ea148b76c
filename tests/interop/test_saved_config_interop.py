"""Interop: transformers loads every checkpoint surgery saves exactly, or refuses it loudly.

A save copies the source's ``config.json`` and makes it describe the tensors written
(:mod:`surgery.saved_config`). Per kind of save of a tiny transformers Llama, what
``LlamaForCausalLM.from_pretrained`` (5.23) does with the output:

* plain original-layout save, FP8 saved dequantized, FP8 saved in the runtime layout (decoded
  floats): loads every tensor exactly as written, nothing missing or unexpected, and computes
  the logits of the model surgery loaded;
* FP8 saved as loaded (FP8 values + block scales): the ``fp8`` ``quantization_config`` comes back,
  which transformers parses with the block size of the scales written; transformers then
  dequantizes on CPU (equal to the reference decode), or, without ``accelerate``, refuses with an
  ``ImportError`` saying so;
* int8 runtime layout, ``gate_up`` runtime layout: refused with a ``ValueError`` quoting our
  sentence (never the int8 codes read as floats, never the fused weight dropped and the unfused
  ones left random; never "Unknown fusion type").

Before this, the int8 runtime save loaded with logits off by a relative 887, the dequantized
save kept the FP8 ``quantization_config``, and the fused save wrote ``fusion_config: gate_up``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fp8_reference import dequantize, quantize_state  # noqa: E402  (tests/, on the path through conftest.py)
from safetensors.torch import load_file  # noqa: E402

import surgery  # noqa: E402
from surgery.quantization import FP8BlockQuantizer, Int8WeightOnlyQuantizer  # noqa: E402
from surgery.saved_config import TRANSFORMERS_REFUSAL  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("isolated_fusion_registry")]

BLOCK = (32, 32)
SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))


def _llama(seed: int) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)).eval()


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama as transformers saves it (float32, with its config.json)."""
    path = tmp_path_factory.mktemp("hub")
    _llama(seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def fp8_hub(hub: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same Llama stored FP8 (DeepSeek-V3 layout), with an ``fp8`` quantization_config."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("fp8")
    save_file(quantize_state(load_file(hub / "model.safetensors"), BLOCK), path / "model.safetensors")
    config = json.loads((hub / "config.json").read_text())
    config["quantization_config"] = {**FP8, "modules_to_not_convert": ["lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _assert_loads_exactly(path: Path, ours: Any) -> None:
    """transformers loads every tensor of ``path`` as written, and runs like ``ours``."""
    theirs, info = transformers.LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    written = load_file(path / "model.safetensors")
    state = theirs.state_dict()
    assert sorted(written) == sorted(state)
    for key, tensor in written.items():
        assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), key
    with torch.no_grad():
        assert torch.equal(theirs.eval()(IDS).logits, ours(IDS).logits)


def _refusal(path: Path) -> str:
    """transformers' error for ``path``, which must quote our sentence."""
    with pytest.raises(ValueError, match=TRANSFORMERS_REFUSAL) as info:
        transformers.LlamaForCausalLM.from_pretrained(path)
    return str(info.value)


def test_a_plain_save_loads_exactly_in_transformers(hub: Path, tmp_path: Path) -> None:
    model = _llama(seed=1)
    assert surgery.load_checkpoint(model, hub, strict=True).ok
    surgery.save_checkpoint(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((hub / "config.json").read_text())
    _assert_loads_exactly(tmp_path, model)


def test_an_int8_runtime_save_is_refused_by_transformers_instead_of_read_as_floats(
    hub: Path, tmp_path: Path
) -> None:
    model = _llama(seed=1)
    assert surgery.load_checkpoint(model, hub, quantizer=Int8WeightOnlyQuantizer(exclude=["lm_head"])).ok
    surgery.save_checkpoint(model, tmp_path, original_format=False)
    assert load_file(tmp_path / "model.safetensors")["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
    message = _refusal(tmp_path)
    assert "int8_weight_only" in message and "surgery.load_checkpoint" in message


def test_a_gate_up_runtime_save_is_refused_by_transformers_with_our_reason(hub: Path, tmp_path: Path) -> None:
    model = _llama(seed=1)
    surgery.apply_fusions(model, {"gate_up": True})
    assert surgery.load_checkpoint(model, hub, strict=True).ok
    surgery.save_checkpoint(model, tmp_path, original_format=False)
    assert "fusion_config" not in json.loads((tmp_path / "config.json").read_text())
    message = _refusal(tmp_path)
    assert "gate_up" in message and "Unknown fusion type" not in message
    # The fused model saved in the original layout is an ordinary transformers checkpoint again.
    surgery.save_checkpoint(model, tmp_path / "original")
    _assert_loads_exactly(tmp_path / "original", model)


@pytest.mark.parametrize(
    "save_kwargs",
    [{"quantization": "dequantized"}, {"original_format": False}],
    ids=["dequantized", "runtime-layout"],
)
def test_an_fp8_model_saved_as_floats_loads_exactly_in_transformers(
    fp8_hub: Path, tmp_path: Path, save_kwargs: dict
) -> None:
    model = _llama(seed=1)
    quantizer = FP8BlockQuantizer.from_config(fp8_hub)
    assert surgery.load_checkpoint(model, fp8_hub, quantizer=quantizer, strict=True).ok
    surgery.save_checkpoint(model, tmp_path, **save_kwargs)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    _assert_loads_exactly(tmp_path, model)


def test_an_fp8_model_saved_as_loaded_keeps_an_fp8_config_transformers_reads_with_the_right_blocks(
    fp8_hub: Path, tmp_path: Path
) -> None:
    model = _llama(seed=1)
    quantizer = FP8BlockQuantizer.from_config(fp8_hub)
    assert surgery.load_checkpoint(model, fp8_hub, quantizer=quantizer, strict=True).ok
    surgery.save_checkpoint(model, tmp_path)

    written = load_file(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    parsed = transformers.AutoConfig.from_pretrained(tmp_path).quantization_config
    parsed = transformers.quantizers.AutoQuantizationConfig.from_dict(parsed)
    assert type(parsed).__name__ == "FineGrainedFP8Config" and config["quant_method"] == "fp8"
    weight, scale = (
        written["model.layers.0.mlp.up_proj.weight"],
        written["model.layers.0.mlp.up_proj.weight_scale_inv"],
    )
    b0, b1 = parsed.weight_block_size
    assert weight.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (-(-96 // b0), -(-64 // b1))
    try:
        theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    except ImportError as exc:  # transformers' FP8 needs accelerate, which the test extra lacks
        assert "accelerate" in str(exc)
        return
    state = theirs.state_dict()
    for key, tensor in written.items():
        if key.endswith("_scale_inv"):
            continue
        want = (
            dequantize(tensor, written[key + "_scale_inv"], BLOCK)
            if key + "_scale_inv" in written
            else tensor
        )
        assert torch.equal(state[key].float(), want.to(state[key].dtype).float()), key
