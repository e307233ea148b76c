"""Interop: a tiny Llama quantized by compressed-tensors loads through surgery as transformers loads it.

The checkpoints are written by compressed-tensors' own lifecycle (``apply_quantization_config``,
its compressors, ``update_config``; ``tests/ct_reference.py``): int4 W4A16 (groups of 32, symmetric
and asymmetric) and static FP8 W8A8. transformers 5.23 loads them on CPU with its compressed-tensors
integration, which decompresses the weights into its ``Linear`` modules.

transformers keeps the weights compressed until the first forward, which decompresses them (a
compressed-tensors hook); the fixture runs that forward before comparing weights.

* W4A16: surgery's load gives the same weights bit for bit, and the same logits.
* W4A16 asymmetric is not compared: transformers 5.23 refuses to load it (a size mismatch of the
  packed ``weight_zero_point``); ``tests/test_quantization_compressed_tensors.py`` checks surgery's
  decode of it against compressed-tensors' own ``decompress``.
* FP8 (static activations): the same weights bit for bit. transformers' forward also quantizes
  each linear's input with the stored ``input_scale`` (compressed-tensors' per-module forward),
  which a float model loaded by surgery does not do, so the logits differ there (informational:
  the difference is printed); with that forward removed, the logits are equal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import surgery  # noqa: E402
from surgery.quantization import quantizer_by_name  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent.parent))
from ct_reference import scheme, write_model  # noqa: E402

pytestmark = pytest.mark.interop

IDS = torch.tensor([[1, 5, 9, 3, 7, 11, 2]])
SCHEMES = {
    "W4A16-group32": scheme(num_bits=4, strategy="group", group_size=32),
    "FP8": scheme("FP8"),
}


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


@pytest.fixture(scope="module", params=list(SCHEMES))
def loaded(request, tmp_path_factory):
    config = _config()
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = tmp_path_factory.mktemp(request.param)
    write_model(
        source,
        SCHEMES[request.param],
        path,
        ignore=("lm_head",),
        config={**config.to_dict(), "dtype": "bfloat16"},
    )
    ours = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    report = surgery.load_checkpoint(ours, path, quantizer=quantizer_by_name("auto", path), strict=True)
    assert report.ok
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        first = theirs(IDS).logits  # decompresses transformers' weights
    return request.param, ours, theirs, first


def test_every_weight_equals_transformers_own_decompression_bit_for_bit(loaded):
    _, ours, theirs, _ = loaded
    mine, their_state = ours.state_dict(), theirs.state_dict()
    assert [k for k in mine if not torch.equal(mine[k], their_state[k])] == []


def test_the_logits_equal_transformers_load_of_the_same_files(loaded):
    name, ours, theirs, reference = loaded
    with torch.no_grad():
        logits = ours(IDS).logits
        if name == "FP8":  # transformers quantizes activations with input_scale: informational
            print(f"FP8 static: max |logits - transformers'| = {float((logits - reference).abs().max())}")
            for module in theirs.modules():
                module.__dict__.pop("forward", None)  # compressed-tensors' per-module forward
            reference = theirs(IDS).logits
    assert torch.equal(logits, reference)
