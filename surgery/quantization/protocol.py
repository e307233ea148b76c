"""The quantizer protocol and the checked calls the load and save paths make through it.

A quantizer is any object; the loader looks up each hook by name and uses the ones it finds
(every hook is optional, except where a quantizer needs it):

* ``prepare(model)``: swap the targeted modules for their quantized counterparts, per instance,
  right after fusions and before anything is resolved (a failed load puts the originals back).
* ``update_weight_conversions(transforms[, model]) -> list``: rewrite the resolved transform list.
* ``get_weight_conversions() -> list``: converters appended to it, for a format whose
  deserialization is a genuine N:1 conversion (several stored tensors make one runtime tensor);
  neither built-in quantizer needs it (FP8 decodes per source, the int8 layout loads 1:1).
* ``companions(key, info) -> tuple[str, ...]`` and ``decode(key, tensor, companions, region=None)``:
  the checkpoint is quantized on disk. ``companions`` names the keys stored next to ``key`` that
  decoding needs (``X.weight_scale_inv``); they are taken out of routing and read with ``key``.
  ``decode`` turns the stored values into floats **per source tensor, before the op chain**, so
  plain weights, expert merges and tensor-parallel slices all decode the same way. ``region``
  is the part of ``key`` that was read (a :class:`~surgery.parallel.regions.Region`), ``None`` for all.
  Decoding keeps the stored shape, except for a quantizer that defines ``stored_region``.
* ``stored_region(key, region, info) -> Region``: for a format whose decoded tensor has another
  shape than the stored one (values packed several to a word: compressed-tensors
  ``weight_packed``), the part of the stored ``key`` that holds ``region`` of the decoded values;
  a tensor-parallel rank reads only that (on another dim where decoding transposes: gpt-oss MXFP4
  blocks). Its ``decode`` may change the shape; planning learns
  the decoded shape from a ``meta`` run, with the values of small companions (at most
  :data:`SMALL_COMPANION_BYTES`: a stored ``weight_shape``) read.
* ``companion_of(key) -> str | None``: the key ``key`` would be a companion of (``X.weight`` for
  ``X.weight_scale_inv``). A key that names an owner but that no stored-quantized owner claims
  (the owner is absent, or stored in float) is an error naming it, never an unexpected key that
  a model with such a parameter would silently load.
* ``keeps_packed(key) -> bool``: ``key`` is stored quantized but loads 1:1 into a module that holds
  it packed (:class:`~surgery.quantization.packed.KeepPacked`): not decoded, and no error for
  loading stored codes without their scales.
* ``checks(key, info) -> bool`` and ``check(key, tensor)``: values a file controls that the
  headers cannot vouch for (NaN or negative scales). Planning reads every checkpoint tensor
  ``checks`` names (small ones: scales), after its shape was checked, and ``check`` raises a
  :class:`~surgery.ConversionError` naming the key when its values cannot be right; the entry
  that needs it then fails before any tensor is set. What planning read is reused, not read again.
* ``companion_region(key, companion, region, info) -> Region | None``: under tensor or expert
  parallelism, the part of the stored ``companion`` that covers ``region`` of ``key``'s decoded
  values (``info``: ``key`` as stored); ``None`` reads it whole (per-tensor scalars replicate).
  A rank then reads, checks and decodes with only those rows or blocks, placed at their offsets
  in a companion of its full shape; the rest of it is read from the checkpoint only if a save
  needs it.
* ``quantizes(key, module) -> bool`` and ``quantize(key, tensor) -> dict[str, Tensor]``:
  quantize on the fly, **after the op chain**; the result may name more runtime keys than the
  one it was given (``X.weight`` → ``X.weight``, ``X.weight_scale``).
* ``metadata() -> dict[str, str]``: persisted with a runtime-layout save of a quantized model.
* ``quantization_config() -> dict``: the ``config.json`` ``quantization_config`` describing the
  quantized tensors a save writes through this quantizer (``encode``'s, or a runtime layout's),
  ``quant_method`` included. A quantizer whose config transformers decodes as it is also sets
  ``loads_in_transformers = True``; otherwise a save makes transformers refuse the checkpoint
  instead of reading quantized values as floats (:mod:`surgery.saved_config`).
* ``encode(key, tensor, recorded) -> dict[str, Tensor]``: re-encode an original-layout tensor
  for a save, given the companion tensors recorded when it was loaded.
* ``dequantized_name(key) -> str``: the name a ``quantization="dequantized"`` save writes the
  floats of the stored ``key`` under, for a format whose stored name is not the float one
  (``X.weight_packed`` → ``X.weight``, gpt-oss ``X_blocks`` → ``X``); ``key`` itself without it.

Every hook except ``check`` is called on ``meta`` tensors during planning (nothing is read yet),
so shapes, dtypes and key names are checked before a byte of weight data moves; the built-in
quantizers answer ``meta`` inputs with empty ``meta`` tensors. A hook that returns the wrong type, or
raises something other than a :class:`~surgery.SurgeryError`, is reported naming the method.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from ..checkpoint import StoredTensor
from ..errors import ConfigurationError, ConversionError, SurgeryError
from ..parallel.regions import Region
from ..record import update_record
from ..transforms import WeightTransform

__all__ = [
    "QUANTIZATION_METADATA_KEY",
    "SMALL_COMPANION_BYTES",
    "QuantizedModule",
    "Quantizer",
    "QuantizerHooks",
    "bounded_repr",
    "config_metadata",
    "first_bad_scale",
]

QUANTIZATION_METADATA_KEY = "surgery.quantization"
"""Safetensors metadata key of a quantized runtime-layout save: JSON with ``quant_method``."""

SMALL_COMPANION_BYTES = 64
"""Companions up to this size are read for planning's ``meta`` run of ``decode`` (shape vectors, scalars)."""


