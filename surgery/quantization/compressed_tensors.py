"""compressed-tensors checkpoints (llm-compressor, RedHatAI, Kimi-K2): ``pack-quantized`` and ``float-quantized``.

A ``quantization_config`` with ``quant_method: "compressed-tensors"`` lists config groups, each
with ``targets`` (module class names, exact module paths, or ``re:`` regexes), ``weights``
arguments (``num_bits``, ``type``, ``strategy``, ``group_size``, ``symmetric``, ``actorder``) and
a ``format``; modules named in ``ignore`` are stored in float. Per quantized linear ``X``:

* ``pack-quantized`` (W4A16, W8A16; int, 1 to 8 bits): ``X.weight_packed`` int32 ``[N, ceil(K*b/32)]``
  (:mod:`~surgery.quantization.packing`: values offset by ``2**(b-1)``, densely packed, least
  significant bits first), ``X.weight_scale`` (the checkpoint's float dtype) ``[N, ceil(K/g)]``
  for groups of ``g`` columns, ``[N, 1]`` per channel, ``[1]`` per tensor, ``X.weight_shape``
  int64 ``[N, K]``, and for asymmetric schemes ``X.weight_zero_point`` int32, packed the same
  way along dim 0 (``[ceil(N*b/32), G]``). ``actorder: "group"`` checkpoints also store
  ``X.weight_g_idx`` int32 ``[K]``: column ``k`` uses the scale of group ``g_idx[k]``.
  Decoded: ``(q - zero_point) * scale``; the load renames ``X.weight_packed`` to ``X.weight``.
* ``float-quantized`` (FP8 W8A8): ``X.weight`` float8_e4m3fn ``[N, K]``, ``X.weight_scale``
  ``[1]`` (per tensor), ``[N, 1]`` (per channel), ``[N, K/g]`` or one per ``block_structure`` block
  (the FP8 block layout of :mod:`~surgery.quantization.fp8`), and with static activation
  scales ``X.input_scale``, which decoding does not use but the load keeps (read whole on every
  tensor-parallel rank) and an ``as_loaded`` save writes back. Decoded: ``q * weight_scale``.

Decoding is done in float32, exactly what compressed-tensors' ``dequantize`` computes in float32.
A save with ``quantization="as_loaded"`` re-encodes every weight with the scales, zero points
and ``g_idx`` it was loaded with, and writes the source ``quantization_config`` unchanged: the
files come back bit for bit. A group (a row, or the whole tensor) whose values no longer fit its
recorded scale (the weights were trained) gets a fresh scale (and zero point) rather than clipped
values.

Under tensor parallelism a rank reads only its share of ``X.weight_packed`` (a split along the
packed dim must start and end on whole words and whole groups: a :class:`~surgery.ConfigurationError`
names the key, the dim and the group size otherwise); scales are read whole, as small as the
FP8 block scales (:mod:`~surgery.quantization.fp8`).

Example:
    >>> q = CompressedTensorsQuantizer.from_config({"quant_method": "compressed-tensors",
    ...     "format": "pack-quantized", "quantization_status": "compressed", "config_groups": {"group_0": {
    ...         "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
    ...         "group_size": 128, "symmetric": True}}}})
    >>> q
    CompressedTensorsQuantizer(formats=('pack-quantized',))
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .. import meta
from ..checkpoint import StoredTensor
from ..errors import ConfigurationError, ConversionError
from ..parallel.regions import Region
from ..transforms import WeightRenaming, WeightTransform
from .compressed_tensors_config import FLOAT, FORMATS, PACKED, ConfigGroups, WeightScheme, parse_group
from .fp8 import FP8BlockQuantizer, blockwise_dequantize
from .packing import pack_int32, pack_unit, packed_length, unpack_int32
from .protocol import first_bad_scale

__all__ = ["FORMATS", "CompressedTensorsQuantizer", "WeightScheme"]

_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8 = torch.float8_e4m3fn
_COMPANIONS = ("weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx", "input_scale")


def _intervals(region: Region | None, dim: int, n: int) -> list[tuple[int, int]]:
    return list(region.intervals) if region is not None and region.dim == dim else [(0, n)]


def _index(intervals: list[tuple[int, int]]) -> torch.Tensor:
    return (
        torch.cat([torch.arange(a, b) for a, b in intervals])
        if intervals
        else torch.zeros(0, dtype=torch.long)
    )


class CompressedTensorsQuantizer(ConfigGroups):
    """Decode compressed-tensors ``pack-quantized`` and ``float-quantized`` checkpoints; save them back exactly.

    Args:
        config: the checkpoint's ``quantization_config`` (``quant_method: "compressed-tensors"``).
            Kept as it is: a save writes it back unchanged.

    Raises:
        ConfigurationError: a field this quantizer reads has the wrong type or value (the message
            names it), or the checkpoint is not stored compressed.
    """

    parse_scheme = staticmethod(parse_group)
    stores = "packed or FP8 weights with their scales"
    loads_in_transformers = True

    def _split(self, key: str) -> tuple[str, str]:
        module, _, name = key.rpartition(".")
        return module, name

    def _owned(self, key: str) -> tuple[str, WeightScheme] | None:
        """``(prefix, scheme)`` when ``key`` is the stored weight of a quantized module."""
        module, name = self._split(key)
        scheme = self.scheme_of(module)
        if scheme is None or name != ("weight_packed" if scheme.format == PACKED else "weight"):
            return None
        return (f"{module}." if module else ""), scheme

    # ------------------------------------------------------------------ hooks
    def update_weight_conversions(self, transforms: list[WeightTransform]) -> list[WeightTransform]:
        """``X.weight_packed`` loads into ``X.weight`` (the model's parameter)."""
        if not any(s.format == PACKED for s in self.schemes.values()):
            return transforms
        return [*transforms, WeightRenaming(r"\.weight_packed", ".weight")]

    def dequantized_name(self, key: str) -> str:
        """A dequantized save writes the floats of ``X.weight_packed`` as ``X.weight``."""
        return key.removesuffix("_packed") if key.endswith(".weight_packed") else key

    def companions(self, key: str, info: StoredTensor) -> tuple[str, ...]:
        owned = self._owned(key)
        if owned is None:
            if self._split(key)[1] == "weight_packed":  # packed words never load as they are
                raise ConversionError(
                    f"{key!r} holds packed values, but no config group of the quantization_config quantizes "
                    f"{self._split(key)[0]!r} as pack-quantized (it is ignored or untargeted): the config does not "
                    "describe this checkpoint."
                )
            return ()
        prefix, s = owned
        if s.format == FLOAT:
            if info.dtype.itemsize != 1:  # a float weight of a module no group quantizes (an embedding)
                return ()
            return (prefix + "weight_scale", *((prefix + "input_scale",) if s.static_input else ()))
        names = ["weight_scale", "weight_shape"]
        names += [] if s.symmetric else ["weight_zero_point"]
        names += ["weight_g_idx"] if s.g_idx else []
        return tuple(prefix + n for n in names)

    def companion_of(self, key: str) -> str | None:
        module, name = self._split(key)
        if name not in _COMPANIONS:
            return None
        prefix = f"{module}." if module else ""
        try:
            scheme = self.scheme_of(module)
        except ConversionError:  # the weight's own entry fails saying why
            scheme = None
        packed = (
            scheme.format == PACKED if scheme is not None else name not in ("weight_scale", "input_scale")
        )
        return prefix + ("weight_packed" if packed else "weight")

    def checks(self, key: str, info: StoredTensor) -> bool:
        return self._split(key)[1] in ("weight_scale", "weight_shape", "input_scale")

    def check(self, key: str, tensor: torch.Tensor) -> None:
        """Scales finite and positive, ``weight_shape`` two positive ints.

        Raises:
            ConversionError: naming ``key`` and what is wrong with it.
        """
        name = self._split(key)[1]
        if name == "weight_shape":
            if tensor.dtype != torch.int64 or tensor.dim() != 1 or tensor.numel() < 2:
                raise ConversionError(
                    f"{key!r} is {tensor.dtype} {tuple(tensor.shape)}; weight_shape is int64 [rows, columns]."
                )
            if tensor.device.type != "meta" and bool((tensor <= 0).any()):
                raise ConversionError(f"{key!r} is {tensor.tolist()}; a weight shape is positive.")
            return
        if tensor.dtype not in _SCALE_DTYPES:
            raise ConversionError(
                f"{key!r} is {tensor.dtype}; compressed-tensors scales are float32, bfloat16 or float16."
            )
        if tensor.device.type == "meta":
            return
        bad = first_bad_scale(tensor, zero_allowed=False, limit=torch.finfo(torch.float32).max / 448)
        if bad is not None:
            raise ConversionError(
                f"{key!r}: the scale at {bad[0]} is {bad[1]}; scales are finite and positive. The file is corrupt "
                "or was not written by compressed-tensors."
            )

    def companion_region(self, key: str, companion: str, region: Region, info: StoredTensor) -> Region | None:
        """The rows, groups or blocks of a scale or zero point covering ``region`` of the weight.

        Per-tensor scales, ``weight_shape``, ``g_idx``, ``input_scale`` and the scales of a split
        along the columns that act-order groups scatter are read whole (``None``).
        """
        owned = self._owned(key)
        name = self._split(companion)[1]
        if (
            owned is None
            or name not in ("weight_scale", "weight_zero_point")
            or owned[1].strategy == "tensor"
        ):
            return None
        s, dim = owned[1], region.dim % 2
        if s.block is not None:
            b = s.block[dim]
            return Region.of(dim, [(a // b, -(-e // b)) for a, e in region.intervals])
        if dim == 0:  # rows: one scale row per weight row; zero points pack rows into int32 words
            if name == "weight_scale":
                return Region.of(0, region.intervals)
            return Region.of(
                0, [(a * s.num_bits // 32, -(-e * s.num_bits // 32)) for a, e in region.intervals]
            )
        if s.strategy != "group" or s.g_idx or not s.group_size:
            return None
        g = s.group_size
        return Region.of(1, [(a // g, -(-e // g)) for a, e in region.intervals])

    def _companion(self, key: str, name: str, companions: Mapping[str, torch.Tensor]) -> torch.Tensor:
        full = self._split(key)[0]
        full = (f"{full}." if full else "") + name
        t = companions.get(full)
        if t is None:
            raise ConversionError(f"{key!r}: its {name} {full!r} is missing from the checkpoint.")
        if name in ("weight_scale", "weight_shape", "input_scale"):
            self.check(full, t)
        return t

    def stored_region(self, key: str, region: Region, info: StoredTensor) -> Region:
        """The part of the stored ``key`` that holds ``region`` of its decoded values.

        Raises:
            ConfigurationError: a split of the packed dim (columns) that does not start and end
                on whole int32 words and whole groups; the message names the key, dim and sizes.
        """
        owned = self._owned(key)
        if owned is None or owned[1].format != PACKED or region.dim % len(info.shape) != len(info.shape) - 1:
            return region
        s = owned[1]
        unit = pack_unit(s.num_bits)
        if s.group_size is not None and not s.g_idx:
            unit = unit * s.group_size // math.gcd(unit, s.group_size)
        words = []
        for a, b in region.intervals:
            end_ok = b % unit == 0 or b * s.num_bits > (info.shape[-1] - 1) * 32  # the end of the row
            if a % unit or not end_ok:
                raise ConfigurationError(
                    f"{key!r}: a tensor-parallel split of dim {len(info.shape) - 1} at columns [{a}, {b}) is not "
                    f"aligned to {unit} columns (group size {s.group_size}, {32 // pack_unit(s.num_bits) or 1}-word "
                    f"packing of {s.num_bits}-bit values); choose a tensor-parallel size that splits the "
                    "columns into whole groups."
                )
            words.append((a * s.num_bits // 32, min(info.shape[-1], packed_length(b, s.num_bits))))
        return Region.of(len(info.shape) - 1, words)

    def decode(
        self,
        key: str,
        tensor: torch.Tensor,
        companions: dict[str, torch.Tensor],
        region: Region | None = None,
    ) -> torch.Tensor:
        owned = self._owned(key)
        if owned is None:
            raise ConversionError(f"{key!r} is not a weight a compressed-tensors config group quantizes.")
        scale = self._companion(key, "weight_scale", companions)
        if owned[1].format == FLOAT:
            return self._decode_float(key, owned[1], tensor, scale, region)
        return self._decode_packed(key, owned[1], tensor, scale, companions, region)

    # ------------------------------------------------------------------ float-quantized
    def _expand(
        self,
        scale: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        group_of: torch.Tensor | None,
        group_size: int | None,
    ) -> torch.Tensor:
        """``scale`` (one per tensor, row or group) for the ``rows`` x ``cols`` part of the weight, float32."""
        s = scale.to(torch.float32).reshape(scale.shape[0] if scale.dim() == 2 else 1, -1)
        if s.shape[0] > 1:
            s = s.index_select(0, rows)
        if s.shape[1] > 1:
            group = group_of.index_select(0, cols) if group_of is not None else cols // (group_size or 1)
            s = s.index_select(1, group)
        return s

    def _decode_float(
        self, key: str, s: WeightScheme, tensor: torch.Tensor, scale: torch.Tensor, region: Region | None
    ) -> torch.Tensor:
        if tensor.dtype != _FP8:
            raise ConversionError(f"{key!r} is stored as {tensor.dtype}; float-quantized weights are {_FP8}.")
        if tensor.dim() != 2:
            raise ConversionError(
                f"{key!r} has shape {tuple(tensor.shape)}; a quantized linear weight is 2-d."
            )
        if meta.is_meta(tensor):
            return meta.empty(tensor.shape, torch.float32)
        n, k = tensor.shape
        if region is None:  # a part's shape says nothing about the whole; planning checked the whole
            self._scale_check(key, s, (n, k), scale)
        if s.block is not None:  # DeepSeek-style blocks, scales named weight_scale
            return blockwise_dequantize(tensor, scale, s.block, region)
        rows, cols = _index(_intervals(region, 0, n)), _index(_intervals(region, 1, k))
        return tensor.to(torch.float32).mul_(self._expand(scale, rows, cols, None, s.group_size))

    # ------------------------------------------------------------------ pack-quantized
    def _decode_packed(
        self,
        key: str,
        s: WeightScheme,
        tensor: torch.Tensor,
        scale: torch.Tensor,
        companions: Mapping[str, torch.Tensor],
        region: Region | None,
    ) -> torch.Tensor:
        shape_t = self._companion(key, "weight_shape", companions)
        if tensor.dtype != torch.int32 or tensor.dim() != 2:
            raise ConversionError(
                f"{key!r} is {tensor.dtype} {tuple(tensor.shape)}; pack-quantized weights are 2-d int32."
            )
        if shape_t.device.type == "meta":
            raise ConversionError(
                f"{key!r}: its weight_shape values are needed to plan the load; this is a bug."
            )
        n, k = (int(x) for x in shape_t.tolist()[-2:])
        rows_iv, cols_iv = _intervals(region, 0, n), _intervals(region, 1, k)
        out_shape = (sum(b - a for a, b in rows_iv), sum(b - a for a, b in cols_iv))
        words = sum(packed_length(b, s.num_bits) - a * s.num_bits // 32 for a, b in cols_iv)
        if tuple(tensor.shape) != (out_shape[0], words):
            raise ConversionError(
                f"{key!r} has shape {tuple(tensor.shape)}; a [{n}, {k}] weight of {s.num_bits}-bit values packs "
                f"into [{n}, {packed_length(k, s.num_bits)}] int32 (weight_shape says [{n}, {k}])."
            )
        groups = self._scale_check(key, s, (n, k), scale)
        zp = self._zero_point(key, s, (n, k), groups, companions)
        g_idx = self._g_idx(key, s, k, groups, companions)
        if meta.is_meta(tensor):
            return meta.empty(out_shape, torch.float32)
        pieces, start = [], 0
        for a, b in cols_iv:  # each interval starts on a whole word (stored_region checked it)
            w = packed_length(b, s.num_bits) - a * s.num_bits // 32
            pieces.append(unpack_int32(tensor[:, start : start + w], s.num_bits, b - a))
            start += w
        q = torch.cat(pieces, dim=1).to(torch.float32) if len(pieces) > 1 else pieces[0].to(torch.float32)
        rows, cols = _index(rows_iv), _index(cols_iv)
        if zp is not None:
            q.sub_(self._expand(zp.to(torch.float32), rows, cols, g_idx, s.group_size))
        return q.mul_(self._expand(scale, rows, cols, g_idx, s.group_size))

    def int4_operands(
        self, key: str, packed: torch.Tensor, companions: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """``(codes (N, K) int32 in [0, 16), scale (G, N), zero (G, N), group_size)`` for the int4 CPU
        kernel of :class:`~surgery.quantization.PackedLinear`, which computes ``(q - 8) * scale + zero``;
        ``None`` (decode instead) for anything but 4-bit ``pack-quantized`` groups without act-order.

        The stored values are ``q - 8`` for ``q`` in ``[0, 16)``, and the decode is
        ``(v - zero_point) * scale``: the kernel's zero is ``-zero_point * scale``.
        """
        owned = self._owned(key)
        if owned is None:
            return None
        s = owned[1]
        if s.format == FLOAT or s.num_bits != 4 or s.strategy != "group" or s.g_idx or s.group_size is None:
            return None
        scale = self._companion(key, "weight_scale", companions)
        n, k = (int(x) for x in self._companion(key, "weight_shape", companions).tolist()[-2:])
        if k % s.group_size:
            return None
        groups = self._scale_check(key, s, (n, k), scale)
        zp = self._zero_point(key, s, (n, k), groups, companions)
        codes = unpack_int32(packed, 4, k).to(torch.int32) + 8
        s32 = scale.to(torch.float32)
        zero = torch.zeros_like(s32) if zp is None else -zp.to(torch.float32) * s32
        return codes, s32.T.contiguous(), zero.T.contiguous(), s.group_size

    def _scale_check(self, key: str, s: WeightScheme, shape: tuple[int, int], scale: torch.Tensor) -> int:
        n, k = shape
        if s.block is not None:
            want: tuple[int, ...] = (math.ceil(n / s.block[0]), math.ceil(k / s.block[1]))
            if tuple(scale.shape) != want:
                raise ConversionError(
                    f"{self._split(key)[0]}.weight_scale has shape {tuple(scale.shape)}; a [{n}, {k}] weight in "
                    f"{s.block[0]}x{s.block[1]} blocks needs {list(want)}."
                )
            return want[1]
        groups = {"tensor": 1, "channel": 1, "group": math.ceil(k / (s.group_size or 1))}[s.strategy]
        want = (1,) if s.strategy == "tensor" else (n, groups)
        if tuple(scale.shape) != want and not (s.strategy == "tensor" and scale.numel() == 1):
            raise ConversionError(
                f"{self._split(key)[0]}.weight_scale has shape {tuple(scale.shape)}; a [{n}, {k}] weight with "
                f"strategy {s.strategy!r} (group size {s.group_size}) needs {list(want)}."
            )
        return groups

    def _zero_point(
        self,
        key: str,
        s: WeightScheme,
        shape: tuple[int, int],
        groups: int,
        companions: Mapping[str, torch.Tensor],
    ) -> torch.Tensor | None:
        if s.symmetric:
            return None
        zp = self._companion(key, "weight_zero_point", companions)
        rows = shape[0] if s.strategy != "tensor" else 1
        want = (packed_length(rows, s.num_bits), groups) if s.strategy != "tensor" else None
        if zp.dtype != torch.int32 or (want is not None and tuple(zp.shape) != want):
            raise ConversionError(
                f"{self._split(key)[0]}.weight_zero_point is {zp.dtype} {tuple(zp.shape)}; asymmetric "
                f"{s.num_bits}-bit zero points are int32 packed along dim 0: {list(want or [1])}."
            )
        if meta.is_meta(zp):
            return zp
        return unpack_int32(zp, s.num_bits, rows, dim=0) if want is not None else zp

    def _g_idx(
        self, key: str, s: WeightScheme, k: int, groups: int, companions: Mapping[str, torch.Tensor]
    ) -> torch.Tensor | None:
        if not s.g_idx:
            return None
        g = self._companion(key, "weight_g_idx", companions)
        if g.dtype != torch.int32 or tuple(g.shape) != (k,):
            raise ConversionError(
                f"{self._split(key)[0]}.weight_g_idx is {g.dtype} {tuple(g.shape)}; act-order group indices are "
                f"int32 [{k}]."
            )
        if not meta.is_meta(g) and k and (int(g.min()) < 0 or int(g.max()) >= groups):
            raise ConversionError(
                f"{self._split(key)[0]}.weight_g_idx holds group indices outside [0, {groups}); the file is corrupt."
            )
        return g if meta.is_meta(g) else g.to(torch.long)

    # ------------------------------------------------------------------ save
    def encode(
        self, key: str, tensor: torch.Tensor, recorded: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``tensor`` stored again with the recorded companions; groups that outgrew theirs get fresh ones."""
        owned = self._owned(key)
        if owned is None:
            raise ConversionError(f"{key!r} is not a weight a compressed-tensors config group quantizes.")
        prefix, s = owned
        w = tensor.to(torch.float32)
        scale = self._companion(key, "weight_scale", recorded)
        out = dict(recorded)
        if s.block is not None:  # the FP8 block encoder, with this format's scale name
            blocks = FP8BlockQuantizer(block_size=s.block, scale_suffix="_scale")
            return {**out, **blocks.encode(key, tensor, {key + "_scale": scale})}
        if s.format == FLOAT:
            q, new_scale = _encode_float(w, scale)
            out[key], out[prefix + "weight_scale"] = q, new_scale
            return out
        n, k = tuple(w.shape)
        groups = self._scale_check(key, s, (n, k), scale)
        zp = self._zero_point(key, s, (n, k), groups, recorded)
        g_idx = self._g_idx(key, s, k, groups, recorded)
        if meta.is_meta(w):
            return {
                **out,
                key: torch.empty((n, packed_length(k, s.num_bits)), dtype=torch.int32, device="meta"),
            }
        rows, cols = torch.arange(n), torch.arange(k)
        group_of = g_idx if g_idx is not None else cols // (s.group_size or k)
        scale, zp = _refit(w, s, scale, zp, group_of, groups)
        z = self._expand(zp.to(torch.float32), rows, cols, g_idx, s.group_size) if zp is not None else 0.0
        q = torch.round(w / self._expand(scale, rows, cols, g_idx, s.group_size) + z).clamp_(s.qmin, s.qmax)
        out[key] = pack_int32(q.to(torch.int8), s.num_bits)
        out[prefix + "weight_scale"] = scale
        if zp is not None and s.strategy != "tensor":
            out[prefix + "weight_zero_point"] = pack_int32(zp, s.num_bits, dim=0)
        return out


def _encode_float(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values of ``w`` with ``scale``; rows (or the tensor) whose values outgrew it get a fresh scale."""
    if meta.is_meta(w):
        return torch.empty(tuple(w.shape), dtype=_FP8, device="meta"), scale
    s = scale.to(torch.float32).reshape(-1, 1) if scale.dim() == 2 and scale.shape[1] == 1 else None
    s32 = s if s is not None else scale.to(torch.float32)
    q = w / (s32 if scale.dim() != 2 or scale.shape[1] == 1 else _groups_expand(s32, w.shape[1]))
    limit = torch.finfo(_FP8).max * (1 + 2**-4)  # 448 + half a step: the largest value rounding to 448
    over = q.abs().amax(dim=1, keepdim=True) > limit if s is not None else q.abs().amax() > limit
    if bool(torch.as_tensor(over).any()):
        amax = w.abs().amax(dim=1, keepdim=True) if s is not None else w.abs().amax().reshape(scale.shape)
        fresh = _round_up(amax / torch.finfo(_FP8).max, scale.dtype)
        scale = torch.where(over if s is not None else torch.as_tensor(over), fresh, scale)
        s32 = scale.to(torch.float32)
        q = w / (s32 if scale.dim() != 2 or scale.shape[1] == 1 else _groups_expand(s32, w.shape[1]))
    return q.to(_FP8), scale


def _groups_expand(scale: torch.Tensor, k: int) -> torch.Tensor:
    return scale.repeat_interleave(math.ceil(k / scale.shape[1]), dim=1)[:, :k]


def _round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, never rounded down (a scale rounded down would clip the largest value)."""
    x = torch.where(x > 0, x, torch.ones_like(x))
    y = x.to(dtype)
    return torch.where(y.to(torch.float32) < x, (x * (1 + torch.finfo(dtype).eps)).to(dtype), y)


def _refit(
    w: torch.Tensor,
    s: WeightScheme,
    scale: torch.Tensor,
    zp: torch.Tensor | None,
    group_of: torch.Tensor,
    groups: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recorded scale (and zero point) per group, fresh ones for groups whose values no longer fit."""
    n = w.shape[0]
    scale2 = scale.reshape(-1, 1) if s.strategy == "tensor" else scale
    rows = n if s.strategy != "tensor" else 1
    ww = w.reshape(1, -1) if s.strategy == "tensor" else w
    gof = torch.zeros(ww.shape[1], dtype=torch.long) if s.strategy != "group" else group_of
    lo = torch.full((rows, groups), math.inf).scatter_reduce(1, gof.expand(rows, -1), ww, "amin")
    hi = torch.full((rows, groups), -math.inf).scatter_reduce(1, gof.expand(rows, -1), ww, "amax")
    z = zp.to(torch.float32).reshape(rows, -1) if zp is not None else torch.zeros(rows, groups)
    sf = scale2.to(torch.float32)
    over = (torch.round(hi / sf + z) > s.qmax + 0) | (torch.round(lo / sf + z) < s.qmin)
    if not bool(over.any()):
        return scale, zp
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    if s.symmetric:
        fresh = _round_up(torch.maximum(-lo, hi) / ((s.qmax - s.qmin) / 2), scale.dtype)
        new_z = z
    else:
        fresh = _round_up((hi - lo) / (s.qmax - s.qmin), scale.dtype)
        new_z = torch.round(s.qmin - lo / fresh.to(torch.float32)).clamp(s.qmin, s.qmax)
    scale2 = torch.where(over, fresh, scale2)
    z = torch.where(over, new_z, z)
    new_zp = (
        None if zp is None else z.to(zp.dtype if zp.dtype != torch.int32 else torch.int8).reshape(zp.shape)
    )
    return scale2.reshape(scale.shape), new_zp
