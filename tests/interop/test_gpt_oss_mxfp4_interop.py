"""Interop: a tiny gpt-oss with MXFP4 experts loads through surgery exactly as transformers loads it.

The checkpoint is the one ``tests/test_quantization_mxfp4.py`` uses (``tests/fp4_scenarios.py``:
``*_blocks``/``*_scales`` experts from random codes and exponents, the rest bf16). transformers
5.23 loads it on CPU with ``Mxfp4Config(dequantize=True)`` (its own dequantize; without it the
integration asks for accelerate and GPU kernels), into float32 like surgery.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import surgery  # noqa: E402
from surgery.quantization import Mxfp4Quantizer, quantizer_by_name  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent.parent))
from fp4_scenarios import tiny_model, write_mxfp4  # noqa: E402

pytestmark = pytest.mark.interop

IDS = torch.tensor([[1, 5, 9, 2, 33, 7, 40]])


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    write_mxfp4(path)
    ours = tiny_model()
    quantizer = quantizer_by_name("auto", path)
    assert isinstance(quantizer, Mxfp4Quantizer)
    assert surgery.load_checkpoint(ours, path, quantizer=quantizer, strict=True).ok
    theirs = transformers.GptOssForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
    ).eval()
    return ours, theirs


def test_every_weight_equals_transformers_own_load_bit_for_bit(loaded):
    ours, theirs = loaded
    mine, their_state = ours.state_dict(), theirs.state_dict()
    assert sorted(mine) == sorted(their_state)
    assert [k for k in mine if not torch.equal(mine[k], their_state[k])] == []


def test_the_logits_equal_transformers_load_of_the_same_files(loaded):
    ours, theirs = loaded
    with torch.no_grad():
        assert torch.equal(ours(IDS).logits, theirs(IDS).logits)
