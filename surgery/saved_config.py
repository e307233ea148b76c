"""The ``config.json`` of a saved checkpoint: what it tells transformers about the tensors written.

A save copies the source checkpoint's ``config.json`` (see :func:`surgery.save_checkpoint`) and then
makes the three fields transformers (5.x) reads to interpret tensors describe what was written:

* ``fusion_config``: fusions transformers applies before loading. Only fusions transformers
  performs itself, with the same runtime layout, are written there, under transformers' name
  (:attr:`~surgery.fusion.FusionSpec.transformers_name`, e.g. ``patch_embeddings``). Ours are
  persisted in the safetensors metadata, which transformers does not read; a checkpoint saved
  before this, with ``gate_up`` in its ``config.json``, still loads (the loader reads both).
* ``quantization_config``: how stored values decode. It describes the quantized tensors the save
  wrote (FP8 re-encoded with the scales recorded at load, int8 codes of a runtime layout), and is
  removed when it wrote floats (``quantization="dequantized"``, a runtime layout of a model that
  was only decoded at load).
* ``transformers_weights``: the file transformers loads. Where transformers cannot read the
  layout as written (a fusion it does not perform, a quantization method it does not decode),
  this holds a sentence saying so, which transformers quotes when it refuses the directory.
  transformers 5.23 otherwise loads such a checkpoint *silently wrong*: an unknown
  ``quant_method`` is skipped with a warning (int8 codes read as float weights) and a fused
  runtime key is "unexpected" while the unfused weights it replaced stay randomly initialized.
  A ``transformers_weights`` value that is not a ``.safetensors`` name is the one field it
  refuses with a message of ours (``ValueError: The transformers file in the config seems to be
  incorrect: ... : <our sentence>``).

:func:`rewrite_config` is the pure rule (a dict in, a dict out); :func:`write_config_json`
applies it to a file, atomically, and leaves a file that is not a JSON object alone.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint import write_file_atomically
from .fusion import find_fusion

__all__ = [
    "TRANSFORMERS_REFUSAL",
    "SavedConfig",
    "rewrite_config",
    "saved_config",
    "write_config_json",
]

TRANSFORMERS_REFUSAL = "not loadable by transformers"
"""How the ``transformers_weights`` sentence of a layout transformers cannot read begins."""


@dataclass(frozen=True)
class SavedConfig:
    """What a save's ``config.json`` must say about the tensors it wrote.

    Attributes:
        fusion_config: the fusions of the written layout that transformers performs, by its
            names (``None``: no ``fusion_config``).
        quantization_config: the quantization of the tensors written, ``quant_method``
            included (``None``: only floats were written, so there is none).
        unquantized_modules: module paths whose weights were written unquantized, for a
            ``quantization_config`` written where the source config had none of that method
            (``modules_to_not_convert``); ``None`` when not needed.
        unreadable: why transformers cannot load the layout as written (empty: it can).
        fix: the ``save_checkpoint`` option that writes what transformers reads instead.
        dtype: the dtype most floating values were written in (``"bfloat16"``), for the
            config's ``dtype``/``torch_dtype``; ``None`` leaves them as they are.
        dtype_requested: the save was asked for ``dtype``: a config with neither field gets ``dtype``.
    """

    fusion_config: dict[str, Any] | None = None
    quantization_config: dict[str, Any] | None = None
    unquantized_modules: tuple[str, ...] | None = None
    unreadable: tuple[str, ...] = ()
    fix: str = "original_format=True"
    dtype: str | None = None
    dtype_requested: bool = False

    def refusal(self) -> str | None:
        """The ``transformers_weights`` sentence transformers quotes when it refuses the layout."""
        if not self.unreadable:
            return None
        return (
            f"{TRANSFORMERS_REFUSAL}: surgery saved this checkpoint with {' and '.join(self.unreadable)}. "
            f"Load it with surgery.load_checkpoint, or save the model with surgery.save_checkpoint(..., "
            f"{self.fix}) for transformers"
        )


def saved_config(
    *,
    fusions: Mapping[str, Any] | None,
    quantization: Mapping[str, Any] | None = None,
    quantization_loads_in_transformers: bool = False,
    unquantized_modules: tuple[str, ...] | None = None,
    original_format: bool = False,
) -> SavedConfig:
    """Describe a written layout: its fusions and the quantization of its tensors.

    Args:
        fusions: the fusion config of the layout written (``None`` for the original layout,
            where every fusion was inverted).
        quantization: the ``quantization_config`` of the quantized tensors written, if any.
        quantization_loads_in_transformers: transformers decodes those tensors with that config.
        unquantized_modules: see :attr:`SavedConfig.unquantized_modules`.
        original_format: the layout is the original one (quantized tensors there were
            re-encoded as loaded: the fix is writing floats, not the original layout).

    Example:
        >>> saved_config(fusions={"gate_up": True}).unreadable
        ('the fusions gate_up, which transformers does not perform',)
    """
    hub: dict[str, Any] = {}
    unknown: list[str] = []
    for name, value in (fusions or {}).items():
        if value is False:
            continue
        spec = find_fusion(name)
        hub_name = spec.transformers_name if spec is not None else None
        if hub_name is None:
            unknown.append(name)
        else:
            hub[hub_name] = copy.deepcopy(value)
    reasons: list[str] = []
    if unknown:
        reasons.append(f"the fusions {', '.join(unknown)}, which transformers does not perform")
    if quantization is not None and not quantization_loads_in_transformers:
        reasons.append(
            f"weights quantized by quant_method {quantization.get('quant_method')!r}, which transformers "
            "does not decode"
        )
    return SavedConfig(
        fusion_config=hub or None,
        quantization_config=dict(quantization) if quantization is not None else None,
        unquantized_modules=unquantized_modules,
        unreadable=tuple(reasons),
        fix="quantization='dequantized'" if original_format else "original_format=True",
    )


def rewrite_config(data: Mapping[str, Any], saved: SavedConfig) -> dict[str, Any]:
    """``data`` (a parsed ``config.json``) made to describe the tensors of ``saved``.

    A ``quantization_config`` of the same ``quant_method`` in ``data`` is kept, with the keys
    the quantizer knows (block size, format) overwritten: it described the same stored tensors,
    and its other fields (``modules_to_not_convert``) stay as the source had them. One in a
    sub-config (``text_config``, which transformers also reads) is treated the same way and
    written at the top. Any ``transformers_weights`` of the source is dropped (it named the
    source's files). ``dtype`` and ``torch_dtype`` (transformers 5 writes the first, 4 the second),
    at the top and in sub-configs, name the dtype written; a config with neither gets ``dtype``
    when the save was asked for one.

    Example:
        >>> rewrite_config({"model_type": "llama", "quantization_config": {"quant_method": "fp8"}}, SavedConfig())
        {'model_type': 'llama'}
    """
    out = dict(data)
    source = out.pop("quantization_config", None)
    for key, value in data.items():
        if isinstance(value, Mapping) and "quantization_config" in value:  # a sub-config's
            out[key] = {k: v for k, v in value.items() if k != "quantization_config"}
            source = source if source is not None else value["quantization_config"]
    for key in ("fusion_config", "transformers_weights"):
        out.pop(key, None)
    if saved.fusion_config:
        out["fusion_config"] = copy.deepcopy(saved.fusion_config)
    if saved.quantization_config is not None:
        wanted = copy.deepcopy(saved.quantization_config)
        if isinstance(source, Mapping) and source.get("quant_method") == wanted.get("quant_method"):
            wanted = {**copy.deepcopy(dict(source)), **wanted}
        elif saved.unquantized_modules is not None:
            wanted["modules_to_not_convert"] = list(saved.unquantized_modules)
        out["quantization_config"] = wanted
    if saved.dtype is not None:
        _set_dtype(out, saved.dtype, add=saved.dtype_requested)
    refusal = saved.refusal()
    if refusal is not None:
        out["transformers_weights"] = refusal
    return out


def _set_dtype(config: dict[str, Any], dtype: str, *, add: bool) -> None:
    found = False
    for key, value in list(config.items()):
        if key in ("dtype", "torch_dtype"):
            config[key], found = dtype, True
        elif isinstance(value, Mapping) and ("dtype" in value or "torch_dtype" in value):
            config[key] = {k: dtype if k in ("dtype", "torch_dtype") else v for k, v in value.items()}
    if add and not found:
        config["dtype"] = dtype


def write_config_json(directory: Path, saved: SavedConfig) -> bool:
    """Rewrite ``directory/config.json`` (where there is one) to describe ``saved``; ``True`` if changed.

    A file that is missing, unreadable or not a JSON object is left as it is: it is not a
    transformers config. Written atomically (temporary file and rename).
    """
    cfg = directory / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(data, dict):
        return False
    new = rewrite_config(data, saved)
    if new == data:
        return False
    write_file_atomically(cfg, json.dumps(new, indent=2, sort_keys=True).encode())
    return True
