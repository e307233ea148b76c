"""compressed-tensors FP4 checkpoints (``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``): decoded on read, saved back exactly.

Layout per quantized ``Linear`` ``X`` of weight ``[N, K]`` (``quant_method: "compressed-tensors"``,
the config group's ``format``):

* ``X.weight_packed``: ``uint8`` ``[N, K/2]``, two E2M1 codes per byte, low nibble first
  (:mod:`surgery.quantization.fp4`);
* ``nvfp4-pack-quantized`` (NVFP4, groups of 16, strategy ``tensor_group``):
  ``X.weight_scale`` ``float8_e4m3fn`` ``[N, K/16]`` and ``X.weight_global_scale`` ``float32``
  ``[1]``; value = code * (``weight_scale`` / ``weight_global_scale``), computed in float32 as
  compressed-tensors' ``dequantize`` does;
* ``mxfp4-pack-quantized`` (MXFP4, groups of 32, strategy ``group``): ``X.weight_scale``
  ``uint8`` E8M0 ``[N, K/32]``; value = code * ``2 ** (scale - 127)``;
* ``X.input_global_scale`` ``float32`` ``[1]`` where the group quantizes input activations:
  kept as loaded and written back.

The load renames ``X.weight_packed`` to ``X.weight``. A save with ``quantization="as_loaded"``
re-encodes each weight with its recorded scales, which writes the files back byte for byte; a
group whose values outgrew its scale (the weights changed) gets a fresh one (never a clipped
value) and the save lists the weight as re-quantized. Under tensor parallelism a rank reads only
its rows, or its columns in whole groups of 16 or 32; a split inside a group is a
:class:`~surgery.ConfigurationError` naming the key, the dim and the group size.

Example:
    >>> q = CompressedFp4Quantizer.from_config(json.load(open("nvfp4/config.json")))  # doctest: +SKIP
    >>> report = surgery.load_checkpoint(model, "nvfp4/", quantizer=q)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import meta
from ..checkpoint import StoredTensor
from ..errors import ConfigurationError, ConversionError
from ..parallel.regions import Region
from ..transforms import WeightRenaming, WeightTransform
from .compressed_tensors_config import ConfigGroups
from .fp4 import E2M1_MAX, E8M0_BIAS, e2m1_decode, e2m1_encode, e8m0_exponent, pack_nibbles, unpack_nibbles
from .protocol import bounded_repr, first_bad_scale

__all__ = ["FP4_FORMATS", "CompressedFp4Quantizer", "Fp4Scheme"]

NVFP4, MXFP4 = "nvfp4-pack-quantized", "mxfp4-pack-quantized"
FP4_FORMATS = (NVFP4, MXFP4)
"""The compressed-tensors formats :class:`CompressedFp4Quantizer` reads."""

_GROUP = {NVFP4: 16, MXFP4: 32}
_STRATEGY = {NVFP4: "tensor_group", MXFP4: "group"}
_SCALE_DTYPE = {NVFP4: torch.float8_e4m3fn, MXFP4: torch.uint8}
_COMPANIONS = ("weight_scale", "weight_global_scale", "input_global_scale")
_OVERFLOW = E2M1_MAX * (1 + 2**-8)
"""Above this a value outgrew its scale; below it, it rounds to 6 (a decoded 6 the float math or a bf16
model rounded up by a last bit still encodes as 6)."""
_MAX_E8M0 = 252  # the largest byte whose groups decode finite in float32


@dataclass(frozen=True)
class Fp4Scheme:
    """One config group's FP4 weight quantization."""

    format: str
    targets: tuple[str, ...]
    input_scale: bool  # X.input_global_scale is stored

    @property
    def group_size(self) -> int:
        return _GROUP[self.format]


