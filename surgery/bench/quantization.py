"""Benchmark: quantization on CPU: the int8 forward, and loads with and without a quantizer.

Run ``surgery bench quantization [--hidden 1024] [--inner 2816] [--blocks 8] [--repeat 5]``.

* **forward**: a Llama-style MLP (``down(silu(gate(x)) * up(x))``, ``H x I``) at ``M = 1, 32, 256``
  rows: float32 ``F.linear`` (the floor), bfloat16, the int8 weight-only kernel
  (``aten._weight_int8pack_mm`` on bf16 activations) and the int8 dequantize fallback (fp32);
  per variant the best of ``--repeat`` rounds of medians, and its relative error against fp32.
* **decode**: the cost of one FP8 block dequantization of a ``4096 x 4096`` weight against a
  plain ``e4m3 -> float32`` cast of it (the floor).
* **load**: a stack of ``--blocks`` such MLPs, built on ``meta``, from files on disk (page cache
  warm, best of ``--repeat``, ``mmap=False`` so every load reads into owned memory): the floor is
  ``safetensors.torch.load`` of the float32 file's bytes (read, then copied out); then a bf16 checkpoint into a bf16 model,
  the float32 checkpoint without a quantizer and with int8 quantization on the fly, and the
  same weights as a block-wise FP8 checkpoint decoded into bf16. The first load of each variant warms up (the
first ``meta`` run of torch's decompositions costs most of a second once per process).
* **formats**: GPTQ and AWQ int4 (:mod:`surgery.bench.quantization_formats`): load time kept
  packed and decoded against a bf16 load, packed runtime memory against bf16, and the forward of
  the int4 CPU kernel and of the decode path against bf16 at ``M = 1, 32, 256``.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.quantization import (
    FP8BlockQuantizer,
    Int8WeightOnlyLinear,
    Int8WeightOnlyQuantizer,
    blockwise_dequantize,
    blockwise_quantize,
)

from .harness import parser, positive_int
from .quantization_formats import run_formats

__all__ = ["main", "run"]


class _MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _time(fn: Callable[[], object], repeat: int, calls: int) -> float:
    """Best of ``repeat`` rounds of the median of ``calls`` calls, in seconds."""
    fn()
    rounds = []
    for _ in range(repeat):
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        rounds.append(statistics.median(times))
    return min(rounds)


def _forward(hidden: int, inner: int, repeat: int) -> list[str]:
    torch.manual_seed(0)
    ref = _MLP(hidden, inner).eval()
    bf16 = _MLP(hidden, inner).eval()
    bf16.load_state_dict(ref.state_dict())
    bf16 = bf16.to(torch.bfloat16)
    kernel = _MLP(hidden, inner).eval()
    kernel.load_state_dict(ref.state_dict())
    Int8WeightOnlyQuantizer().prepare(kernel)
    fallback = _MLP(hidden, inner).eval()
    fallback.load_state_dict(ref.state_dict())
    Int8WeightOnlyQuantizer().prepare(fallback)
    for module in fallback.modules():
        if isinstance(module, Int8WeightOnlyLinear):
            module.uses_kernel = False
    lines = [
        f"forward: Llama-style MLP H={hidden} I={inner}, {torch.get_num_threads()} threads; "
        "median s (ratio: fp32 time / variant time)",
        f"  {'M':>4} {'fp32 F.linear':>14} {'bf16':>18} {'int8 kernel (bf16 act.)':>26} {'int8 fallback (fp32)':>24}",
    ]
    errors: dict[str, list[float]] = {"bf16": [], "int8 kernel": [], "int8 fallback": []}
    with torch.no_grad():
        for m in (1, 32, 256):
            x = torch.randn(m, hidden)
            xb = x.to(torch.bfloat16)
            calls = 20 if m < 256 else 5
            t32 = _time(functools.partial(ref, x), repeat, calls)
            tb = _time(functools.partial(bf16, xb), repeat, calls)
            tk = _time(functools.partial(kernel, xb), repeat, calls)
            tf = _time(functools.partial(fallback, x), repeat, calls)
            want = ref(x)
            for name, got in (
                ("bf16", bf16(xb)),
                ("int8 kernel", kernel(xb)),
                ("int8 fallback", fallback(x)),
            ):
                errors[name].append(float((got.float() - want).norm() / want.norm()))
            lines.append(
                f"  {m:>4} {t32 * 1e3:>11.2f} ms {tb * 1e3:>8.2f} ms ({t32 / tb:4.2f}x) "
                f"{tk * 1e3:>14.2f} ms ({t32 / tk:4.2f}x) {tf * 1e3:>12.2f} ms ({t32 / tf:4.2f}x)"
            )
    fp32_bytes = sum(p.nbytes for p in ref.parameters())
    int8_bytes = sum(p.nbytes for p in kernel.parameters())
    lines.append(
        "  relative error vs fp32 (max over M): "
        + ", ".join(f"{k} {max(v):.1e}" for k, v in errors.items())
        + f"; int8 weight memory {int8_bytes / fp32_bytes:.3f} of fp32"
    )
    return lines


def _decode(repeat: int) -> list[str]:
    torch.manual_seed(0)
    q, scale = blockwise_quantize(torch.randn(4096, 4096) * 0.02)
    cast = _time(lambda: q.to(torch.float32), repeat, 5)
    full = _time(lambda: blockwise_dequantize(q, scale), repeat, 5)
    return [
        "decode: FP8 block dequantization of 4096x4096 (128x128 blocks)",
        f"  e4m3 -> fp32 cast (floor) {cast * 1e3:.1f} ms; block dequantize {full * 1e3:.1f} ms "
        f"({full / cast:.2f}x the cast)",
    ]


def _load(hidden: int, inner: int, blocks: int, repeat: int) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(*(_MLP(hidden, inner) for _ in range(blocks)))
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    fp8: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        fp8[k], fp8[k + "_scale_inv"] = blockwise_quantize(v)

    def meta(dtype: torch.dtype) -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(*(_MLP(hidden, inner) for _ in range(blocks))).to(dtype)

    rows: list[tuple[str, float, int]] = []
    with tempfile.TemporaryDirectory(prefix="surgery-bench-quant-") as tmp:
        paths = {"bf16": Path(tmp, "bf16"), "fp32": Path(tmp, "fp32"), "fp8": Path(tmp, "fp8")}
        write_checkpoint({k: v.to(torch.bfloat16) for k, v in sd.items()}, paths["bf16"])
        write_checkpoint(sd, paths["fp32"])
        write_checkpoint(fp8, paths["fp8"])
        variants: list[tuple[str, Path, torch.dtype, object]] = [
            ("bf16 checkpoint -> bf16 model", paths["bf16"], torch.bfloat16, None),
            ("fp32 checkpoint -> fp32 model", paths["fp32"], torch.float32, None),
            ("fp32 checkpoint -> int8 on the fly", paths["fp32"], torch.float32, Int8WeightOnlyQuantizer()),
            ("FP8 checkpoint -> bf16 (decode)", paths["fp8"], torch.bfloat16, FP8BlockQuantizer()),
        ]
        floor = float("inf")
        for _ in range(max(1, repeat)):
            start = time.perf_counter()
            safetensors.torch.load((paths["fp32"] / "model.safetensors").read_bytes())
            floor = min(floor, time.perf_counter() - start)
        rows.append(
            ("safetensors load(read_bytes()), fp32 (floor)", floor, sum(v.nbytes for v in sd.values()))
        )
        for name, path, dtype, quantizer in variants:
            best = float("inf")
            nbytes = 0
            for _ in range(max(1, repeat)):
                target = meta(dtype)
                start = time.perf_counter()
                report = surgery.load_checkpoint(
                    target, path, quantizer=quantizer, mmap=False, progress=False
                )  # type: ignore[arg-type]
                best = min(best, time.perf_counter() - start)
                if not report.ok:
                    raise RuntimeError(f"benchmark load {name} failed:\n{report}")
                nbytes = report.bytes_read
            rows.append((name, best, nbytes))
    floor = rows[0][1]
    params = sum(v.numel() for v in sd.values())
    lines = [
        f"load: {blocks} MLPs H={hidden} I={inner} ({params / 1e6:.0f}M parameters), meta-built, page cache warm; "
        "best s (ratio to the floor)",
    ]
    for name, seconds, nbytes in rows:
        lines.append(
            f"  {name:<46} {seconds:>7.3f} s ({seconds / floor:5.2f}x)  read {nbytes / 2**20:7.0f} MiB"
        )
    t = {name: seconds for name, seconds, _ in rows}
    int8 = t["fp32 checkpoint -> int8 on the fly"] / t["fp32 checkpoint -> fp32 model"]
    fp8_ratio = t["FP8 checkpoint -> bf16 (decode)"] / t["bf16 checkpoint -> bf16 model"]
    lines.append(
        f"  int8 on the fly vs the plain fp32 load: {int8:.1f}x; FP8 decode vs the bf16 load: {fp8_ratio:.1f}x"
    )
    return lines


def run(*, hidden: int = 1024, inner: int = 2816, blocks: int = 8, repeat: int = 5) -> str:
    """Run the four parts; return the report text."""
    parts = [
        _forward(hidden, inner, repeat),
        _decode(repeat),
        _load(hidden, inner, blocks, max(3, repeat)),
        run_formats(hidden=hidden, inner=inner, blocks=blocks, repeat=max(3, repeat)),
    ]
    return "\n\n".join("\n".join(p) for p in parts)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser("quantization", __doc__)
    p.add_argument("--hidden", type=positive_int, default=1024, help="H of the MLP (default 1024)")
    p.add_argument("--inner", type=positive_int, default=2816, help="I of the MLP (default 2816)")
    p.add_argument("--blocks", type=positive_int, default=8, help="MLPs in the loaded model (default 8)")
    p.add_argument("--repeat", type=positive_int, default=5, help="rounds; the best counts (default 5)")
    args = p.parse_args(argv)
    print(run(hidden=args.hidden, inner=args.inner, blocks=args.blocks, repeat=args.repeat))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
