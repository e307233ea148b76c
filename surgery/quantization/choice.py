"""A quantizer chosen by name (``--quantization fp8|int8|auto``), read from a checkpoint's ``config.json``.

* ``fp8``: :class:`~surgery.quantization.FP8BlockQuantizer` from the checkpoint's
  ``quantization_config`` (block size, format), or the DeepSeek-V3 defaults where it has none.
* ``int8``: :class:`~surgery.quantization.Int8WeightOnlyQuantizer`, every linear quantized on the fly.
* ``auto``: whatever the checkpoint's ``quantization_config`` says (``fp8`` or ``int8_weight_only``),
  and no quantizer when there is none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from .fp8 import FP8BlockQuantizer
from .int8 import Int8WeightOnlyQuantizer

__all__ = ["QUANTIZATION_CHOICES", "checkpoint_config", "quantizer_by_name"]

QUANTIZATION_CHOICES = ("fp8", "int8", "auto")
"""The names :func:`quantizer_by_name` takes."""


def checkpoint_config(checkpoint: str | os.PathLike[str]) -> tuple[Path, dict[str, Any] | None]:
    """The ``config.json`` beside a checkpoint (a directory, a ``.safetensors`` file or an index), parsed.

    Returns:
        Its path, and its contents (``None`` when there is no such file).

    Raises:
        ConfigurationError: the file exists but is not a JSON object.
    """
    path = Path(checkpoint)
    path = (path if path.is_dir() else path.parent) / "config.json"
    if not path.is_file():
        return path, None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigurationError(
            f"{path}: cannot read it as JSON ({type(exc).__name__}: {str(exc)[:200]})."
        ) from None
    if not isinstance(data, dict):
        raise ConfigurationError(f"{path} holds a {type(data).__name__}, not a JSON object.")
    return path, data


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
    raise ConfigurationError(
        f"{path}: quantization_config.quant_method={method!r}, which no built-in quantizer reads (fp8, "
        f"{Int8WeightOnlyQuantizer.method}); pass a quantizer from Python (load_checkpoint(quantizer=...))."
    )