def _scheme(name: str, group: Any, top_format: Any) -> Fp4Scheme:
    where = f"quantization_config.config_groups.{name}"
    if not isinstance(group, Mapping):
        raise ConfigurationError(f"{where} is {bounded_repr(group)}, not a dict.")
    fmt = group.get("format") or top_format
    if fmt not in FP4_FORMATS:
        raise ConfigurationError(
            f"{where}.format={bounded_repr(fmt)}; CompressedFp4Quantizer reads {list(FP4_FORMATS)} (one quantizer "
            "reads a checkpoint: configs mixing these with other formats are not supported)."
        )
    w = group.get("weights")
    if not isinstance(w, Mapping):
        raise ConfigurationError(f"{where}.weights={bounded_repr(w)}; a quantized weight scheme is a dict.")
    want = {
        "num_bits": 4,
        "type": "float",
        "group_size": _GROUP[fmt],
        "strategy": _STRATEGY[fmt],
        "symmetric": True,
    }
    for field, value in want.items():
        if w.get(field, value if field == "symmetric" else None) != value:
            raise ConfigurationError(
                f"{where}.weights.{field}={bounded_repr(w.get(field))}; {fmt} weights have {field} {value!r}."
            )
    targets = group.get("targets", [])
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ConfigurationError(f"{where}.targets={bounded_repr(targets)}; give a list of strings.")
    inputs = group.get("input_activations")  # dynamic "local" (NVFP4) keeps a global input scale; True none
    return Fp4Scheme(fmt, tuple(targets), isinstance(inputs, Mapping) and inputs.get("dynamic") is not True)


def _index(intervals: tuple[tuple[int, int], ...] | list[tuple[int, int]]) -> torch.Tensor:
    pieces = [torch.arange(a, b) for a, b in intervals]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


