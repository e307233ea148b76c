"""Int8 weight-only quantization on the fly: ``nn.Linear`` → :class:`Int8WeightOnlyLinear` at load.

The weight is stored as int8 ``(N, K)`` with one float32 scale per output channel
(``amax / 127``, symmetric), a quarter of the float32 memory. The forward runs PyTorch's own
``aten._weight_int8pack_mm`` kernel on bfloat16 activations where it is correct, and otherwise
dequantizes and calls ``F.linear``:

* the CPU kernel (torch 2.13) is used only when ``in_features % 16 == 0``: for other ``K`` it
  returns wrong numbers or crashes the process (pytorch #136709, #158341);
* whether the kernel runs on a device is probed once per device (a tiny call compared with
  the dequantized product), and decided once per module and device, never per call;
* activations go to the kernel as bfloat16: with float32 ones it takes a slow path;
* every operand reaches the kernel contiguous, on the weight's device, of the dtype and shape
  it expects, and at an address aligned to 64 bytes (:func:`kernel_operand`): the CPU kernel
  loads with aligned vector instructions and crashes the process (SIGSEGV) on an operand a few
  bytes off (torch 2.13, measured on an AVX2 CPU: a bf16 input 2, 4, 8 or 40 bytes past a 64-byte
  boundary crashes, 0, 16, 32 and 48 work; issue 25 saw weights crash at offsets 1, 4, 8 and 40
  on another CPU, where the same offsets of the input work here). torch's allocators
  align to 64 bytes, but a memory-mapped load puts a weight wherever the file's header length
  puts it, so a misaligned weight is copied once, on its first kernel call (the module's own
  parameter, same values, now in owned memory), and a misaligned activation is copied per call.

``weight.dtype`` of a quantized layer is ``int8``: code that casts its input to the layer's
weight dtype (``x.to(self.proj.weight.dtype)``, common in patch embeddings) destroys the
activations. The forward refuses integer input with an error saying so; leave such modules out
of the targets.

The kernel beats a float32 ``F.linear`` at every batch size on CPU and a bfloat16 one only at
decode-sized batches (memory bound); see ``docs/benchmarks.md``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .. import meta
from ..checkpoint import StoredTensor
from ..errors import ConfigurationError, ConversionError
from ..graph import match_modules, swap_module
from ..record import update_record
from .protocol import bounded_repr, config_metadata, first_bad_scale

__all__ = [
    "KERNEL_ALIGNMENT",
    "Int8WeightOnlyLinear",
    "Int8WeightOnlyQuantizer",
    "int8_kernel_usable",
    "kernel_operand",
    "quantize_per_channel",
]

_KERNEL_K_MULTIPLE = 16
KERNEL_ALIGNMENT = 64
"""Byte alignment of every operand handed to ``aten._weight_int8pack_mm`` (torch's allocator alignment;
16 is the measured minimum, 64 leaves room for wider vector loads)."""
_probed: dict[tuple[str, int | None], bool] = {}
_probe_lock = threading.Lock()


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: ``(q, scale)`` with ``weight ≈ q * scale[:, None]``.

    ``scale = amax / 127`` per row, in float32; an all-zero row gets scale 0 and values 0.
    Works on ``meta`` tensors (shapes and dtypes only).
    """
    if weight.dim() != 2:
        raise ConversionError(
            f"int8 weight-only quantization takes a 2-D weight, got shape {tuple(weight.shape)}."
        )
    if meta.is_meta(weight):  # planning: shapes only (see surgery.meta)
        return meta.empty(weight.shape, torch.int8), meta.empty((weight.shape[0],), torch.float32)
    x = weight.to(torch.float32)
    scale = x.abs().amax(dim=1) / 127
    q = torch.div(x, scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    q.round_().clamp_(-127, 127)  # in place: one float temporary per weight, not three
    return q.to(torch.int8), scale


def int8_kernel_usable(device: torch.device | str, in_features: int) -> bool:
    """Whether ``aten._weight_int8pack_mm`` computes a correct product for ``in_features`` on ``device``.

    ``False`` for ``in_features`` not a multiple of 16 (the CPU kernel is wrong or crashes
    there) without calling it; otherwise one probe per device, cached.
    """
    device = torch.device(device)
    if in_features % _KERNEL_K_MULTIPLE or device.type == "meta":
        return False
    key = (device.type, device.index)
    with _probe_lock:
        if key not in _probed:
            _probed[key] = _probe(device)
        return _probed[key]


def kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is contiguous and starts at a :data:`KERNEL_ALIGNMENT`-byte address,
    else a contiguous copy (a fresh allocation is aligned).

    Example:
        >>> base = torch.zeros(40, dtype=torch.bfloat16)
        >>> off = base[1:33]  # starts 2 bytes past an aligned address
        >>> kernel_operand(off).data_ptr() % KERNEL_ALIGNMENT, torch.equal(kernel_operand(off), off)
        (0, True)
    """
    if t.is_contiguous() and t.data_ptr() % KERNEL_ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _probe(device: torch.device) -> bool:
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (8, 32), generator=gen, dtype=torch.int8)
    s = torch.rand(8, generator=gen) + 0.5
    x = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
    want = x.float() @ (w.float() * s[:, None]).T
    try:
        got = (
            torch.ops.aten._weight_int8pack_mm(x.to(device), w.to(device), s.to(torch.bfloat16).to(device))
            .float()
            .cpu()
        )
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(got, want, rtol=2e-2, atol=0.5))


class Int8WeightOnlyLinear(nn.Module):
    """A linear layer with an int8 weight and a float32 scale per output channel.

    Args:
        in_features / out_features / bias: as for ``nn.Linear``.
        device: where the (empty) tensors are allocated.
        dtype: the float dtype of the layer it stands for: the bias dtype, and the dtype an
            original-layout save dequantizes the weight to.

    Attributes:
        weight: ``int8`` ``(out_features, in_features)``, a ``Parameter`` without grad.
        weight_scale: ``float32`` ``(out_features,)``, a ``Parameter`` without grad.
    """

    quantized_names = ("weight", "weight_scale")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.float_dtype = dtype
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.int8, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, dtype=torch.float32, device=device), requires_grad=False
        )
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.empty(out_features, dtype=dtype, device=device)
            )
        else:
            self.register_parameter("bias", None)
        self._kernel: tuple[torch.device, bool] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        """The quantized counterpart of ``linear`` on its device; its values are quantized unless on ``meta``."""
        w = linear.weight
        new = cls(
            linear.in_features, linear.out_features, linear.bias is not None, device=w.device, dtype=w.dtype
        )
        if w.device.type != "meta":
            q, s = quantize_per_channel(w.detach())
            with torch.no_grad():
                new.weight.copy_(q)
                new.weight_scale.copy_(s)
                if linear.bias is not None:
                    assert new.bias is not None
                    new.bias.copy_(linear.bias)
        if linear.bias is not None:
            assert new.bias is not None
            new.bias.requires_grad_(linear.bias.requires_grad)
        return new

    @property
    def uses_kernel(self) -> bool:
        """Whether the forward on the weight's current device runs the int8 kernel.

        Setting ``False`` forces the dequantize fallback on the current device (benchmarks,
        debugging); setting ``True`` where the kernel is not usable is an error.
        """
        return self._decide()

    @uses_kernel.setter
    def uses_kernel(self, value: bool) -> None:
        if value and not int8_kernel_usable(self.weight.device, self.in_features):
            raise ConfigurationError(
                f"the int8 kernel is not usable for in_features={self.in_features} on {self.weight.device} "
                f"(it needs in_features % {_KERNEL_K_MULTIPLE} == 0 and a device that runs it)."
            )
        self._kernel = (self.weight.device, bool(value))

    def kernel_name(self) -> str:
        """What the forward runs on the weight's current device."""
        return "aten._weight_int8pack_mm" if self.uses_kernel else "dequantize + F.linear"

    def _decide(self) -> bool:
        device = self.weight.device
        if self._kernel is None or self._kernel[0] != device:
            self._kernel = (device, int8_kernel_usable(device, self.in_features))
        return self._kernel[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            raise ConfigurationError(
                f"Int8WeightOnlyLinear({self.extra_repr()}) got {x.dtype} input. Its caller probably cast the "
                "activations to `weight.dtype`, which is int8 for a quantized layer, and lost them; leave this "
                "module out of the quantizer's targets (exclude=[path]) or cast to the activation dtype instead."
            )
        flat = x.reshape(-1, self.in_features)  # the kernel takes 2-D input, contiguous in its last dim
        bias = None if self.bias is None else self.bias.to(x.dtype)
        # Compiled code takes the dequantize + matmul path: the kernel's alignment preconditions
        # need real addresses (data_ptr), which a traced (fake) tensor does not have.
        if self._decide() and not torch.compiler.is_compiling():
            out = self._kernel_forward(flat).to(x.dtype)
            if bias is not None:
                out = out + bias
        else:
            w = self.weight.to(x.dtype) * self.weight_scale.to(x.dtype)[:, None]
            out = F.linear(flat, w, bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _kernel_forward(self, flat: torch.Tensor) -> torch.Tensor:
        """``aten._weight_int8pack_mm`` with its preconditions checked or established first.

        The kernel checks few of them itself, and a violated one crashes the process instead of
        raising: a wrong dtype, shape or device is an error here, a layout is fixed by a copy.
        """
        weight, scale = self.weight, self.weight_scale
        n, k = self.out_features, self.in_features
        problem = None
        if weight.dtype != torch.int8 or tuple(weight.shape) != (n, k):
            problem = f"weight is {weight.dtype} {tuple(weight.shape)}, expected torch.int8 {(n, k)}"
        elif tuple(scale.shape) != (n,) or not scale.is_floating_point():
            problem = f"weight_scale is {scale.dtype} {tuple(scale.shape)}, expected a float ({n},)"
        elif weight.device != flat.device or scale.device != flat.device:
            problem = (
                f"the input is on {flat.device}, weight on {weight.device} and weight_scale on {scale.device}; "
                "move the module or the input so all three share a device"
            )
        if problem is not None:
            raise ConfigurationError(
                f"Int8WeightOnlyLinear({self.extra_repr()}): {problem}. The int8 kernel would read memory that "
                "is not there; assign tensors of the shapes and dtypes above (or load them with the quantizer)."
            )
        if not (weight.is_contiguous() and weight.data_ptr() % KERNEL_ALIGNMENT == 0):
            # Memory-mapped from a file whose header length leaves it off a 64-byte boundary: copy
            # it once into owned, aligned memory (same values; outside inference mode, so the
            # parameter stays an ordinary tensor that later loads can write into).
            with torch.inference_mode(False), torch.no_grad():
                weight.data = weight.detach().clone(memory_format=torch.contiguous_format)
        x = kernel_operand(flat.to(torch.bfloat16))
        return torch.ops.aten._weight_int8pack_mm(x, weight, kernel_operand(scale.to(torch.bfloat16)))

    def dequantized(self, *, meta: bool = False) -> dict[str, torch.Tensor]:
        """``{"weight": q * scale}`` in :attr:`float_dtype` (``meta=True``: its shape and dtype only)."""
        w: torch.Tensor = self.weight
        s: torch.Tensor = self.weight_scale
        if meta:
            w = torch.empty(tuple(w.shape), dtype=w.dtype, device="meta")
            s = torch.empty(tuple(s.shape), dtype=s.dtype, device="meta")
        return {"weight": (w.to(torch.float32) * s.to(torch.float32)[:, None]).to(self.float_dtype)}

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def _unsafe_linears(model: nn.Module) -> dict[str, str]:
    """``nn.Linear`` paths that cannot be swapped alone, with why: tied weights, MHA's out_proj."""
    owners: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(f"{path}.{name}" if path else name)
    parents = {f"{p}.{n}" if p else n: m for p, m in model.named_modules() for n, _ in m.named_children()}
    out: dict[str, str] = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        own = f"{path}.weight" if path else "weight"
        others = [k for k in owners.get(id(module.weight), []) if k != own]
        if others:
            out[path] = f"shares its weight with {others[0]!r}"
        elif isinstance(module, NonDynamicallyQuantizableLinear):
            out[path] = "is an nn.MultiheadAttention out_proj, whose weight its parent reads directly"
        elif isinstance(parents.get(path), (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
            out[path] = "belongs to an nn.Transformer layer, whose fast path reads its weight directly"
    return out


class Int8WeightOnlyQuantizer:
    """Swap ``nn.Linear`` modules for :class:`Int8WeightOnlyLinear` and quantize their weights at load.

    Args:
        targets: module-path patterns (dotted, ``*`` = one component, as in a ``tp_plan``);
            ``None`` (default) targets every ``nn.Linear``. Each pattern must match at least
            one ``nn.Linear``.
        exclude: patterns of modules to leave in float (e.g. ``["lm_head"]``).

    A checkpoint saved in the runtime layout (``original_format=False``) holds the int8 weights
    and scales; loading it again with this quantizer reads them as they are (no re-quantization).
    The original-layout export dequantizes, which is lossy.

    Example:
        >>> q = Int8WeightOnlyQuantizer(targets=["model.layers.*.mlp.*"])
        >>> report = surgery.load_checkpoint(model, "ckpt/", quantizer=q)  # doctest: +SKIP
    """

    method = "int8_weight_only"

    def __init__(self, *, targets: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> None:
        for name, value in (("targets", targets), ("exclude", exclude)):
            if value is None and name == "targets":
                continue
            if (
                isinstance(value, str)
                or not isinstance(value, (list, tuple))
                or not all(isinstance(p, str) for p in value)
            ):
                raise ConfigurationError(
                    f"{name}={bounded_repr(value)}: give a list of module-path patterns, e.g. ['lm_head']."
                )
        self.targets = None if targets is None else tuple(targets)
        self.exclude = tuple(exclude)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Int8WeightOnlyQuantizer:
        """Rebuild from :meth:`metadata`'s JSON (``{"quant_method": "int8_weight_only", ...}``)."""
        if not isinstance(config, Mapping):
            raise ConfigurationError(f"expected a quantization config dict, got {type(config).__name__}.")
        if config.get("quant_method") != cls.method:
            raise ConfigurationError(
                f"quant_method={bounded_repr(config.get('quant_method'))}, expected {cls.method!r}."
            )
        return cls(targets=config.get("targets"), exclude=config.get("exclude", ()))

    def __repr__(self) -> str:
        return f"Int8WeightOnlyQuantizer(targets={self.targets}, exclude={self.exclude})"

    def target_paths(self, model: nn.Module) -> list[str]:
        """The module paths :meth:`prepare` swaps (already swapped ones included).

        With ``targets=None`` every ``nn.Linear`` is a target except those whose weight other
        code reads directly, left in float: a linear whose weight is tied to another tensor
        (``lm_head`` sharing the embedding), ``nn.MultiheadAttention``'s ``out_proj``, and the
        linears of ``nn.TransformerEncoderLayer``/``DecoderLayer`` (their fast path).

        Raises:
            ConfigurationError: a pattern matches nothing, matches a module that is not an
                ``nn.Linear``, or names one of those.
        """
        kinds = (nn.Linear, Int8WeightOnlyLinear)
        unsafe = _unsafe_linears(model)
        if self.targets is None:
            paths = [p for p, m in model.named_modules() if isinstance(m, kinds) and p not in unsafe]
        else:
            paths = []
            for pattern in self.targets:
                found = match_modules(model, pattern)
                if not found:
                    raise ConfigurationError(
                        f"Int8WeightOnlyQuantizer: targets pattern {pattern!r} matches no module of "
                        f"{type(model).__name__}; patterns are dotted paths with '*' for one component."
                    )
                for path in found:
                    module = model.get_submodule(path)
                    if not isinstance(module, kinds):
                        raise ConfigurationError(
                            f"Int8WeightOnlyQuantizer: {path!r} (pattern {pattern!r}) is a "
                            f"{type(module).__name__}; only nn.Linear modules can be quantized."
                        )
                    if path in unsafe:
                        raise ConfigurationError(
                            f"Int8WeightOnlyQuantizer: {path!r} (pattern {pattern!r}) {unsafe[path]}, so it cannot "
                            f"be quantized on its own; add exclude=[{path!r}]."
                        )
                    paths.append(path)
        excluded: set[str] = set()
        for pattern in self.exclude:
            found = match_modules(model, pattern)
            if not found:
                raise ConfigurationError(
                    f"Int8WeightOnlyQuantizer: exclude pattern {pattern!r} matches no module of {type(model).__name__}."
                )
            excluded.update(found)
        return [p for p in dict.fromkeys(paths) if p not in excluded and p != ""]

    # ------------------------------------------------------------------ hooks
    def prepare(self, model: nn.Module) -> None:
        """Swap every target ``nn.Linear`` (an instance swap; on ``meta`` nothing is computed).

        The model remembers the quantizer, so a runtime-layout save persists its metadata even
        when the model was quantized outside a load.
        """
        for path in self.target_paths(model):
            module = model.get_submodule(path)
            if isinstance(module, nn.Linear):
                swap_module(model, path, Int8WeightOnlyLinear.from_linear(module))
        update_record(model, quantizer=self)

    def checks(self, key: str, info: StoredTensor) -> bool:
        """A runtime-layout ``X.weight_scale`` is read during planning and checked (:meth:`check`)."""
        return key.rpartition(".")[2] == "weight_scale"

    def check(self, key: str, tensor: torch.Tensor) -> None:
        """A stored per-channel scale is floating point, finite and not negative (0: an all-zero row).

        Raises:
            ConversionError: naming ``key``, the first bad row and its value.
        """
        if not tensor.is_floating_point():
            raise ConversionError(
                f"{key!r} is {tensor.dtype}; int8 weight scales are floats (float32 as written by a save)."
            )
        bad = first_bad_scale(tensor, zero_allowed=True, limit=torch.finfo(torch.float32).max)
        if bad is not None:
            index, value = bad
            raise ConversionError(
                f"{key!r}: the scale of row {index} is {value}; int8 per-channel scales are finite and not "
                "negative. The file is corrupt or was not written by Int8WeightOnlyQuantizer."
            )

    def quantizes(self, key: str, module: nn.Module) -> bool:
        return isinstance(module, Int8WeightOnlyLinear) and key.rpartition(".")[2] == "weight"

    def quantize(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = quantize_per_channel(tensor)
        return {key: q, key.removesuffix("weight") + "weight_scale": scale}

    def metadata(self) -> dict[str, str]:
        targets = None if self.targets is None else list(self.targets)
        return config_metadata(self.method, {"targets": targets, "exclude": list(self.exclude)})

    # ------------------------------------------------------------------ config.json
    loads_in_transformers = False
    """transformers has no method for this layout (int8 ``weight`` + float32 ``weight_scale`` per row)."""

    def quantization_config(self) -> dict[str, Any]:
        """The ``quantization_config`` of a runtime-layout save: this method and its options.

        transformers does not know ``int8_weight_only`` (it would skip it with a warning), so a
        save that writes it also makes transformers refuse the checkpoint (``transformers_weights``).

        Example:
            >>> Int8WeightOnlyQuantizer(exclude=["lm_head"]).quantization_config()
            {'quant_method': 'int8_weight_only', 'targets': None, 'exclude': ['lm_head']}
        """
        targets = None if self.targets is None else list(self.targets)
        return {"quant_method": self.method, "targets": targets, "exclude": list(self.exclude)}
