"""A quantizer chosen from a checkpoint: by name (``--quantization fp8|int8|auto``) or from its ``quantization_config``.

Every quantizer that decodes a checkpoint format registers itself here under the
``quant_method`` transformers writes in ``config.json`` (:func:`register_format`), and
:func:`quantizer_from_config` is the one entry point that picks it: a ``quantization_config``
names its method, and for methods that hold several formats (``compressed-tensors``: a
``format`` at the top and one per config group) the formats it uses pick among the
registrations of that method.

* ``fp8``: :class:`~surgery.quantization.FP8BlockQuantizer` from the checkpoint's
  ``quantization_config`` (block size, format), or the DeepSeek-V3 defaults where it has none.
* ``int8``: :class:`~surgery.quantization.Int8WeightOnlyQuantizer`, every linear quantized on the fly.
* ``auto``: whatever the checkpoint's ``quantization_config`` says (:func:`quantizer_from_config`),
  and no quantizer when there is none.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError, RegistryError
from ..persist import checkpoint_config
from .fp8 import FP8BlockQuantizer
from .int8 import Int8WeightOnlyQuantizer
from .protocol import bounded_repr

__all__ = [
    "QUANTIZATION_CHOICES",
    "QuantizerFactory",
    "checkpoint_config",
    "config_formats",
    "quantizer_by_name",
    "quantizer_from_config",
    "register_format",
    "registered_formats",
]

QUANTIZATION_CHOICES = ("fp8", "int8", "auto")
"""The names :func:`quantizer_by_name` takes."""

QuantizerFactory = Callable[[Mapping[str, Any]], object]
"""Builds a quantizer from a ``quantization_config`` dict (raises :class:`ConfigurationError` on a bad one)."""


@dataclass(frozen=True)
class _Registration:
    factory: QuantizerFactory
    formats: tuple[str, ...]  # empty: every config of the method


_REGISTRY: dict[str, list[_Registration]] = {}


def register_format(quant_method: str, factory: QuantizerFactory, *, formats: tuple[str, ...] = ()) -> None:
    """Make :func:`quantizer_from_config` build ``factory(config)`` for configs of ``quant_method``.

    Args:
        quant_method: the ``quant_method`` of the configs (``"fp8"``, ``"compressed-tensors"``).
        factory: the quantizer's ``from_config`` (or any callable taking the config dict).
        formats: for a method whose configs name formats (``compressed-tensors``: ``format`` at
            the top and in each config group), the formats this factory reads; a config is
            given to the registration whose formats hold every format it names. Empty: all of
            the method's configs.

    Raises:
        RegistryError: ``quant_method`` or a format is not a non-empty string, ``factory`` is not
            callable, or another registration of the method already claims one of ``formats``
            (or the whole method).

    Example:
        >>> register_format("fp8", FP8BlockQuantizer.from_config)  # doctest: +SKIP
    """
    if not isinstance(quant_method, str) or not quant_method:
        raise RegistryError(
            f"quant_method={bounded_repr(quant_method)}; give a non-empty string such as 'fp8'."
        )
    if not callable(factory):
        raise RegistryError(
            f"register_format({quant_method!r}): factory {bounded_repr(factory)} is not callable."
        )
    if not isinstance(formats, tuple) or not all(isinstance(f, str) and f for f in formats):
        raise RegistryError(
            f"register_format({quant_method!r}): formats={bounded_repr(formats)}; give a tuple of format names."
        )
    for other in _REGISTRY.get(quant_method, []):
        clash = set(other.formats) & set(formats) if other.formats and formats else {"(every format)"}
        if clash:
            raise RegistryError(
                f"quant_method {quant_method!r} format(s) {sorted(clash)} are already registered "
                f"(to {bounded_repr(other.factory)}); one quantizer reads a format."
            )
    _REGISTRY.setdefault(quant_method, []).append(_Registration(factory, formats))


def registered_formats() -> dict[str, tuple[str, ...]]:
    """Every registered ``quant_method`` with the formats registered for it (``()``: all of them)."""
    return {m: tuple(f for r in regs for f in r.formats) for m, regs in sorted(_REGISTRY.items())}


def config_formats(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The formats a ``quantization_config`` names: its ``format`` and each config group's, sorted.

    Example:
        >>> config_formats({"format": "pack-quantized", "config_groups": {"g": {"format": "float-quantized"}}})
        ('float-quantized', 'pack-quantized')
    """
    found: set[str] = set()
    top = config.get("format")
    if isinstance(top, str):
        found.add(top)
    groups = config.get("config_groups")
    if isinstance(groups, Mapping):
        for group in groups.values():
            if isinstance(group, Mapping) and isinstance(group.get("format"), str):
                found.add(group["format"])
    return tuple(sorted(found))


