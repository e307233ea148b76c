"""Configs persisted with a checkpoint: one reader and one writer for the fusion and quantizer configs.

A runtime-layout save persists, in the safetensors metadata, the fusion config pinned to the
exact modules it rewrote (:data:`FUSION_METADATA_KEY`) and the quantizer that made its codes
(:data:`~surgery.quantization.QUANTIZATION_METADATA_KEY`): :func:`persisted_metadata` is the one
writer. A load reads them back: :func:`metadata_json` is the one reader of a JSON metadata entry,
:func:`persisted_fusion_config` finds the fusion config (metadata, else ``config.json``) and
:func:`trusted_fusion_config` decides whether a file may apply it. :func:`checkpoint_config`
and :func:`read_json_file` are the one reader of a ``config.json``.

Example:
    >>> from torch import nn
    >>> persisted_metadata(nn.Linear(2, 2), quantizer_metadata={})
    {}
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from .checkpoint import CheckpointReader
from .errors import ConfigurationError, LoadError
from .fusion.config import exact_module_pattern
from .fusion.registry import find_fusion
from .record import record_of

__all__ = [
    "FUSION_METADATA_KEY",
    "checkpoint_config",
    "metadata_json",
    "persisted_fusion_config",
    "persisted_metadata",
    "pinned_fusion_config",
    "read_json_file",
    "trusted_fusion_config",
]

FUSION_METADATA_KEY = "surgery.fusion_config"
"""Safetensors metadata key under which a runtime-layout save persists its fusion config."""

_EXACT_PATH = re.compile(r"\^((?:[A-Za-z0-9_]|\\\.)*)\$")
r"""An exact module-path pattern as :func:`~surgery.fusion.config.exact_module_pattern` writes it: ``^a\.b_c\.0$``."""


# --------------------------------------------------------------------------- reading


def read_json_file(path: Path, *, what: str) -> Any:
    """``path`` parsed as JSON.

    Raises:
        ConfigurationError: it cannot be read or parsed (``what`` says what was expected).
    """
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigurationError(
            f"{path}: cannot read {what} ({type(exc).__name__}: {str(exc)[:200]})."
        ) from None


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
    data = read_json_file(path, what="it as JSON")
    if not isinstance(data, dict):
        raise ConfigurationError(f"{path} holds a {type(data).__name__}, not a JSON object.")
    return path, data


def metadata_json(metadata: Mapping[str, str], key: str, *, source: str, fix: str) -> Any:
    """The JSON value a save persisted under ``key`` in the safetensors metadata (``None`` if absent).

    Raises:
        LoadError: the entry is not valid JSON; the message names ``source`` and ends with ``fix``.
    """
    raw = metadata.get(key)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise LoadError(
            f"{source}: metadata {key!r} is not valid JSON ({type(exc).__name__}: {str(exc)[:200]}); {fix}"
        ) from None


def persisted_fusion_config(reader: CheckpointReader) -> Any:
    """The fusion config a runtime-layout save persisted (metadata, else config.json), or None.

    Returned as parsed: it comes from the file, so :func:`trusted_fusion_config` decides whether
    it is applied. An unreadable ``config.json`` holds none.

    Raises:
        LoadError: the metadata entry is not valid JSON.
    """
    if FUSION_METADATA_KEY not in reader.metadata:
        try:
            _, data = checkpoint_config(reader.path)
        except ConfigurationError:
            return None
        value = data.get("fusion_config") if data is not None else None
        return value if isinstance(value, dict) and value else None
    return metadata_json(
        reader.metadata,
        FUSION_METADATA_KEY,
        source=str(reader.path),
        fix="re-save the checkpoint or pass fusion_config= explicitly.",
    )


def trusted_fusion_config(model: nn.Module, config: object) -> tuple[dict[str, Any] | None, str]:
    """A fusion config read from a checkpoint, if it only names modules ``model`` has; else ``None`` and why.

    A checkpoint decides which registered fusions run on the caller's model and where, so what
    it may say is narrow: fusion names the registry knows, their typed options, and module
    paths written exactly (``^a\\.b$``, as :func:`pinned_fusion_config` writes them) that
    exist in ``model``. Regexes are refused (one can run forever in ``re.search``), and so is a
    config naming modules the model lacks; the caller can always pass ``fusion_config=``.
    """
    if not isinstance(config, dict):
        return None, f"the persisted fusion config is {type(config).__name__}, not a mapping"
    paths: set[str] | None = None
    out: dict[str, Any] = {}
    for name, value in config.items():
        if not isinstance(name, str) or find_fusion(name) is None:
            return None, f"it names {str(name)[:80]!r}, which is not a registered fusion"
        if isinstance(value, bool):
            out[name] = value
            continue
        if not isinstance(value, dict):
            return None, f"its value for {name!r} is neither True/False nor a mapping of options"
        for key in ("modules", "exclude"):
            patterns = value.get(key, [])
            if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
                return None, f"{name}.{key} is not a list of module paths"
            for pattern in patterns:
                m = _EXACT_PATH.fullmatch(pattern)
                if m is None:
                    return None, (
                        f"{name}.{key} holds {pattern[:80]!r}, which is not an exact module path (^path$); "
                        "a checkpoint may name modules, not regexes"
                    )
                if paths is None:
                    paths = {p for p, _ in model.named_modules()}
                path = m.group(1).replace("\\", "")
                if path not in paths:
                    return None, f"{name}.{key} names the module {path!r}, which this model does not have"
        out[name] = value
    return out, ""


# --------------------------------------------------------------------------- writing


def pinned_fusion_config(model: nn.Module) -> dict[str, Any] | None:
    """The fusions applied to ``model``, pinned to the exact paths they rewrote (what a save persists).

    ``{"patch_embeddings": {"modules": ["^visual\\.patch_embed$"]}}``: a later load re-applies
    each fusion to exactly those modules, however broad the options it was first applied with.
    """
    record = record_of(model).fusions
    if record is None:
        return None
    out: dict[str, Any] = {}
    for name, given in record.config.items():
        options = (
            {k: copy.deepcopy(v) for k, v in given.items() if k not in ("modules", "exclude")}
            if isinstance(given, dict)
            else {}
        )
        options["modules"] = [exact_module_pattern(e.path) for e in record.entries if e.fusion == name]
        out[name] = options
    return out


def persisted_metadata(model: nn.Module, *, quantizer_metadata: Mapping[str, str]) -> dict[str, str]:
    """The safetensors metadata a runtime-layout save of ``model`` persists, so a load rebuilds it.

    Args:
        model: the model saved.
        quantizer_metadata: what the quantizer whose codes the save writes persists
            (``QuantizerHooks.metadata()``; ``{}`` when no codes are written).

    Returns:
        The fusion config pinned to the exact modules rewritten (:data:`FUSION_METADATA_KEY`),
        then the quantizer's entries.
    """
    out: dict[str, str] = {}
    fusion = pinned_fusion_config(model)
    if fusion:
        out[FUSION_METADATA_KEY] = json.dumps(fusion, sort_keys=True)
    out.update(quantizer_metadata)
    return out
