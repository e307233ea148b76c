"""compressed-tensors checkpoints written by compressed-tensors itself, and its own decode as the oracle.

The package (a test dependency) quantizes a float model with a preset scheme (``W4A16``,
``W4A16_ASYM``, ``W8A16``, ``FP8``, ``FP8_DYNAMIC``) or given weight arguments, compresses it with
its registered compressor and writes ``config.json`` with its ``update_config``; the tensors are
written with :func:`surgery.write_checkpoint` (safetensors). :func:`reference_weights` decodes
them again with the package's ``decompress``, in float32.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from torch import nn

from surgery.checkpoint import write_checkpoint

__all__ = ["Net", "compress_state", "reference_weights", "scheme", "write_compressed", "write_model"]


class Net(nn.Module):
    """Linears with edge shapes (K not a multiple of 8 for ``b``), and an ignored head."""

    def __init__(self, shapes: dict[str, tuple[int, int]], dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        for name, (n, k) in shapes.items():
            self.add_module(name, nn.Linear(k, n, bias=name == "head", dtype=dtype))


def scheme(preset: str | None = None, **weights: Any) -> QuantizationScheme:
    """A preset scheme, or one with these weight arguments (``num_bits=4, strategy="group", ...``)."""
    if preset is not None:
        return preset_name_to_scheme(preset, ["Linear"])
    return QuantizationScheme(targets=["Linear"], weights={"type": "int", "symmetric": True, **weights})


def _observe(module: nn.Module) -> None:
    """min/max scales and zero points for the module's weight, as an observer would set them."""
    args = module.quantization_scheme.weights
    w = module.weight.detach().float()
    if args.strategy == "block":
        (b0, b1), (n, k) = args.block_structure, w.shape
        nb, kb = -(-n // b0), -(-k // b1)
        blocks = torch.nn.functional.pad(w, (0, kb * b1 - k, 0, nb * b0 - n)).reshape(nb, b0, kb, b1)
        lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    elif args.strategy == "group":
        g = w.unflatten(-1, (-1, args.group_size))
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zp = calculate_qparams(lo, hi, args)
    module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zp.to(module.weight_zero_point.dtype).reshape(
            module.weight_zero_point.shape
        )
    if hasattr(module, "input_scale"):
        module.input_scale.data.fill_(0.0213)


def compress_state(
    state: dict[str, torch.Tensor], quant: QuantizationScheme, path: Path, *, quantized: Callable[[str], bool]
) -> dict[str, torch.Tensor]:
    """``state`` (a checkpoint's float tensors) with each weight ``quantized(key)`` names compressed by
    compressed-tensors' own compressor for ``quant``; written to ``path`` with its ``config.json``."""
    fmt = "float-quantized" if quant.weights.type == "float" else "pack-quantized"
    compressor = BaseCompressor.get_value_from_registry(fmt)
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for key, value in state.items():
        module = key.removesuffix(".weight")
        if key in done or not key.endswith(".weight") or not quantized(key):
            out.setdefault(key, value)
            continue
        holder = nn.Linear(value.shape[1], value.shape[0], bias=False, dtype=torch.bfloat16)
        holder.weight.data = value.to(torch.bfloat16)
        holder.quantization_scheme = quant
        holder.weight_scale = nn.Parameter(
            torch.empty(_scale_shape(quant, value.shape), dtype=torch.bfloat16)
        )
        if not quant.weights.symmetric:
            holder.weight_zero_point = nn.Parameter(
                torch.empty(_scale_shape(quant, value.shape), dtype=torch.int8), requires_grad=False
            )
        if quant.input_activations is not None and quant.input_activations.dynamic is False:
            holder.input_scale = nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
        _observe(holder)
        local = {n: t.detach() for n, t in holder.named_parameters()}
        for name, t in compressor.compress(local, quant).items():
            out[f"{module}.{name}"] = t.contiguous()
        done.add(key)
    path.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out, path)
    (path / "config.json").write_text(json.dumps({"model_type": "dense_example"}))
    config = QuantizationConfig(
        config_groups={"group_0": quant}, format=fmt, quantization_status="compressed", ignore=["lm_head"]
    )
    ModelCompressor(quantization_config=config).update_config(str(path))
    return out


def _scale_shape(quant: QuantizationScheme, shape: torch.Size) -> tuple[int, ...]:
    args = quant.weights
    if args.strategy == "group":
        return (shape[0], shape[1] // args.group_size)
    return (shape[0], 1) if args.strategy == "channel" else (1,)


def write_compressed(
    path: Path,
    shapes: dict[str, tuple[int, int]],
    quant: QuantizationScheme,
    *,
    seed: int = 0,
    ignore: tuple[str, ...] = ("head",),
) -> dict[str, torch.Tensor]:
    """A ``Net`` of ``shapes`` quantized and compressed by compressed-tensors, written to ``path``."""
    torch.manual_seed(seed)
    model = Net(shapes)
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    return write_model(model, quant, path, ignore=ignore, config={"model_type": "net"})


def write_model(
    model: nn.Module,
    quant: QuantizationScheme,
    path: Path,
    *,
    ignore: tuple[str, ...],
    config: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """``model`` quantized (every ``Linear`` not in ``ignore``) and compressed by compressed-tensors, written
    to ``path`` with ``config`` as its ``config.json`` plus the package's ``quantization_config``."""
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": quant}, ignore=list(ignore))
    )
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is not None:
            _observe(m)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    write_checkpoint(state, path)
    (path / "config.json").write_text(json.dumps(config))
    compressor.update_config(str(path))
    return state


def reference_weights(path: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every quantized module's weight decoded by compressed-tensors' own ``decompress``, in float32."""
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    quant = QuantizationScheme.model_validate({**copy.deepcopy(group), "targets": group["targets"]})
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    out = {}
    modules = {k.rpartition(".")[0] for k in state if k.endswith("weight_scale")}
    for m in modules:
        local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == m}
        local["weight_scale"] = local["weight_scale"].to(torch.float32)
        out[f"{m}.weight"] = compressor.decompress(local, quant)["weight"]
    return out