def quantizer_from_config(config: Mapping[str, Any], *, source: str = "quantization_config") -> object:
    """The quantizer that decodes checkpoints described by ``config`` (a ``quantization_config``).

    ``config`` may also be a whole ``config.json`` dict holding a ``quantization_config``.

    Raises:
        ConfigurationError: ``config`` is not a dict, has no string ``quant_method``, names a
            method or formats no registered quantizer reads (the message lists those that are),
            or the quantizer refuses its fields.

    Example:
        >>> quantizer_from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
        FP8BlockQuantizer(block_size=(128, 128), weight_format=torch.float8_e4m3fn)
    """
    if not isinstance(config, Mapping):
        raise ConfigurationError(f"{source} is {bounded_repr(config)}, not a dict.")
    inner = config.get("quantization_config")
    if "quant_method" not in config and isinstance(inner, Mapping):
        config = inner
    method = config.get("quant_method")
    if not isinstance(method, str):
        raise ConfigurationError(
            f"{source}.quant_method={bounded_repr(method)}; a quantization_config names its method "
            f"({', '.join(sorted(_REGISTRY))})."
        )
    registrations = _REGISTRY.get(method)
    if not registrations:
        raise ConfigurationError(
            f"{source}.quant_method={method!r}, which no registered quantizer reads "
            f"({', '.join(sorted(_REGISTRY))}); pass a quantizer from Python (load_checkpoint(quantizer=...)) "
            "or register one with surgery.quantization.register_format."
        )
    formats = set(config_formats(config))
    for r in registrations:
        if not r.formats or (formats and formats <= set(r.formats)):
            return r.factory(config)
    known = sorted(f for r in registrations for f in r.formats)
    raise ConfigurationError(
        f"{source} ({method!r}) names the format(s) {sorted(formats) or '(none)'}; the registered quantizers "
        f"of {method!r} read {known}, each config with formats of one of them."
    )


def quantizer_by_name(name: str, checkpoint: str | os.PathLike[str]) -> Any | None:
    """The quantizer ``name`` (one of :data:`QUANTIZATION_CHOICES`) stands for, for ``checkpoint``.

    Raises:
        ConfigurationError: an unknown name; ``auto`` or ``fp8`` over a ``quantization_config``
            no registered quantizer reads (the message names its ``quant_method``).

    Example:
        >>> quantizer_by_name("int8", ".")
        Int8WeightOnlyQuantizer(targets=None, exclude=())
    """
    if name not in QUANTIZATION_CHOICES:
        raise ConfigurationError(f"quantization {name!r}; valid: {', '.join(QUANTIZATION_CHOICES)}.")
    if name == "int8":
        return Int8WeightOnlyQuantizer()
    path, config = checkpoint_config(checkpoint)
    quantization = (config or {}).get("quantization_config")
    if name == "fp8":
        return (
            FP8BlockQuantizer.from_config(quantization) if quantization is not None else FP8BlockQuantizer()
        )
    if quantization is None:
        return None  # auto over a float checkpoint: nothing to decode
    return quantizer_from_config(quantization, source=f"{path}: quantization_config")
