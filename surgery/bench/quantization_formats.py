"""Benchmark case: quantized checkpoint formats against bf16 (part of ``surgery bench quantization``).

For each format of :data:`FORMATS` (adding one is one line: a name, a writer from float weights,
a quantizer factory), over a stack of Llama-style MLPs:

* **load**: seconds to load the format's checkpoint into a ``meta``-built model kept packed
  (:class:`~surgery.quantization.KeepPacked`) and decoded into
  bf16, against a bf16 checkpoint into a bf16 model (page cache warm, ``mmap=False``, best of
  ``--repeat``);
* **memory**: parameter and buffer bytes of the packed runtime model against the bf16 one;
* **forward**: one MLP at ``M = 1, 32, 256`` rows: bf16 ``F.linear``, the packed model through the
  int4 CPU kernel (``kernel=True``; GPTQ and AWQ) and through its decode + ``F.linear`` path (float32).

The compressed-tensors checkpoints are written here from the documented layout (the package is a
test dependency, not a runtime one); the tests compare the same layout with the package's own.
"""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.quantization import (
    AWQ_REVERSE_ORDER,
    AWQQuantizer,
    GPTQQuantizer,
    KeepPacked,
    awq_quantize,
    gptq_quantize,
    pack_int32,
    pack_words,
    quantizer_from_config,
)
from surgery.quantization.fp4 import e2m1_encode, pack_nibbles

__all__ = ["FORMATS", "Format", "run_formats"]

GROUP = 128


def _groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit ``(zeros (G, N) int32, scales (G, N) float16)`` of an ``(N, K)`` weight."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.float16)
    zero = torch.round(-lo / scale.float()).clamp(0, 15).to(torch.int32)
    return zero.T.contiguous(), scale.T.contiguous()


def _gptq(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, w in state.items():
        prefix = key.removesuffix(".weight")
        zeros, scales = _groups(w, GROUP)
        g_idx = torch.arange(w.shape[1], dtype=torch.int32) // GROUP
        out[f"{prefix}.qweight"] = gptq_quantize(w, zeros, scales, g_idx, bits=4)
        out[f"{prefix}.qzeros"] = pack_words(zeros - 1, bits=4, dim=1)  # v1: zero - 1
        out[f"{prefix}.scales"] = scales
        out[f"{prefix}.g_idx"] = g_idx
    return out


def _awq(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, w in state.items():
        prefix = key.removesuffix(".weight")
        zeros, scales = _groups(w, GROUP)
        out[f"{prefix}.qweight"] = awq_quantize(w, zeros, scales, group_size=GROUP)
        out[f"{prefix}.qzeros"] = pack_words(zeros, bits=4, dim=1, order=AWQ_REVERSE_ORDER)
        out[f"{prefix}.scales"] = scales
    return out


def _ct_config(fmt: str, weights: dict[str, Any]) -> dict[str, Any]:
    """A compressed-tensors ``quantization_config`` with one group over every ``Linear``."""
    group = {"targets": ["Linear"], "format": fmt, "weights": weights}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
    }


CT_W4A16 = _ct_config(
    "pack-quantized",
    {"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP, "symmetric": True},
)
CT_FP8 = _ct_config(
    "float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
)
CT_MXFP4 = _ct_config(
    "mxfp4-pack-quantized",
    {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True},
)


def _ct_w4a16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, w in state.items():
        prefix = key.removesuffix(".weight")
        g = w.unflatten(1, (-1, GROUP))
        scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-8).to(torch.bfloat16)
        q = torch.round(g / scale.float().unsqueeze(-1)).clamp(-8, 7).flatten(1).to(torch.int8)
        out[f"{prefix}.weight_packed"] = pack_int32(q, 4)
        out[f"{prefix}.weight_scale"] = scale
        out[f"{prefix}.weight_shape"] = torch.tensor(list(w.shape))
    return out


def _ct_fp8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, w in state.items():
        prefix = key.removesuffix(".weight")
        scale = (w.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12).to(torch.bfloat16)
        out[f"{prefix}.weight"] = (w / scale.float()).to(torch.float8_e4m3fn)
        out[f"{prefix}.weight_scale"] = scale
    return out


def _ct_mxfp4(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, w in state.items():
        prefix = key.removesuffix(".weight")
        g = w.unflatten(1, (-1, 32))
        exponent = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2**-126) / 6)).clamp(-127, 127)
        codes = e2m1_encode((g / torch.exp2(exponent).unsqueeze(-1)).flatten(1))
        out[f"{prefix}.weight_packed"] = pack_nibbles(codes)
        out[f"{prefix}.weight_scale"] = (exponent + 127).to(torch.uint8)
    return out


@dataclass(frozen=True)
class Format:
    """One benchmarked format: its name, a writer from float ``(N, K)`` weights, its quantizer, and
    whether the int4 CPU kernel can serve it at runtime."""

    name: str
    write: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    quantizer: Callable[[], Any]
    int4_kernel: bool = True


