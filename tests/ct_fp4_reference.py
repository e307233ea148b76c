"""compressed-tensors NVFP4 and MXFP4 checkpoints written by compressed-tensors itself, and its decode as the oracle.

:func:`write_fp4` quantizes a :class:`ct_reference.Net` with the package's ``NVFP4`` or ``MXFP4``
preset (scales as its min/max observers compute them: ``generate_gparam`` and
``calculate_qparams``), compresses it with its ``ModelCompressor`` and writes ``config.json`` with
its ``update_config``. :func:`reference_weights` decodes every packed weight with the package's
own ``unpack_fp4_from_uint8`` and ``dequantize``, in float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from ct_reference import Net
from torch import nn

from surgery.checkpoint import write_checkpoint

__all__ = ["SHAPES", "reference_weights", "write_fp4", "write_fp4_model"]

SHAPES = {  # compressed-tensors needs whole groups: 48 columns are 3 NVFP4 groups, 96 are 3 MXFP4 groups
    "NVFP4": {"a": (32, 64), "b": (8, 48), "head": (16, 40)},
    "MXFP4": {"a": (32, 64), "b": (8, 96), "head": (16, 40)},
}


def write_fp4(path: Path, preset: str, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A ``Net`` quantized with the ``preset`` scheme and compressed by compressed-tensors, written to ``path``."""
    torch.manual_seed(seed)
    model = Net(SHAPES[preset])
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    model.a.weight.data[3, :16] = 0  # an all-zero group
    return write_fp4_model(model, preset, path, ignore=("head",), config={"model_type": "net"})


def write_fp4_model(
    model: nn.Module, preset: str, path: Path, *, ignore: tuple[str, ...], config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """``model`` (every ``Linear`` not in ``ignore``) quantized with ``preset`` and compressed by
    compressed-tensors, written to ``path`` with ``config`` plus the package's ``quantization_config``."""
    quant = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": quant}, ignore=list(ignore))
    )
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is None:
            continue
        args = m.quantization_scheme.weights
        w = m.weight.detach().float()
        groups = w.unflatten(-1, (-1, args.group_size))
        gs = None
        if hasattr(m, "weight_global_scale"):
            gs = generate_gparam(w.amin(), w.amax())
            m.weight_global_scale.data = gs.reshape(m.weight_global_scale.shape)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gs)
        m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)
        if hasattr(m, "input_global_scale"):
            m.input_global_scale.data.fill_(1234.5)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    write_checkpoint(state, path)
    (path / "config.json").write_text(json.dumps(config))
    compressor.update_config(str(path))
    return state


def reference_weights(path: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every packed weight decoded by compressed-tensors' own unpack and ``dequantize``, in float32."""
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    args = QuantizationArgs.model_validate(group["weights"])
    out = {}
    for key, packed in state.items():
        if not key.endswith("weight_packed"):
            continue
        m = key.removesuffix("weight_packed")
        scale = state[m + "weight_scale"]
        scale = decompress_mx_scale(scale) if scale.dtype == torch.uint8 else scale
        rows, cols = packed.shape
        out[m + "weight"] = dequantize(
            unpack_fp4_from_uint8(packed, rows, cols * 2, dtype=torch.float32),
            scale.to(torch.float32),
            args=args,
            global_scale=state.get(m + "weight_global_scale"),
            dtype=torch.float32,
        )
    return out
