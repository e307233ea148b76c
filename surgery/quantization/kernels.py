"""Kernels: the FP8 block-scaled matmul quantized weights run where a device has one, and which
kernel each quantized module's forward takes.

A block-FP8 checkpoint kept as stored (:class:`~surgery.quantization.KeepPacked` over
:class:`~surgery.quantization.FP8BlockQuantizer`, ``kernel=True``) multiplies in FP8 on a GPU with
FP8 tensor cores and block scaling (Hopper, sm90) instead of decoding its weight to bfloat16 on
every forward:

* the activations are quantized per token and per 128 columns (:func:`quantize_activations`:
  ``amax / 448`` per group, one float32 scale each, the DeepSeek-V3 recipe);
* :func:`fp8_block_matmul` hands both to torch's scaled matmul with the ``1x128`` recipe for the
  activations and ``128x128`` for the weight, whose stored ``weight_scale_inv`` is used as stored
  (those scales multiply; ``torch.nn.functional.scaled_mm`` from torch 2.10, else
  ``torch._scaled_mm``). The product accumulates in float32 and is returned in bfloat16;
* whether that runs is decided per device by :func:`fp8_block_kernel_usable`: the weight must be
  ``float8_e4m3fn`` in ``128 x 128`` blocks with both dims multiples of 128, the device a CUDA GPU,
  and one probe per device must agree with :func:`reference_block_matmul` (the same quantized
  operands multiplied in float32); anything else decodes and runs ``F.linear`` (the CPU, whose
  scaled matmul has no block scaling in torch 2.13, always does).

The FP8 product is not the decoded one: quantizing the activations costs about 2**-4 relative
error per element (e4m3 keeps 3 mantissa bits), which a sum over ``K`` averages down.
``benchmarks/device.sh`` measures it against the bfloat16 model on the GPU.

:func:`kernel_summary` says, per module class and device, which forward a loaded model's
quantized modules run; a load's report carries it (``LoadReport.kernels``).
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FP8_BLOCK",
    "fp8_block_kernel_usable",
    "fp8_block_linear",
    "fp8_block_matmul",
    "kernel_summary",
    "quantize_activations",
    "reference_block_matmul",
    "weight_scale_operand",
]

FP8_BLOCK = (128, 128)
"""The weight block the scaled matmul takes (activations: 1 x 128)."""
_E4M3_MAX = 448.0
_M_MULTIPLE = 4  # cuBLAS's block-scale layout wants the rows of A in fours: zero rows pad them
_probed: dict[tuple[str, int | None], bool] = {}
_probe_lock = threading.Lock()


def quantize_activations(x: torch.Tensor, group: int = FP8_BLOCK[1]) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (``(M, K)``, ``K % group == 0``) as ``float8_e4m3fn`` values and one float32 scale per
    row and ``group`` columns, ``(M, K / group)``: value times scale is ``x`` to e4m3 precision.

    An all-zero group gets the smallest normal float32 as its scale (never a subnormal one, which
    code that flushes denormals would turn into 0 / 0)."""
    m, k = x.shape
    g = x.reshape(m, k // group, group).to(torch.float32)
    scale = (g.abs().amax(-1) / _E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (g / scale[..., None]).to(torch.float8_e4m3fn).reshape(m, k)
    return q, scale


def reference_block_matmul(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """What :func:`fp8_block_matmul` computes, in float32 on any device: ``(x_q * x_scale) @ (w_q * w_scale).T``
    (``w_scale`` as stored: one per 128x128 block)."""
    group = x_q.shape[1] // x_scale.shape[1]
    x = x_q.to(torch.float32) * x_scale.to(torch.float32).repeat_interleave(group, 1)
    b0, b1 = FP8_BLOCK
    ws = w_scale.to(torch.float32).repeat_interleave(b0, 0).repeat_interleave(b1, 1)
    w = w_q.to(torch.float32) * ws[: w_q.shape[0], : w_q.shape[1]]
    return x @ w.T


def _public_scaled_mm() -> bool:
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


def weight_scale_operand(w_scale: torch.Tensor) -> torch.Tensor:
    """A weight's 128x128 block scales ``(N/128, K/128)`` laid out as the scaled matmul reads them:
    float32, transposed, and for the public ``scaled_mm`` (torch 2.10+) its ``K/128`` padded to a
    multiple of 4. Made once per weight (a kept linear caches it with its operands)."""
    s = w_scale.to(torch.float32)
    blocks = s.shape[1]
    if _public_scaled_mm() and blocks % 4:
        s = F.pad(s, (0, -blocks % 4))
    return s.contiguous().t()


def fp8_block_matmul(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """torch's scaled matmul of ``x_q`` ``(M, K)`` (1x128 scales ``(M, K/128)``) by ``w_q.T``, ``w_q``
    ``(N, K)`` with its block scales as :func:`weight_scale_operand` lays them out; bfloat16 ``(M, N)``.

    ``x_scale`` is handed over column-major, as the kernel reads it. The output is bfloat16
    whatever the activations: their FP8 quantization (2**-4) already bounds the precision.
    Raises what torch raises where the device has no such kernel.
    """
    a_scale = x_scale.to(torch.float32).t().contiguous().t()
    if _public_scaled_mm():
        recipes = F.ScalingType
        return F.scaled_mm(
            x_q,
            w_q.t(),
            a_scale,
            recipes.BlockWise1x128,
            w_scale,
            recipes.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )
    return torch._scaled_mm(x_q, w_q.t(), scale_a=a_scale, scale_b=w_scale, out_dtype=torch.bfloat16)


def fp8_block_linear(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, decoded weight, bias)`` computed in FP8: activations quantized, scaled matmul.

    ``x`` is ``(..., K)``, ``w_scale`` the weight's :func:`weight_scale_operand`; the result has
    ``x``'s dtype. Rows are padded with zeros to a multiple of 4 for the kernel and dropped after.
    """
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    if m % _M_MULTIPLE:
        flat = F.pad(flat, (0, 0, 0, -m % _M_MULTIPLE))
    x_q, x_scale = quantize_activations(flat)
    y = fp8_block_matmul(x_q, x_scale, w_q, w_scale)[:m].to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], w_q.shape[0])


def fp8_block_kernel_usable(
    device: torch.device | str,
    *,
    in_features: int,
    out_features: int,
    block: tuple[int, int],
    dtype: torch.dtype,
) -> bool:
    """Whether :func:`fp8_block_linear` runs correctly for such a weight on ``device``.

    ``False`` without calling anything off CUDA, for another block size or weight dtype, or dims
    that are not multiples of 128; otherwise one probe per device (cached): a small product
    against :func:`reference_block_matmul`.
    """
    device = torch.device(device)
    if (
        device.type != "cuda"
        or tuple(block) != FP8_BLOCK
        or dtype != torch.float8_e4m3fn
        or in_features % FP8_BLOCK[1]
        or out_features % FP8_BLOCK[0]
    ):
        return False
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    with _probe_lock:
        if key not in _probed:
            found = _probe(torch.device("cuda", key[1]))
            if found is None:
                return False  # out of memory now: decode this time, probe again next time
            _probed[key] = found
        return _probed[key]


def _probe(device: torch.device) -> bool | None:
    """Whether the kernel agrees with :func:`reference_block_matmul` on ``device`` (``None``: out of
    memory, not an answer). Activation rows and groups span 2**-6..2**6 and K is 512 and 640 (K/128
    not a multiple of 4: the padded scale layout), so a scale read from the wrong place shows."""
    gen = torch.Generator().manual_seed(0)
    for k in (512, 640):
        w_q = (torch.randn(256, k, generator=gen) * 64).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
        w_scale = 2.0 ** torch.randint(-10, -4, (2, k // 128), generator=gen).float()
        spread = 2.0 ** torch.randint(-6, 7, (8, k // 128), generator=gen).float()
        x = torch.randn(8, k, generator=gen) * spread.repeat_interleave(128, 1)
        x_q, x_scale = quantize_activations(x)
        want = reference_block_matmul(x_q, x_scale, w_q, w_scale)
        try:
            got = fp8_block_matmul(
                x_q.to(device), x_scale.to(device), w_q.to(device), weight_scale_operand(w_scale).to(device)
            )
            got = got.float().cpu()
        except torch.cuda.OutOfMemoryError:
            return None
        except (RuntimeError, ValueError, NotImplementedError, TypeError, AttributeError):
            return False
        if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max())):
            return False
    return True


def kernel_summary(model: nn.Module) -> dict[str, int]:
    """Per ``"<module class> on <device>: <forward>"``, how many modules of ``model`` run it.

    Modules that say which forward they run (a ``kernel_name()`` method: the quantized linears)
    are counted; the others run their own code.
    """
    found: Counter[str] = Counter()
    for module in model.modules():
        name_of: Any = getattr(module, "kernel_name", None)
        if callable(name_of):
            tensor = next(
                itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)), None
            )
            where = "?" if tensor is None else str(tensor.device)
            found[f"{type(module).__name__} on {where}: {name_of()}"] += 1
    return dict(sorted(found.items()))