FORMATS: list[Format] = [
    Format(
        "GPTQ int4 g128",
        _gptq,
        lambda: GPTQQuantizer.from_config({"quant_method": "gptq", "group_size": GROUP}),
    ),
    Format(
        "AWQ int4 g128", _awq, lambda: AWQQuantizer.from_config({"quant_method": "awq", "group_size": GROUP})
    ),
    Format("compressed-tensors W4A16 g128", _ct_w4a16, lambda: quantizer_from_config(CT_W4A16)),
    Format("compressed-tensors FP8 channel", _ct_fp8, lambda: quantizer_from_config(CT_FP8), False),
    Format("compressed-tensors MXFP4", _ct_mxfp4, lambda: quantizer_from_config(CT_MXFP4), False),
]
"""The formats compared; one line each."""


class _MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _stack(hidden: int, inner: int, blocks: int, dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(_MLP(hidden, inner) for _ in range(blocks))).to(dtype)


def _nbytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _best(fn: Callable[[], object], repeat: int) -> float:
    """Best of ``repeat`` calls after one warm-up call, in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _load(
    model_of: Callable[[], nn.Module], path: Path, quantizer: Any, repeat: int
) -> tuple[float, nn.Module]:
    def once() -> nn.Module:
        model = model_of()
        report = surgery.load_checkpoint(model, path, quantizer=quantizer, mmap=False, progress=False)
        if not report.ok:
            raise RuntimeError(f"benchmark load of {path.name} failed:\n{report}")
        return model

    loaded = once()  # the model measured for memory
    return _best(once, repeat), loaded


def _forward(
    fmt: Format, sd: dict[str, torch.Tensor], tmp: Path, hidden: int, inner: int, repeat: int
) -> list[str]:
    one = {k.removeprefix("0."): v for k, v in sd.items() if k.startswith("0.")}
    path = tmp / f"{fmt.name}-one"
    write_checkpoint(fmt.write(one), path)
    variants = {}
    for kernel in (True, False) if fmt.int4_kernel else (False,):
        model = _MLP(hidden, inner)
        surgery.load_checkpoint(
            model, path, quantizer=KeepPacked(fmt.quantizer(), checkpoint=path, kernel=kernel)
        )
        variants[kernel] = model.eval()
    bf16 = _MLP(hidden, inner).to(torch.bfloat16).eval()
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in one.items()})
    lines = [f"  forward, one MLP ({fmt.name}); best of {repeat * 4} calls, ratio: bf16 time / variant time"]
    with torch.no_grad():
        for m in (1, 32, 256):
            x = torch.randn(m, hidden)
            xb = x.to(torch.bfloat16)
            tb = _best(functools.partial(bf16, xb), repeat * 4)
            td = _best(functools.partial(variants[False], x), repeat * 4)
            kernel_text = ""
            if fmt.int4_kernel:
                tk = _best(functools.partial(variants[True], xb), repeat * 4)
                kernel_text = f"int4 kernel {tk * 1e3:8.2f} ms ({tb / tk:4.2f}x); "
            lines.append(
                f"    M={m:>3}: bf16 {tb * 1e3:8.2f} ms; {kernel_text}"
                f"decode + F.linear (fp32) {td * 1e3:8.2f} ms ({tb / td:4.2f}x)"
            )
    return lines


def run_formats(*, hidden: int, inner: int, blocks: int, repeat: int) -> list[str]:
    """The load, memory and forward lines of every format in :data:`FORMATS`."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_MLP(hidden, inner) for _ in range(blocks)))
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    lines = [
        f"formats: {blocks} MLPs H={hidden} I={inner}, meta-built, page cache warm, mmap=False; best s "
        "(ratio to the bf16 load)"
    ]
    with tempfile.TemporaryDirectory(prefix="surgery-bench-formats-") as tmp_dir:
        tmp = Path(tmp_dir)
        write_checkpoint({k: v.to(torch.bfloat16) for k, v in sd.items()}, tmp / "bf16")
        t_bf16, bf16_model = _load(
            lambda: _stack(hidden, inner, blocks, torch.bfloat16), tmp / "bf16", None, repeat
        )
        lines.append(
            f"  bf16 checkpoint -> bf16 model {t_bf16:8.3f} s; {_nbytes(bf16_model) / 2**20:.0f} MiB"
        )
        for fmt in FORMATS:
            path = tmp / fmt.name
            write_checkpoint(fmt.write(sd), path)
            t_packed, packed = _load(
                lambda: _stack(hidden, inner, blocks, torch.bfloat16),
                path,
                KeepPacked(fmt.quantizer(), checkpoint=path),
                repeat,
            )
            row = (
                f"  {fmt.name}: packed runtime {t_packed:.3f} s ({t_packed / t_bf16:.2f}x), "
                f"{_nbytes(packed) / 2**20:.0f} MiB ({_nbytes(packed) / _nbytes(bf16_model):.3f} of bf16)"
            )
            t_dec, _ = _load(
                lambda: _stack(hidden, inner, blocks, torch.bfloat16), path, fmt.quantizer(), repeat
            )
            row += f"; decoded into bf16 {t_dec:.3f} s ({t_dec / t_bf16:.2f}x)"
            lines.append(row)
            lines.extend(_forward(fmt, sd, tmp, hidden, inner, repeat))
    return lines