class CompressedFp4Quantizer(ConfigGroups):
    """Decode compressed-tensors NVFP4 and MXFP4 checkpoints; save them back byte for byte.

    Args:
        config: the checkpoint's ``quantization_config`` (``quant_method: "compressed-tensors"``,
            every config group ``nvfp4-pack-quantized`` or ``mxfp4-pack-quantized``), written
            back unchanged by a save.

    Raises:
        ConfigurationError: a field this quantizer reads has the wrong type or value (the message
            names it), or the checkpoint is not stored compressed.
    """

    loads_in_transformers = True
    parse_scheme = staticmethod(_scheme)
    stores = "packed FP4 weights"

    def _owned(self, key: str) -> tuple[str, Fp4Scheme] | None:
        module, _, name = key.rpartition(".")
        if name != "weight_packed":
            return None
        scheme = self.scheme_of(module)
        return None if scheme is None else ((f"{module}." if module else ""), scheme)

    # ------------------------------------------------------------------ hooks
    def update_weight_conversions(self, transforms: list[WeightTransform]) -> list[WeightTransform]:
        """``X.weight_packed`` loads into ``X.weight`` (the model's parameter)."""
        return [*transforms, WeightRenaming(r"\.weight_packed$", ".weight")]

    def dequantized_name(self, key: str) -> str:
        """A dequantized save writes the floats of ``X.weight_packed`` as ``X.weight``."""
        return key.removesuffix("_packed") if key.endswith(".weight_packed") else key

    def companions(self, key: str, info: StoredTensor) -> tuple[str, ...]:
        if key.rpartition(".")[2] != "weight_packed":
            return ()
        owned = self._owned(key)
        if owned is None:  # packed codes never load as they are
            raise ConversionError(
                f"{key!r} holds packed FP4 codes, but no config group of the quantization_config quantizes "
                f"{key.rpartition('.')[0]!r} (it is ignored or untargeted): the config does not describe this "
                "checkpoint."
            )
        prefix, s = owned
        names = ["weight_scale"] + (["weight_global_scale"] if s.format == NVFP4 else [])
        names += ["input_global_scale"] if s.input_scale else []
        return tuple(prefix + n for n in names)

    def companion_of(self, key: str) -> str | None:
        module, _, name = key.rpartition(".")
        if name not in _COMPANIONS:
            return None
        return (f"{module}." if module else "") + "weight_packed"

    def checks(self, key: str, info: StoredTensor) -> bool:
        return key.rpartition(".")[2] in _COMPANIONS

    def check(self, key: str, tensor: torch.Tensor) -> None:
        """Scales of the stored dtype, finite and not negative; global scales one positive float32.

        Raises:
            ConversionError: naming ``key`` and what is wrong with it.
        """
        module, _, name = key.rpartition(".")
        if name != "weight_scale":
            if tensor.dtype != torch.float32 or tensor.numel() != 1:
                raise ConversionError(
                    f"{key!r} is {tensor.dtype} {tuple(tensor.shape)}; a global scale is one float32 value."
                )
            bad = None if meta.is_meta(tensor) else first_bad_scale(tensor, zero_allowed=False, limit=3e38)
            if bad is not None:
                raise ConversionError(f"{key!r} is {bad[1]}; a global scale is finite and positive.")
            return
        try:
            scheme = self.scheme_of(module)
        except ConversionError:
            scheme = None  # the weight's own entry says why
        fmt = scheme.format if scheme is not None else None
        want = _SCALE_DTYPE.get(fmt or "")
        if want is not None and tensor.dtype != want:
            raise ConversionError(
                f"{key!r} is {tensor.dtype}; {fmt} scales are {want}"
                + (" (E8M0 exponents)." if fmt == MXFP4 else ".")
            )
        if meta.is_meta(tensor) or tensor.numel() == 0:
            return
        if tensor.dtype == torch.uint8:
            if int(tensor.max()) > _MAX_E8M0:
                index = tuple(int(i) for i in (tensor > _MAX_E8M0).nonzero()[0])
                raise ConversionError(
                    f"{key!r}: the scale of group {index} is byte {int(tensor[index])} (NaN or overflowing "
                    "float32 in E8M0); the file is corrupt."
                )
            return
        bad = first_bad_scale(tensor, zero_allowed=True, limit=torch.finfo(tensor.dtype).max)
        if bad is not None:
            raise ConversionError(
                f"{key!r}: the scale of group {bad[0]} is {bad[1]}; FP4 group scales are finite and not negative."
            )

    def _companion(self, key: str, name: str, companions: Mapping[str, torch.Tensor]) -> torch.Tensor:
        full = key.removesuffix("weight_packed") + name
        t = companions.get(full)
        if t is None:
            raise ConversionError(f"{key!r}: its {name} {full!r} is missing from the checkpoint.")
        self.check(full, t)
        return t

    def _group_scales(self, key: str, s: Fp4Scheme, companions: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The float32 scale of each group (``[N, K/g]``) the codes are multiplied by."""
        scale = self._companion(key, "weight_scale", companions)
        if s.format == MXFP4:
            return torch.ldexp(torch.ones(scale.shape), e8m0_exponent(scale))
        return scale.to(torch.float32) / self._companion(key, "weight_global_scale", companions).to(
            torch.float32
        )

    def _check_shape(self, key: str, s: Fp4Scheme, shape: tuple[int, ...], scale: torch.Tensor) -> None:
        if len(shape) != 2:
            raise ConversionError(f"{key!r} has shape {shape}; packed FP4 weights are 2-d uint8 [N, K/2].")
        n, k = shape[0], shape[1] * 2
        if k % s.group_size or tuple(scale.shape) != (n, k // s.group_size):
            raise ConversionError(
                f"{key.removesuffix('weight_packed')}weight_scale has shape {tuple(scale.shape)}; a [{n}, {k}] "
                f"{s.format} weight has one scale per {s.group_size} values: [{n}, {k // s.group_size}]."
            )

    def companion_region(self, key: str, companion: str, region: Region, info: StoredTensor) -> Region | None:
        """The rows (a split of the rows) or groups (of the columns) of ``weight_scale`` covering
        ``region``; the global scales are one value each, read whole (``None``)."""
        owned = self._owned(key)
        if owned is None or companion.rpartition(".")[2] != "weight_scale":
            return None
        if region.dim % 2 == 0:
            return Region.of(0, region.intervals)
        g = owned[1].group_size
        return Region.of(1, [(a // g, -(-b // g)) for a, b in region.intervals])

    def stored_region(self, key: str, region: Region, info: StoredTensor) -> Region:
        """The part of ``X.weight_packed`` holding ``region`` of the decoded weight.

        Raises:
            ConfigurationError: a split of the columns inside a group of 16 (NVFP4) or 32 (MXFP4).
        """
        owned = self._owned(key)
        if owned is None or region.dim % 2 == 0:
            return region
        self._aligned(key, owned[1], region)
        return Region.of(1, [(a // 2, b // 2) for a, b in region.intervals])

    def _aligned(self, key: str, s: Fp4Scheme, region: Region) -> None:
        for a, b in region.intervals:
            if a % s.group_size or b % s.group_size:
                raise ConfigurationError(
                    f"{key!r}: a tensor-parallel split of dim 1 at columns [{a}, {b}) is not aligned to the "
                    f"{s.format} group size {s.group_size}; choose a tensor-parallel size that splits the columns "
                    "into whole groups."
                )

    def decode(
        self,
        key: str,
        tensor: torch.Tensor,
        companions: dict[str, torch.Tensor],
        region: Region | None = None,
    ) -> torch.Tensor:
        owned = self._owned(key)
        if owned is None:
            raise ConversionError(f"{key!r} is not a weight a compressed-tensors FP4 config group quantizes.")
        s = owned[1]
        if tensor.dtype != torch.uint8 or tensor.dim() != 2:
            raise ConversionError(
                f"{key!r} is {tensor.dtype} {tuple(tensor.shape)}; packed FP4 weights are 2-d uint8."
            )
        scale = self._companion(key, "weight_scale", companions)
        if region is None:
            self._check_shape(key, s, tuple(tensor.shape), scale)
        if meta.is_meta(tensor):
            return meta.empty((tensor.shape[0], tensor.shape[1] * 2), torch.float32)
        groups = self._group_scales(key, s, companions)
        if region is not None and region.dim % 2 == 0:
            groups = groups.index_select(0, _index(region.intervals))
        elif region is not None:
            self._aligned(key, s, region)
            g = s.group_size
            groups = groups.index_select(1, _index([(a // g, b // g) for a, b in region.intervals]))
        values = e2m1_decode(unpack_nibbles(tensor))
        n, k = values.shape
        if tuple(groups.shape) != (n, k // s.group_size):
            raise ConversionError(
                f"{key!r}: the part read has shape {(n, k)}, its scales {tuple(groups.shape)}."
            )
        return (values.view(n, -1, s.group_size) * groups.unsqueeze(-1)).view(n, k)

    def encode(
        self, key: str, tensor: torch.Tensor, recorded: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``tensor`` as packed codes with the recorded scales; groups that outgrew theirs get fresh ones."""
        owned = self._owned(key)
        if owned is None:
            raise ConversionError(f"{key!r} is not a weight a compressed-tensors FP4 config group quantizes.")
        prefix, s = owned
        scale = self._companion(key, "weight_scale", recorded)
        if tensor.dim() != 2 or tensor.shape[1] % 2:
            raise ConversionError(f"{prefix}weight has shape {tuple(tensor.shape)}; FP4 packs 2-d weights.")
        n, k = tensor.shape
        self._check_shape(key, s, (n, k // 2), scale)
        out = dict(recorded)
        if meta.is_meta(tensor):
            return {**out, key: torch.empty((n, k // 2), dtype=torch.uint8, device="meta")}
        w = tensor.to(torch.float32).view(n, -1, s.group_size)
        if not bool(torch.isfinite(w).all()):
            raise ConversionError(f"{prefix}weight holds non-finite values; FP4 cannot store them.")
        q = w / self._group_scales(key, s, recorded).unsqueeze(-1)
        over = q.abs().amax(dim=-1) > _OVERFLOW
        if bool(over.any()):
            amax = w.abs().amax(dim=-1)
            if s.format == MXFP4:
                fresh = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-E8M0_BIAS, _MAX_E8M0 - E8M0_BIAS)
                scale = torch.where(over, (fresh + E8M0_BIAS).to(torch.uint8), scale)
                out[prefix + "weight_scale"] = scale
            else:
                recorded_gs = self._companion(key, "weight_global_scale", recorded)
                gs = recorded_gs.to(torch.float32)
                want = amax / E2M1_MAX * gs
                fp8_max = torch.finfo(scale.dtype).max
                if bool(
                    (want > fp8_max).any()
                ):  # past what the global scale allows: a fresh one, every group anew
                    gs = (fp8_max * E2M1_MAX / w.abs().amax()).reshape(recorded_gs.shape)
                    out[prefix + "weight_global_scale"] = gs
                    want = amax / E2M1_MAX * gs
                    over = torch.ones_like(over)
                stored = want.to(scale.dtype)
                bumped = (want * (1 + 2.0**-3)).to(scale.dtype)  # e4m3: 3 mantissa bits; never round down
                stored = torch.where(stored.to(torch.float32) < want, bumped, stored)
                bits = torch.where(over, stored.view(torch.uint8), scale.view(torch.uint8))
                out[prefix + "weight_scale"] = bits.view(scale.dtype)
            q = w / self._group_scales(key, s, out).unsqueeze(-1)
        out[key] = pack_nibbles(e2m1_encode(q.view(n, k)))
        return out
