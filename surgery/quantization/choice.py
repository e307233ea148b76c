"""A quantizer chosen by name (``--quantization fp8|int8|auto``), read from a checkpoint's ``config.json``.

* ``fp8``: :class:`~surgery.quantization.FP8BlockQuantizer` from the checkpoint's
  ``quantization_config`` (block size, format), or the DeepSeek-V3 defaults where it has none.
* ``int8``: :class:`~surgery.quantization.Int8WeightOnlyQuantizer`, every linear quantized on the fly.
* ``auto``: whatever the checkpoint's ``quantization_config`` says (``fp8``, ``int8_weight_only``,
  ``gptq``, ``awq``),
  and no quantizer when there is none.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigurationError
from ..persist import checkpoint_config
from .awq import AWQQuantizer
from .fp8 import FP8BlockQuantizer
from .gptq import GPTQQuantizer
from .int8 import Int8WeightOnlyQuantizer

__all__ = ["QUANTIZATION_CHOICES", "checkpoint_config", "quantizer_by_name"]

QUANTIZATION_CHOICES = ("fp8", "int8", "auto")
"""The names :func:`quantizer_by_name` takes."""


def quantizer_by_name(name: str, checkpoint: str | os.PathLike[str]) -> Any | None:
    """The quantizer ``name`` (one of :data:`QUANTIZATION_CHOICES`) stands for, for ``checkpoint``.

    Raises:
        ConfigurationError: an unknown name; ``auto`` or ``fp8`` over a ``quantization_config``
            no built-in quantizer reads (the message names its ``quant_method``).

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
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method == "fp8":
        return FP8BlockQuantizer.from_config(quantization)
    if method == Int8WeightOnlyQuantizer.method:
        return Int8WeightOnlyQuantizer.from_config(quantization)
    if method in (GPTQQuantizer.method, AWQQuantizer.method):  # until the format registry (issue 29)
        return (GPTQQuantizer if method == GPTQQuantizer.method else AWQQuantizer).from_config(quantization)
    raise ConfigurationError(
        f"{path}: quantization_config.quant_method={method!r}, which no built-in quantizer reads (fp8, gptq, awq, "
        f"{Int8WeightOnlyQuantizer.method}); pass a quantizer from Python (load_checkpoint(quantizer=...))."
    )
