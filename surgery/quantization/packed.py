"""Keep quantized weights packed at runtime: :class:`PackedLinear` holds the stored tensors, decodes per forward.

A checkpoint stored quantized (FP8 block scales, GPTQ, AWQ, ...) normally decodes to floats at
load. :class:`KeepPacked` wraps such a quantizer so that the linears whose weight is stored
quantized become :class:`PackedLinear` modules holding the stored tensors **as stored**: same
local names (``qweight``, ``qzeros``, ``scales``, ``g_idx``; ``weight``, ``weight_scale_inv``),
shapes and dtypes, read from the checkpoint's headers. The load is then 1:1 (nothing decoded,
nothing cast), memory is the packed size (a 4-bit weight: about a quarter of bfloat16), and a
save writes the same bytes back without decoding.

The forward decodes the weight with the wrapped quantizer's own ``decode`` hook and calls
``F.linear`` in the activations' dtype: any format with a ``decode`` runs, on any device, and
the product equals a float model loaded with the decoded weights, bit for bit.

With ``kernel=True``, a 4-bit format whose quantizer offers ``int4_operands`` (GPTQ without
act-order, AWQ, compressed-tensors int4 groups without act-order) runs PyTorch's own CPU kernel ``aten._weight_int4pack_mm_for_cpu`` instead:

* it computes ``x @ ((q - 8) * scale + zero).T`` in bfloat16 with scales and zeros rounded to
  bfloat16 (not exact: about bfloat16 precision, ``rtol`` 1e-2 against the decoded product);
* its group size must be 32, 64, 128 or 256 and divide ``in_features``, and ``out_features``
  must be a multiple of 16 (torch 2.13's rules, measured); anything else (and a
  device other than CPU, or a probe that finds the kernel wrong) takes the decode path, decided
  once per module and device (:func:`int4_kernel_usable`);
* its weight operand is a second copy of the codes in the kernel's own layout
  (``aten._convert_weight_to_int4pack_for_cpu``), made on the first forward and kept beside the
  stored tensors (those stay for the save): the weight then takes twice its packed size, still
  half of bfloat16.

Only linears whose checkpoint keys are the module's own (``<path>.qweight``: no renaming) and
that the model's conversion mapping leaves alone (no RoPE permute of ``q_proj``, say) are kept
packed; the others load as the wrapped quantizer loads them (decoded).

Example:
    >>> q = KeepPacked(GPTQQuantizer.from_config(cfg), checkpoint="llama-gptq/")  # doctest: +SKIP
    >>> surgery.load_checkpoint(model, "llama-gptq/", quantizer=q)  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import os
import re
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import StoredTensor, open_checkpoint
from ..errors import ConfigurationError, ConversionError, SurgeryError
from ..graph import match_modules, swap_module
from ..parallel.regions import Region
from ..record import update_record
from ..transforms import WeightRenaming, WeightTransform
from .int8 import kernel_operand
from .kernels import fp8_block_kernel_usable, fp8_block_linear, weight_scale_operand
from .protocol import SMALL_COMPANION_BYTES

__all__ = ["INT4_GROUP_SIZES", "KeepPacked", "PackedLinear", "PackedModule", "int4_kernel_usable"]

INT4_GROUP_SIZES = (32, 64, 128, 256)
"""The group sizes ``aten._weight_int4pack_mm_for_cpu`` takes (torch 2.13)."""
_INNER_K_TILES = 2
_N_MULTIPLE = 16
_probed: dict[str, bool] = {}
_probe_lock = threading.Lock()


def int4_kernel_usable(
    device: torch.device | str, *, in_features: int, out_features: int, group_size: int
) -> bool:
    """Whether the int4 CPU kernel computes a correct product for this shape on ``device``.

    ``False`` off CPU, for a group size it does not take or one that does not divide
    ``in_features``, and for ``out_features`` not a multiple of 16 (its weight layout's rule),
    without calling it; otherwise one probe per device type, cached.
    """
    device = torch.device(device)
    if (
        device.type != "cpu"
        or group_size not in INT4_GROUP_SIZES
        or in_features % group_size
        or out_features % _N_MULTIPLE
    ):
        return False
    with _probe_lock:
        if device.type not in _probed:
            _probed[device.type] = _probe()
        return _probed[device.type]


def _probe() -> bool:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 64), generator=gen, dtype=torch.int32)
    scale = (torch.rand(2, 16, generator=gen) + 0.5).to(torch.bfloat16)
    zero = torch.randn(2, 16, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    w = (q.float() - 8) * scale.float().T.repeat_interleave(32, 1) + zero.float().T.repeat_interleave(32, 1)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, packed, 32, torch.stack([scale, zero], -1)
        ).float()
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return bool(torch.allclose(got, x.float() @ w.T, rtol=2e-2, atol=0.5))


class PackedLinear(nn.Module):
    """A linear layer holding its weight as stored quantized tensors; decodes it per forward.

    Args:
        decoder: the quantizer whose ``decode(key, tensor, companions)`` turns the stored tensors
            into the ``(out_features, in_features)`` float weight.
        key: the checkpoint key of the packed weight (``"model.layers.0.q_proj.qweight"``).
        stored: local name → stored tensor info (shape and dtype) of the packed weight and its
            companions; the module allocates empty buffers of exactly those.
        in_features / out_features / bias: as for ``nn.Linear``; ``bias`` is a parameter.
        device / dtype: where the buffers live; the bias dtype.
    """

    def __init__(
        self,
        decoder: Any,
        key: str,
        stored: dict[str, StoredTensor],
        *,
        in_features: int,
        out_features: int,
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        kernel: bool = False,
    ) -> None:
        super().__init__()
        self.decoder, self.key, self.kernel = decoder, key, kernel
        self._int4: tuple[Any, ...] | None = None  # (stamp, device, operands or None)
        self._fp8: tuple[Any, ...] | None = None  # the same, for the FP8 block kernel
        self.prefix, _, self.packed_name = key.rpartition(".")
        self.in_features, self.out_features = in_features, out_features
        self.float_dtype = dtype if dtype is not None and dtype.is_floating_point else torch.float32
        self.packed_names = tuple(stored)
        self.stored = dict(stored)
        self._tp: tuple[Any, Region] | None = None  # (process group, this rank's region of the weight)
        for name, info in stored.items():
            self.register_buffer(name, torch.empty(tuple(info.shape), dtype=info.dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def _full(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def decoded_weight(self) -> torch.Tensor:
        """The float weight the stored tensors stand for (the wrapped quantizer's ``decode``);
        under tensor parallelism, this rank's share of it."""
        if self._tp is not None:
            return self._local_weight(self._tp[1])
        w = self.decoder.decode(self.key, getattr(self, self.packed_name), self._companions(), None)
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ConfigurationError(
                f"{self.key!r} decodes to shape {tuple(w.shape)}; the linear it stands for is "
                f"({self.out_features}, {self.in_features})."
            )
        return w

    def dequantized(self, *, meta: bool = False) -> dict[str, torch.Tensor]:
        """``{"weight": ...}`` in the dtype of the linear it stands for: what a
        ``quantization="dequantized"`` save writes instead of the stored tensors."""
        if meta:
            return {
                "weight": torch.empty(
                    (self.out_features, self.in_features), dtype=self.float_dtype, device="meta"
                )
            }
        return {"weight": self.decoded_weight().to(self.float_dtype)}

    def _companions(self) -> dict[str, torch.Tensor]:
        return {self._full(n): getattr(self, n) for n in self.packed_names if n != self.packed_name}

    def int4_operands(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The int4 kernel's weight and scale/zero operands and group size, or ``None``: decode instead.

        Built on the first call and kept while the stored tensors are unchanged (same storage,
        no in-place write since); ``None`` without ``kernel=True``, for a quantizer without
        ``int4_operands``, or where :func:`int4_kernel_usable` says no.
        """
        if not self.kernel or not callable(getattr(self.decoder, "int4_operands", None)):
            return None
        tensors = [getattr(self, n) for n in self.packed_names]
        stamp = tuple((t.data_ptr(), t._version) for t in tensors)
        device = tensors[0].device
        if self._int4 is None or self._int4[0] != stamp or self._int4[1] != device:
            self._int4 = (stamp, device, self._build_int4(device))
        return self._int4[2]

    def fp8_operands(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The FP8 weight and its block scales laid out for :func:`~surgery.quantization.kernels.fp8_block_linear`
        (:func:`~surgery.quantization.kernels.weight_scale_operand`), or ``None``: decode instead.

        ``None`` without ``kernel=True``, for a quantizer without ``fp8_block_operands``, under
        tensor parallelism, and where :func:`~surgery.quantization.kernels.fp8_block_kernel_usable`
        says no for the weight's device (decided once per device, then cached with the operands).
        """
        if not self.kernel or self._tp is not None:
            return None
        hook = getattr(self.decoder, "fp8_block_operands", None)
        if not callable(hook):
            return None
        tensors = [getattr(self, n) for n in self.packed_names]
        stamp = tuple((t.data_ptr(), t._version) for t in tensors)
        device = tensors[0].device
        if self._fp8 is None or self._fp8[0] != stamp or self._fp8[1] != device:
            found = hook(self.key, getattr(self, self.packed_name), self._companions())
            usable = found is not None and fp8_block_kernel_usable(
                device,
                in_features=self.in_features,
                out_features=self.out_features,
                block=found[2],
                dtype=found[0].dtype,
            )
            operands = (found[0], weight_scale_operand(found[1])) if usable and found is not None else None
            self._fp8 = (stamp, device, operands)
        return self._fp8[2]

    def kernel_name(self) -> str:
        """What the forward runs on the weight's current device."""
        if self._tp is None and self.fp8_operands() is not None:
            return "fp8 block-scaled matmul (scaled_mm 1x128 x 128x128)"
        if self._tp is None and self.int4_operands() is not None:
            return "aten._weight_int4pack_mm_for_cpu"
        return "decode + F.linear"

    def _build_int4(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        found = self.decoder.int4_operands(self.key, getattr(self, self.packed_name), self._companions())
        if found is None:
            return None
        codes, scale, zero, group = found
        if not int4_kernel_usable(
            device, in_features=self.in_features, out_features=self.out_features, group_size=group
        ):
            return None
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), _INNER_K_TILES)
        return packed, torch.stack([scale, zero], -1).to(torch.bfloat16).contiguous(), group

    # ------------------------------------------------------------------ tensor parallelism
    def tp_placements(self, dim: int, world: int) -> dict[str, Any]:
        """Per stored tensor, its placement when the weight's ``dim`` (0: out-, 1: in-features) is
        split over ``world`` ranks: ``Shard`` on the stored dim where each rank's part (the format's
        ``stored_region`` / ``companion_region``) is exactly torch's chunk of it, else ``Replicate``.

        Raises:
            ConfigurationError: the split cuts a packed word, group or block (the format says
                which), or leaves the packed weight itself without an even split.
        """
        from torch.distributed.tensor import Replicate, Shard

        size = (self.out_features, self.in_features)[dim]
        if size % world:
            raise ConfigurationError(
                f"{self.key!r}: dim {dim} of its {(self.out_features, self.in_features)} weight does not split "
                f"over {world} ranks; use a world size that divides {size}."
            )
        regions = [Region.of(dim, [(r * size // world, (r + 1) * size // world)]) for r in range(world)]
        info = self.stored[self.packed_name]
        out: dict[str, Any] = {}
        for name, stored in self.stored.items():
            if name == self.packed_name:
                hook = getattr(self.decoder, "stored_region", None)
                parts = [hook(self.key, r, info) if callable(hook) else r for r in regions]
            else:
                hook = getattr(self.decoder, "companion_region", None)
                parts = [
                    hook(self.key, self._full(name), r, info) if callable(hook) else None for r in regions
                ]
            chunked = _chunk_dim(parts, tuple(stored.shape))
            if chunked is None and name == self.packed_name:
                raise ConfigurationError(
                    f"{self.key!r}: splitting dim {dim} of the weight over {world} ranks gives stored parts "
                    f"{[p.intervals if p else None for p in parts]}, not equal chunks of a stored dim; use a world "
                    "size that splits it into whole words, groups or blocks."
                )
            out[name] = Replicate() if chunked is None else Shard(chunked)
        return out

    def shard(self, mesh: Any, dim: int) -> None:
        """Make the stored tensors (and the bias) DTensors split as :meth:`tp_placements` says, and
        the forward compute this rank's share: its out-features (``dim=0``: the output stays
        local, as ``ColwiseParallel``'s) or its in-features (``dim=1``: the input is the local
        shard, the output is summed over the ranks, as ``RowwiseParallel``'s)."""
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        world, rank = mesh.size(), mesh.get_local_rank()
        for name, placement in self.tp_placements(dim, world).items():
            self.register_buffer(
                name, distribute_tensor(getattr(self, name), mesh, [placement], src_data_rank=None)
            )
        if self.bias is not None:
            self.bias = nn.Parameter(
                distribute_tensor(
                    self.bias.data, mesh, [Shard(0) if dim == 0 else Replicate()], src_data_rank=None
                ),
                requires_grad=self.bias.requires_grad,
            )
        size = (self.out_features, self.in_features)[dim]
        self._tp = (mesh.get_group(), Region.of(dim, [(rank * size // world, (rank + 1) * size // world)]))

    def _local_weight(self, region: Region) -> torch.Tensor:
        """This rank's ``region`` of the weight, decoded from its local parts (companions at their
        full shape, ones where another rank's part lies: decoding ``region`` never reads them)."""
        packed = getattr(self, self.packed_name)
        companions = {}
        for name in self.packed_names:
            if name == self.packed_name:
                continue
            t = getattr(self, name)
            local = _local(t)
            shard = [p for p in getattr(t, "placements", ()) if hasattr(p, "dim")]
            if shard:
                d, n = shard[0].dim, local.shape[shard[0].dim]
                full = torch.ones(tuple(self.stored[name].shape), dtype=local.dtype, device=local.device)
                full.narrow(d, t.device_mesh.get_local_rank() * n, n).copy_(local)
                local = full
            companions[self._full(name)] = local
        return self.decoder.decode(self.key, _local(packed), companions, region)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._tp is not None:
            group, region = self._tp
            bias = None if self.bias is None else _local(self.bias)
            w = self._local_weight(region).to(x.dtype)
            if region.dim == 0:  # its out-features of the whole input: a local output
                return F.linear(x, w, bias)
            from ..parallel.styles import sum_over_ranks

            y = sum_over_ranks(F.linear(x, w), group)  # its in-features' part of every output, summed
            return y if bias is None else y + bias
        fp8 = self.fp8_operands()
        if fp8 is not None and not torch.compiler.is_compiling():
            return fp8_block_linear(x, *fp8, self.bias)
        ops = self.int4_operands()
        if ops is None:
            return F.linear(x, self.decoded_weight().to(x.dtype), self.bias)
        packed, scale_zero, group = ops
        flat = kernel_operand(x.reshape(-1, self.in_features).to(torch.bfloat16))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, group, scale_zero)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"packed={self.packed_names}"
        )


class PackedModule(nn.Module):
    """A module (an experts block: 3-D ``gate_up_proj``, ``down_proj``) whose stored-quantized
    parameters stay as stored; per forward they are decoded and the module's own forward runs.

    The wrapped module is held, not registered as a child: this module's state is the stored
    tensors under their checkpoint names (``gate_up_proj_blocks``, ``gate_up_proj_scales``) and
    the wrapped module's other parameters and buffers (biases), the same objects, so a load fills
    them 1:1 and a save writes them back unchanged. The wrapped module's float copies of the kept
    parameters are dropped (``meta`` placeholders): they are never allocated. It takes no parallel
    style yet (a plan entry on it is refused). Attributes the wrapped module has
    (``num_experts``) read through.

    Args:
        decoder: the format's quantizer (its ``decode``).
        module: the module whose parameters are stored quantized.
        kept: parameter name → (checkpoint key of its packed tensor, local name → stored info of
            the packed tensor and its companions).
    """

    def __init__(
        self, decoder: Any, module: nn.Module, kept: dict[str, tuple[str, dict[str, StoredTensor]]]
    ) -> None:
        super().__init__()
        self.decoder = decoder
        self._wrapped = (module,)  # a tuple: not a child module
        self.kept = {pname: key for pname, (key, _) in kept.items()}
        self._stored_of = {pname: tuple(stored) for pname, (_, stored) in kept.items()}
        self.float_dtypes = {p: module._parameters[p].dtype for p in kept}  # type: ignore[union-attr]
        device = next(iter(module._parameters.values())).device  # type: ignore[union-attr]
        names: list[str] = []
        for _, stored in kept.values():
            for name, info in stored.items():
                self.register_buffer(name, torch.empty(tuple(info.shape), dtype=info.dtype, device=device))
                names.append(name)
        self.packed_names = tuple(names)
        for pname in kept:  # the floats are not kept: a placeholder of their shape and dtype
            w = module.get_parameter(pname)
            module._parameters[pname] = nn.Parameter(
                torch.empty(tuple(w.shape), dtype=w.dtype, device="meta"), requires_grad=False
            )
        for n, p in module._parameters.items():
            if n not in kept:
                self.register_parameter(n, p)
        for n, b in module._buffers.items():
            self.register_buffer(n, b, persistent=n not in module._non_persistent_buffers_set)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("_wrapped")
            if wrapped is None or name in wrapped[0]._parameters or name in wrapped[0]._buffers:
                raise  # its tensors are this module's own (or, kept, stored packed here)
            return getattr(wrapped[0], name)

    def _decoded(self, pname: str) -> torch.Tensor:
        key = self.kept[pname]
        prefix = key[: len(key) - len(key.rpartition(".")[2])]
        companions = {prefix + n: getattr(self, n) for n in self._stored_of[pname] if prefix + n != key}
        return self.decoder.decode(key, getattr(self, key[len(prefix) :]), companions, None)

    def dequantized(self, *, meta: bool = False) -> dict[str, torch.Tensor]:
        """Each kept parameter's float value: what a ``quantization="dequantized"`` save writes."""
        module = self._wrapped[0]
        if meta:
            return {
                p: torch.empty(tuple(module._parameters[p].shape), dtype=d, device="meta")  # type: ignore[union-attr]
                for p, d in self.float_dtypes.items()
            }
        return {p: self._decoded(p).to(d) for p, d in self.float_dtypes.items()}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self._wrapped[0]
        saved = dict(module._parameters)
        x = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        try:
            for pname in self.kept:
                w = self._decoded(pname)
                module._parameters[pname] = w.to(x.dtype if x is not None else self.float_dtypes[pname])  # type: ignore[assignment]
            for n in saved:
                if n not in self.kept:
                    module._parameters[n] = self._parameters[n]
            for n in module._buffers:
                module._buffers[n] = self._buffers[n]
            return module(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    def extra_repr(self) -> str:
        return f"{type(self._wrapped[0]).__name__}, packed={self.packed_names}"


def _leaf(module: nn.Module) -> bool:
    """Whether ``module`` holds no parameters or buffers below its own (its children hold none)."""
    return not any(True for c in module.children() for _ in itertools.chain(c.parameters(), c.buffers()))


def _check_decodes(
    quantizer: Any,
    key: str,
    stored: dict[str, StoredTensor],
    prefix: str,
    shape: tuple[int, ...],
    small: dict[str, torch.Tensor],
) -> None:
    """Run ``decode`` on ``meta`` tensors of the stored shapes and dtypes (``small`` companions, a
    stored ``weight_shape``, with their values): it must give the linear's weight shape.

    Raises:
        ConversionError: naming the key whose layout the quantizer refuses, or the shape mismatch.
    """
    metas = {
        prefix + n: small.get(prefix + n, torch.empty(tuple(i.shape), dtype=i.dtype, device="meta"))
        for n, i in stored.items()
    }
    main = metas.pop(key)
    try:
        decoded = quantizer.decode(key, main, metas, None)
    except SurgeryError:
        raise
    except Exception as exc:
        raise ConversionError(
            f"{type(quantizer).__name__}.decode({key!r}) failed: {type(exc).__name__}: {exc}"
        ) from exc
    if tuple(decoded.shape) != shape:
        raise ConversionError(
            f"{key!r} decodes to shape {tuple(decoded.shape)}; the model's linear there is {shape} (out, in)."
        )


class KeepPacked:
    """Wrap a quantizer so the linears it would decode keep their stored tensors (:class:`PackedLinear`).

    Args:
        quantizer: the format's quantizer (``companions``/``decode`` hooks, e.g.
            :class:`~surgery.quantization.GPTQQuantizer`, :class:`~surgery.quantization.FP8BlockQuantizer`).
        checkpoint: the checkpoint to be loaded: its headers give the stored shapes and dtypes.
        targets: module path patterns (as a ``tp_plan``'s) to keep packed; default every linear.
        kernel: run the int4 CPU kernel where the format and shape allow (module docstring).

    Every other hook is the wrapped quantizer's: keys of linears not kept packed decode as usual,
    scales are checked the same way, and ``quantization_config()`` is the format's, so a save
    writes the packed tensors and the config back unchanged.
    """

    def __init__(
        self,
        quantizer: Any,
        *,
        checkpoint: str | os.PathLike[str],
        targets: tuple[str, ...] | None = None,
        kernel: bool = False,
    ) -> None:
        if not callable(getattr(quantizer, "decode", None)) or not callable(
            getattr(quantizer, "companions", None)
        ):
            raise ConfigurationError(
                f"KeepPacked wraps a quantizer of a format stored quantized (companions and decode); "
                f"{type(quantizer).__name__} has no such hooks."
            )
        self.quantizer, self.checkpoint, self.targets, self.kernel = quantizer, checkpoint, targets, kernel
        self._kept: set[str] = set()  # checkpoint keys held packed (primary and companions)
        self._decoded: list[str] = []  # stored-quantized keys not kept: they decode as the format does

    def __repr__(self) -> str:
        return f"KeepPacked({self.quantizer!r})"

    def __getattr__(self, name: str) -> Any:
        if name in ("quantization_config", "metadata", "loads_in_transformers", "encode", "stored_region"):
            return getattr(self.quantizer, name)  # a format that reshapes (packed values) has stored_region
        raise AttributeError(name)

    def prepare(self, model: nn.Module) -> None:
        """Swap every target ``nn.Linear`` whose weight the checkpoint stores quantized for a :class:`PackedLinear`."""
        paths = (
            {p for pattern in self.targets for p in match_modules(model, pattern)}
            if self.targets is not None
            else None
        )
        with open_checkpoint(self.checkpoint) as reader:
            infos = {k: reader.info(k) for k in reader}
            small = {k: reader.get_tensor(k) for k, i in infos.items() if i.nbytes <= SMALL_COMPANION_BYTES}
        converted = self._converted(model)
        self._kept.clear()
        for path, module in list(model.named_modules()):
            if paths is not None and path not in paths:
                continue
            prefix = f"{path}." if path else ""
            own = [k for k in infos if k.startswith(prefix) and "." not in k[len(prefix) :]]
            packed = [(k, tuple(self.quantizer.companions(k, infos[k]))) for k in own]
            packed = [(k, c) for k, c in packed if c and not converted(k)]  # a converted one decodes
            if not packed:
                continue
            for key, companions in packed:
                missing = [c for c in companions if c not in infos]
                if missing:
                    raise ConversionError(
                        f"{key!r} is stored quantized, but its {', '.join(map(repr, missing))} "
                        f"{'is' if len(missing) == 1 else 'are'} missing from the checkpoint; it cannot be decoded, "
                        "so it is not loaded as raw codes."
                    )
            if isinstance(module, nn.Linear):
                if len(packed) == 1 and self._parameter_of(packed[0][0], prefix) == "weight":
                    self._keep_linear(model, path, module, packed[0], infos, small)
            elif _leaf(module) and all(
                isinstance(module._parameters.get(self._parameter_of(k, prefix)), torch.Tensor)
                for k, _ in packed
            ):
                self._keep_module(model, path, module, packed, infos, small)
        self._decoded = [
            k for k, i in infos.items() if k not in self._kept and self.quantizer.companions(k, i)
        ]
        update_record(model, quantizer=self)

    def _parameter_of(self, key: str, prefix: str) -> str:
        """The module's parameter a stored-quantized ``key`` decodes into (``X_blocks`` → ``X``)."""
        hook = getattr(self.quantizer, "dequantized_name", None)
        name = hook(key) if callable(hook) else key
        return name[len(prefix) :] if name.startswith(prefix) else name

    def _keep_linear(
        self,
        model: nn.Module,
        path: str,
        module: nn.Linear,
        packed: tuple[str, tuple[str, ...]],
        infos: dict[str, StoredTensor],
        small: dict[str, torch.Tensor],
    ) -> None:
        prefix = f"{path}." if path else ""
        key, companions = packed
        stored = {k[len(prefix) :]: infos[k] for k in (key, *companions)}
        _check_decodes(self.quantizer, key, stored, prefix, (module.out_features, module.in_features), small)
        swap_module(
            model,
            path,
            PackedLinear(
                self.quantizer,
                key,
                stored,
                in_features=module.in_features,
                out_features=module.out_features,
                bias=module.bias is not None,
                device=module.weight.device,
                dtype=module.weight.dtype,
                kernel=self.kernel,
            ),
        )
        self._kept.update(prefix + n for n in stored)

    def _keep_module(
        self,
        model: nn.Module,
        path: str,
        module: nn.Module,
        packed: list[tuple[str, tuple[str, ...]]],
        infos: dict[str, StoredTensor],
        small: dict[str, torch.Tensor],
    ) -> None:
        prefix = f"{path}." if path else ""
        kept: dict[str, tuple[str, dict[str, StoredTensor]]] = {}
        for key, companions in packed:
            pname = self._parameter_of(key, prefix)
            stored = {k[len(prefix) :]: infos[k] for k in (key, *companions)}
            _check_decodes(
                self.quantizer, key, stored, prefix, tuple(module.get_parameter(pname).shape), small
            )
            kept[pname] = (key, stored)
        swap_module(model, path, PackedModule(self.quantizer, module, kept))
        self._kept.update(prefix + n for _, stored in kept.values() for n in stored)

    def _converted(self, model: nn.Module) -> Any:
        """``key -> bool``: whether the model's conversion mapping transforms ``key`` (as stored, or
        under the float name the format renames it to). Such a weight cannot load as stored: the
        transform (a RoPE permute of rows) would miss its scales, or not run at all."""
        from ..resolution import get_model_conversion_mapping

        mapping = list(get_model_conversion_mapping(model))
        hook = getattr(self.quantizer, "update_weight_conversions", None)
        renames = hook([]) if callable(hook) else []

        def converted(key: str) -> bool:
            names = {key}
            for t in renames:
                names.add(t.rename_source_key(key)[0])
            return any(t.match(n) is not None for t in mapping for n in names)

        return converted

    def update_weight_conversions(self, transforms: list[WeightTransform]) -> list[WeightTransform]:
        """The wrapped format's renamings (``X.qweight`` → ``X.weight``), for the keys it decodes only:
        a kept key loads under its own name into its :class:`PackedLinear`. Each decoded key gets
        its renaming by name when some are kept; the format's own otherwise."""
        hook = getattr(self.quantizer, "update_weight_conversions", None)
        if not callable(hook):
            return transforms
        added = hook(list(transforms))[len(transforms) :]
        if not self._kept:
            return [*transforms, *added]
        renames = []
        for key in self._decoded:
            new = key
            for t in added:
                new = t.rename_source_key(new)[0]
            if new != key:
                renames.append(WeightRenaming(f"^{re.escape(key)}$", new))
        return [*transforms, *renames]

    def companion_region(self, key: str, companion: str, region: Region, info: StoredTensor) -> Region | None:
        hook = getattr(self.quantizer, "companion_region", None)
        return hook(key, companion, region, info) if callable(hook) else None

    def dequantized_name(self, key: str) -> str:
        hook = getattr(self.quantizer, "dequantized_name", None)
        return hook(key) if callable(hook) else key

    # ------------------------------------------------------------------ hooks: the wrapped quantizer's, minus the kept keys
    def companions(self, key: str, info: StoredTensor) -> tuple[str, ...]:
        return () if key in self._kept else tuple(self.quantizer.companions(key, info))

    def keeps_packed(self, key: str) -> bool:
        """A key of a :class:`PackedLinear` loads as stored."""
        return key in self._kept

    def companion_of(self, key: str) -> str | None:
        if key in self._kept or not callable(getattr(self.quantizer, "companion_of", None)):
            return None
        return self.quantizer.companion_of(key)

    def decode(
        self,
        key: str,
        tensor: torch.Tensor,
        companions: dict[str, torch.Tensor],
        region: Region | None = None,
    ) -> torch.Tensor:
        return self.quantizer.decode(key, tensor, companions, region)

    def checks(self, key: str, info: StoredTensor) -> bool:
        checks = getattr(self.quantizer, "checks", None)
        return bool(checks(key, info)) if callable(checks) else False

    def check(self, key: str, tensor: torch.Tensor) -> None:
        self.quantizer.check(key, tensor)


def _chunk_dim(parts: list[Region | None], shape: tuple[int, ...]) -> int | None:
    """The stored dim the ``parts`` (one per rank) split into torch's equal chunks, or ``None``."""
    if any(p is None for p in parts):
        return None
    dims = {p.dim % len(shape) for p in parts if p is not None}
    if len(dims) != 1:
        return None
    d, world = dims.pop(), len(parts)
    if shape[d] % world:
        return None
    step = shape[d] // world
    want = [((r * step, (r + 1) * step),) for r in range(world)]
    return d if [p.intervals for p in parts if p is not None] == want else None


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t  # type: ignore[no-any-return]