class Quantizer(Protocol):
    """What the load and save paths call on a quantizer (see the module docstring).

    Implement only the methods the format needs; the loader checks what it finds. Since a
    static type cannot say "any subset of these methods", ``load_checkpoint(quantizer=...)`` is
    typed ``object``; this protocol documents the full set.
    """

    def prepare(self, model: nn.Module) -> None: ...

    def get_weight_conversions(self) -> list[WeightTransform]: ...

    def companions(self, key: str, info: StoredTensor) -> tuple[str, ...]: ...

    def companion_of(self, key: str) -> str | None: ...

    def checks(self, key: str, info: StoredTensor) -> bool: ...

    def check(self, key: str, tensor: torch.Tensor) -> None: ...

    def decode(
        self,
        key: str,
        tensor: torch.Tensor,
        companions: dict[str, torch.Tensor],
        region: Region | None = None,
    ) -> torch.Tensor: ...

    def quantizes(self, key: str, module: nn.Module) -> bool: ...

    def quantize(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def metadata(self) -> dict[str, str]: ...

    def quantization_config(self) -> dict[str, Any]: ...

    def encode(
        self, key: str, tensor: torch.Tensor, recorded: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]: ...


class QuantizedModule(Protocol):
    """A module holding quantized tensors that an original-layout save turns back into floats.

    ``dequantized()`` returns the module's float tensors by local name (``{"weight": ...}``);
    ``quantized_names`` are the local names it replaces (``("weight", "weight_scale")``). With
    ``meta=True`` it returns ``meta`` tensors of the same shapes and dtypes, computing nothing.
    """

    quantized_names: tuple[str, ...]

    def dequantized(self, *, meta: bool = False) -> dict[str, torch.Tensor]: ...


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 6, 6, 6
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 80, 80, 40


def first_bad_scale(
    scale: torch.Tensor, *, zero_allowed: bool, limit: float
) -> tuple[tuple[int, ...], float] | None:
    """The index and value of the first element of ``scale`` outside ``(0, limit]`` (``[0, limit]``
    with ``zero_allowed``), or ``None``: a stored scale checked for values a file made unusable.

    NaN is outside every range. One ``aminmax`` pass when every value is good; the search for the
    first bad one only when there is one.

    Example:
        >>> first_bad_scale(torch.tensor([[1.0, 2.0], [float("nan"), 0.5]]), zero_allowed=False, limit=1e3)
        ((1, 0), nan)
    """
    s = scale if scale.dtype == torch.float32 else scale.to(torch.float32)
    if s.numel() == 0:
        return None
    lo, hi = torch.aminmax(s)  # NaN propagates and fails both comparisons
    low_ok = float(lo) >= 0 if zero_allowed else float(lo) > 0
    if low_ok and float(hi) <= limit:
        return None
    good = ((s >= 0) if zero_allowed else (s > 0)) & (s <= limit)
    index = tuple(int(i) for i in (~good).nonzero()[0])
    return index, float(s[index])


def bounded_repr(value: object) -> str:
    """``repr(value)`` cut to a readable size.

    A value a file controls (nested 10,000 deep, 1 MB long) must neither blow up nor bury the
    error message that quotes it.
    """
    return _REPR.repr(value)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


class QuantizerHooks:
    """A quantizer's hooks, looked up once and called with their results checked.

    Args:
        quantizer: any object implementing part of :class:`Quantizer`.

    Raises:
        ConfigurationError: an attribute named like a hook is not callable.
    """

    _HOOKS = (
        "prepare",
        "get_weight_conversions",
        "companions",
        "companion_of",
        "checks",
        "check",
        "decode",
        "keeps_packed",
        "stored_region",
        "companion_region",
        "quantizes",
        "quantize",
        "metadata",
        "quantization_config",
        "encode",
        "dequantized_name",
    )

    def __init__(self, quantizer: object) -> None:
        self.quantizer = quantizer
        self.name = type(quantizer).__name__
        self._hooks: dict[str, Callable[..., Any]] = {}
        for hook in self._HOOKS:
            fn = getattr(quantizer, hook, None)
            if fn is None:
                continue
            if not callable(fn):
                raise ConfigurationError(
                    f"{self.name}.{hook} is {fn!r}, not a method; define it as a method."
                )
            self._hooks[hook] = fn
        if ("companions" in self._hooks) != ("decode" in self._hooks):
            raise ConfigurationError(
                f"{self.name} defines only one of companions/decode; a checkpoint quantized on disk needs both."
            )
        if ("checks" in self._hooks) != ("check" in self._hooks):
            raise ConfigurationError(
                f"{self.name} defines only one of checks/check; checking stored values needs both."
            )
        if ("quantizes" in self._hooks) != ("quantize" in self._hooks):
            raise ConfigurationError(
                f"{self.name} defines only one of quantizes/quantize; quantizing on the fly needs both."
            )

    @property
    def decodes(self) -> bool:
        return "decode" in self._hooks

    @property
    def reshapes(self) -> bool:
        """Whether decoding may change a tensor's shape (the quantizer maps regions: ``stored_region``)."""
        return "stored_region" in self._hooks

    def stored_region(self, key: str, region: Region, info: StoredTensor) -> Region:
        """The part of the stored ``key`` holding ``region`` of its decoded values (``region`` itself by default)."""
        if "stored_region" not in self._hooks:
            return region
        result = self._call("stored_region", key, key, region, info)
        if not isinstance(result, Region) or not -len(info.shape) <= result.dim < max(len(info.shape), 1):
            raise ConfigurationError(
                f"{self.name}.stored_region({key!r}) returned {bounded_repr(result)}; return a Region of a dim of "
                f"the stored {tuple(info.shape)} tensor."
            )
        return result

    def companion_region(self, key: str, companion: str, region: Region, info: StoredTensor) -> Region | None:
        """The part of ``companion`` covering ``region`` of ``key``'s decoded values (``None``: all of it)."""
        if "companion_region" not in self._hooks:
            return None
        result = self._call("companion_region", key, key, companion, region, info)
        if result is not None and not isinstance(result, Region):
            raise ConfigurationError(
                f"{self.name}.companion_region({key!r}, {companion!r}) returned {bounded_repr(result)}; return a "
                "Region of the companion, or None to read it whole."
            )
        return result

    @property
    def quantizes_on_the_fly(self) -> bool:
        return "quantize" in self._hooks

    def has(self, hook: str) -> bool:
        return hook in self._hooks

    def _call(self, hook: str, key: str, *args: Any) -> Any:
        try:
            return self._hooks[hook](*args)
        except SurgeryError:
            raise
        except Exception as exc:
            raise ConversionError(f"{self.name}.{hook}({key!r}) failed: {type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------ model
    def prepare(self, model: nn.Module) -> None:
        if "prepare" in self._hooks:
            result = self._call("prepare", type(model).__name__, model)
            update_record(model, quantizer=self.quantizer)
            if result is not None and result is not model:
                raise ConfigurationError(
                    f"{self.name}.prepare returned {type(result).__name__}; it must change the model in place "
                    "and return None."
                )

    def weight_conversions(self) -> list[WeightTransform]:
        """``get_weight_conversions()``, checked (``[]`` without the hook)."""
        if "get_weight_conversions" not in self._hooks:
            return []
        result = self._call("get_weight_conversions", "")
        if not isinstance(result, (list, tuple)) or not all(isinstance(t, WeightTransform) for t in result):
            raise ConfigurationError(
                f"{self.name}.get_weight_conversions() returned {result!r}; return a list of WeightTransform."
            )
        return list(result)

    # ------------------------------------------------------------------ quantized on disk
    def companions(self, key: str, info: StoredTensor) -> tuple[str, ...]:
        if "companions" not in self._hooks:
            return ()
        result = self._call("companions", key, key, info)
        if isinstance(result, str) or not isinstance(result, (tuple, list)):
            raise ConfigurationError(
                f"{self.name}.companions({key!r}) returned {result!r}; return a tuple of checkpoint keys."
            )
        if not all(isinstance(k, str) and k != key for k in result):
            raise ConfigurationError(
                f"{self.name}.companions({key!r}) returned {result!r}; every companion is another checkpoint key."
            )
        return tuple(result)

    def companion_of(self, key: str) -> str | None:
        """The key ``key`` is a companion of, by its name alone (``None``: not a companion)."""
        if "companion_of" not in self._hooks:
            return None
        result = self._call("companion_of", key, key)
        if result is not None and (not isinstance(result, str) or result == key):
            raise ConfigurationError(
                f"{self.name}.companion_of({key!r}) returned {bounded_repr(result)}; return another checkpoint "
                "key or None."
            )
        return result

    def checks(self, key: str, info: StoredTensor) -> bool:
        return self._predicate("checks", key, info)

    def keeps_packed(self, key: str) -> bool:
        """Whether ``key`` loads as stored into a module holding it packed (``False`` without the hook)."""
        if "keeps_packed" not in self._hooks:
            return False
        result = self._call("keeps_packed", key, key)
        if not isinstance(result, bool):
            raise ConfigurationError(
                f"{self.name}.keeps_packed({key!r}) returned {bounded_repr(result)}, not True or False."
            )
        return result

    def check(self, key: str, tensor: torch.Tensor) -> None:
        """``check(key, tensor)``: raises a :class:`ConversionError` naming ``key`` if the values are unusable."""
        result = self._call("check", key, key, tensor)
        if result is not None:
            raise ConfigurationError(
                f"{self.name}.check({key!r}) returned {bounded_repr(result)}; it returns None and raises a "
                "ConversionError naming the key when the values are unusable."
            )

    def decode(
        self,
        key: str,
        tensor: torch.Tensor,
        companions: dict[str, torch.Tensor],
        region: Region | None = None,
    ) -> torch.Tensor:
        result = self._call("decode", key, key, tensor, companions, region)
        if not isinstance(result, torch.Tensor):
            raise ConfigurationError(
                f"{self.name}.decode({key!r}) returned {type(result).__name__}, not a Tensor."
            )
        if tuple(result.shape) != tuple(tensor.shape) and not self.reshapes:
            raise ConversionError(
                f"{self.name}.decode({key!r}) turned shape {tuple(tensor.shape)} into {tuple(result.shape)}; "
                "decoding keeps the stored shape."
            )
        if not result.is_floating_point():
            raise ConversionError(
                f"{self.name}.decode({key!r}) returned {result.dtype}; decoding yields floats."
            )
        return result

    def decode_meta(
        self,
        key: str,
        info: StoredTensor,
        companions: Mapping[str, StoredTensor],
        values: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run ``decode`` on ``meta`` tensors of the stored shapes (``values``: companions read): checks
        it, returns the decoded ``meta`` tensor (its shape and dtype)."""
        metas = {k: torch.empty(i.shape, dtype=i.dtype, device="meta") for k, i in companions.items()}
        metas.update(values or {})
        return self.decode(key, torch.empty(info.shape, dtype=info.dtype, device="meta"), metas)

    def encode(
        self, key: str, tensor: torch.Tensor, recorded: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        if "encode" not in self._hooks:
            raise ConfigurationError(
                f"{self.name} has no encode method, so {key!r} cannot be written quantized as loaded; save with "
                "quantization='dequantized' to write floats."
            )
        return self._tensors("encode", key, self._call("encode", key, key, tensor, recorded))

    def dequantized_name(self, key: str) -> str:
        """The name the floats of the stored ``key`` are written under by a dequantized save."""
        if "dequantized_name" not in self._hooks:
            return key
        result = self._call("dequantized_name", key, key)
        if not isinstance(result, str) or not result:
            raise ConfigurationError(
                f"{self.name}.dequantized_name({key!r}) returned {bounded_repr(result)}; return a checkpoint key."
            )
        return result

    # ------------------------------------------------------------------ quantized on the fly
    def quantizes(self, key: str, module: nn.Module) -> bool:
        return self._predicate("quantizes", key, module)

    def quantize(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._tensors("quantize", key, self._call("quantize", key, key, tensor))

    def quantize_meta(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``quantize`` on a ``meta`` tensor: the runtime keys, shapes and dtypes it will produce."""
        return {
            k: _meta(t) for k, t in self.quantize(key, torch.empty(shape, dtype=dtype, device="meta")).items()
        }

    def _predicate(self, hook: str, key: str, arg: Any) -> bool:
        """An optional yes/no hook (absent: no), checked to answer a bool."""
        if hook not in self._hooks:
            return False
        result = self._call(hook, key, key, arg)
        if not isinstance(result, bool):
            raise ConfigurationError(
                f"{self.name}.{hook}({key!r}) returned {bounded_repr(result)}, not True or False."
            )
        return result

    def _tensors(self, hook: str, key: str, result: Any) -> dict[str, torch.Tensor]:
        if not isinstance(result, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in result.items()
        ):
            raise ConfigurationError(
                f"{self.name}.{hook}({key!r}) returned {type(result).__name__}; return a dict of key -> Tensor."
            )
        if key not in result:
            raise ConfigurationError(
                f"{self.name}.{hook}({key!r}) returned {sorted(result)}, without {key!r} itself."
            )
        return result

    # ------------------------------------------------------------------ persisted
    def metadata(self) -> dict[str, str]:
        if "metadata" not in self._hooks:
            return {}
        result = self._call("metadata", "")
        if not isinstance(result, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in result.items()
        ):
            raise ConfigurationError(
                f"{self.name}.metadata() returned {result!r}; return a dict of str -> str."
            )
        return result

    # ------------------------------------------------------------------ config.json
    @property
    def loads_in_transformers(self) -> bool:
        """Whether transformers decodes what this quantizer writes, given :meth:`quantization_config`."""
        return getattr(self.quantizer, "loads_in_transformers", False) is True

    def quantization_config(self) -> dict[str, Any]:
        """The ``quantization_config`` of what this quantizer writes, checked.

        Without the hook: the ``quant_method`` of :meth:`metadata` (a built-in's persisted
        config), else the quantizer's class name, so the config still says the tensors are
        quantized and by what.

        Raises:
            ConfigurationError: the hook returned something other than a JSON object with a
                string ``quant_method``.
        """
        if "quantization_config" in self._hooks:
            result = self._call("quantization_config", "")
        else:
            raw = self.metadata().get(QUANTIZATION_METADATA_KEY)
            try:
                result = json.loads(raw) if raw is not None else None
            except (ValueError, RecursionError):
                result = None
            if not isinstance(result, dict) or not isinstance(result.get("quant_method"), str):
                result = {"quant_method": self.name}
        if not isinstance(result, dict) or not isinstance(result.get("quant_method"), str):
            raise ConfigurationError(
                f"{self.name}.quantization_config() returned {result!r}; return a dict with a string "
                "'quant_method', e.g. {'quant_method': 'fp8', 'weight_block_size': [128, 128]}."
            )
        try:
            json.dumps(result)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"{self.name}.quantization_config() returned {result!r}, which is not JSON ({exc}); use "
                "str, int, float, bool, None, lists and dicts."
            ) from None
        return result


def config_metadata(method: str, config: Mapping[str, Any]) -> dict[str, str]:
    """The metadata a built-in quantizer persists: ``{QUANTIZATION_METADATA_KEY: json}``."""
    return {QUANTIZATION_METADATA_KEY: json.dumps({"quant_method": method, **config}, sort_keys=True)}
