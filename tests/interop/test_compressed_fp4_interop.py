"""Interop: a tiny Llama quantized to NVFP4 / MXFP4 by compressed-tensors loads through surgery as transformers loads it.

The checkpoints are written by compressed-tensors' own lifecycle with its ``NVFP4A16``,
``MXFP4A16`` and ``NVFP4`` presets (``tests/ct_fp4_reference.py``). transformers 5.23 loads them
on CPU with its compressed-tensors integration, which decompresses the weights at the first
forward; the fixture runs that forward before comparing.

* Weight-only (``NVFP4A16``, ``MXFP4A16``): the same weights bit for bit and the same logits.
* ``NVFP4`` (activations quantized too): the same weights bit for bit. transformers' forward also
  quantizes each linear's input to FP4 (compressed-tensors' per-module forward), which a float
  model loaded by surgery does not do, so the logits differ (informational: printed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import surgery  # noqa: E402
from surgery.quantization import CompressedFp4Quantizer, quantizer_by_name  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent.parent))
from ct_fp4_reference import write_fp4_model  # noqa: E402

pytestmark = pytest.mark.interop

IDS = torch.tensor([[1, 5, 9, 3, 7, 11, 2]])


def _config():
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module", params=["NVFP4A16", "MXFP4A16", "NVFP4"])
def loaded(request, tmp_path_factory):
    config = _config()
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = tmp_path_factory.mktemp(request.param)
    write_fp4_model(
        source, request.param, path, ignore=("lm_head",), config={**config.to_dict(), "dtype": "bfloat16"}
    )
    ours = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    quantizer = quantizer_by_name("auto", path)
    assert isinstance(quantizer, CompressedFp4Quantizer)
    assert surgery.load_checkpoint(ours, path, quantizer=quantizer, strict=True).ok
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        first = theirs(IDS).logits  # decompresses transformers' weights
    return request.param, ours, theirs, first


def test_every_weight_equals_transformers_own_decompression_bit_for_bit(loaded):
    _, ours, theirs, _ = loaded
    mine, their_state = ours.state_dict(), theirs.state_dict()
    assert [k for k in mine if k not in their_state or not torch.equal(mine[k], their_state[k])] == []


def test_the_logits_equal_transformers_load_of_the_same_files(loaded):
    name, ours, _, reference = loaded
    with torch.no_grad():
        logits = ours(IDS).logits
    if name == "NVFP4":  # transformers quantizes activations too: informational
        print(
            f"NVFP4 (activations quantized): max |logits - transformers'| = {float((logits - reference).abs().max())}"
        )
        return
    assert torch.equal(logits, reference)
