"""GPTQ and AWQ tensors written from the documented layouts, and their decode, element by element.

Written for the tests, independently of :mod:`surgery.quantization.gptq` / ``awq``: every code is
packed and read with Python integer arithmetic, one word at a time. The layouts were checked against
GPTQModel's and AutoAWQ's ``pack`` / ``unpack_awq`` / ``reverse_awq_order`` (no reference packer
installs on CPU: AutoGPTQ and AutoAWQ need CUDA to build).
"""

from __future__ import annotations

import math

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # code i of a word holds out-feature 8 w + AWQ_ORDER[i]

__all__ = [
    "AWQ_ORDER",
    "awq_reference",
    "awq_state",
    "awq_tensors",
    "gptq_reference",
    "gptq_state",
    "gptq_tensors",
]


def _word(codes: list[int], bits: int) -> int:
    v = sum(c << (bits * i) for i, c in enumerate(codes))
    return v - (1 << 32) if v >= 1 << 31 else v


# ---------------------------------------------------------------- GPTQ fixture and reference
def gptq_tensors(
    k: int, n: int, group: int, *, seed: int, act_order: bool, bits: int = 4
) -> dict[str, torch.Tensor]:
    """Random GPTQ v1 tensors of ``bits``-wide codes, packed with Python ints (word by word)."""
    f, top = 32 // bits, 1 << bits
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, top, (k, n), generator=gen).tolist()
    groups = math.ceil(k / group)
    zeros = torch.randint(1, top, (groups, n), generator=gen).tolist()  # v1 stores zero - 1 in [0, top - 1)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(torch.float16)
    g_idx = [i // group for i in range(k)]
    if act_order:
        perm = torch.randperm(k, generator=gen).tolist()
        g_idx = [g_idx[p] for p in perm]
    qweight = [[_word([q[f * r + j][c] for j in range(f)], bits) for c in range(n)] for r in range(k // f)]
    qzeros = [
        [_word([zeros[g][f * w + j] - 1 for j in range(f)], bits) for w in range(n // f)]
        for g in range(groups)
    ]
    return {
        "qweight": torch.tensor(qweight, dtype=torch.int32),
        "qzeros": torch.tensor(qzeros, dtype=torch.int32),
        "scales": scales,
        "g_idx": torch.tensor(g_idx, dtype=torch.int32),
    }


def gptq_reference(t: dict[str, torch.Tensor], bits: int = 4) -> torch.Tensor:
    f, mask = 32 // bits, (1 << bits) - 1
    qw, qz, gi = (t[n].tolist() for n in ("qweight", "qzeros", "g_idx"))
    k, n = len(qw) * f, len(qw[0])
    out = torch.empty(n, k)
    s32 = t["scales"].float()
    for kk in range(k):
        g = gi[kk]
        for c in range(n):
            code = (qw[kk // f][c] >> (bits * (kk % f))) & mask
            zero = ((qz[g][c // f] >> (bits * (c % f))) & mask) + 1
            out[c, kk] = float(code - zero) * s32[g, c]
    return out


# ---------------------------------------------------------------- AWQ fixture and reference
def awq_tensors(k: int, n: int, group: int, *, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen).tolist()
    groups = math.ceil(k / group)
    zeros = torch.randint(0, 16, (groups, n), generator=gen).tolist()
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(torch.float16)

    def pack(rows: list[list[int]]) -> list[list[int]]:  # code i of word w holds column 8 w + AWQ_ORDER[i]
        return [[_word([r[8 * w + AWQ_ORDER[i]] for i in range(8)], 4) for w in range(n // 8)] for r in rows]

    return {
        "qweight": torch.tensor(pack(q), dtype=torch.int32),
        "qzeros": torch.tensor(pack(zeros), dtype=torch.int32),
        "scales": scales,
    }


def awq_reference(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    qw, qz = t["qweight"].tolist(), t["qzeros"].tolist()
    k, n = len(qw), len(qw[0]) * 8
    s32 = t["scales"].float()
    inverse = [AWQ_ORDER.index(c) for c in range(8)]
    out = torch.empty(n, k)
    for kk in range(k):
        g = kk // group
        for c in range(n):
            code = (qw[kk][c // 8] >> (4 * inverse[c % 8])) & 15
            zero = (qz[g][c // 8] >> (4 * inverse[c % 8])) & 15
            out[c, kk] = float(code - zero) * s32[g, c]
    return out


def _quantized_state(state: dict[str, torch.Tensor], make, quantized) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, (key, value) in enumerate(state.items()):
        if not quantized(key):
            out[key] = value
            continue
        prefix = key.removesuffix(".weight")
        n, k = value.shape
        out.update({f"{prefix}.{name}": t for name, t in make(k, n, i).items()})
    return out


def gptq_state(
    state: dict[str, torch.Tensor], group: int, quantized, *, act_order: bool = True
) -> dict[str, torch.Tensor]:
    """``state`` with each ``quantized(key)`` weight replaced by random GPTQ v1 tensors."""
    return _quantized_state(
        state, lambda k, n, i: gptq_tensors(k, n, group, seed=i, act_order=act_order), quantized
    )


def awq_state(state: dict[str, torch.Tensor], group: int, quantized) -> dict[str, torch.Tensor]:
    """``state`` with each ``quantized(key)`` weight replaced by random AWQ GEMM tensors."""
    return _quantized_state(state, lambda k, n, i: awq_tensors(k, n, group, seed=i), quantized)
