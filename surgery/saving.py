"""Saving: export a model back to its original checkpoint layout (or its runtime layout).

Reversal runs in two stages, mirroring loading: first every converter's inverse (its op chain
reversed), then every renaming's inverse in reverse order. Only the transforms that fired at
load are inverted — a model never loaded through the engine recomputes its mapping and leaves
out :class:`~surgery.PrefixChange` and the built-in legacy renames, since nothing says the
original checkpoint had them. Fusions are always inverted in the original format. Tensors loaded
with a dtype cast are cast back, so load → save reproduces the input bit for bit.

The reverted tensors are produced one converter group at a time (:func:`iter_reverted`), so a
save holds at most one group's copies on top of the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import write_checkpoint
from .errors import ConfigurationError, ConversionError
from .loading import FUSION_METADATA_KEY, FUSION_TAG, _fusion_config_of, _fusion_transforms, load_record
from .ops import OpContext
from .routing import route_keys
from .transforms import PrefixChange, WeightConverter, WeightTransform, split_transforms

__all__ = ["revert_state_dict", "save_checkpoint", "iter_reverted", "reverting_transforms"]


def _dedup_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The runtime state dict with tied tensors kept once (the name the checkpoint used, if known)."""
    state = model.state_dict(keep_vars=True)
    record = load_record(model)
    by_id: dict[int, list[str]] = {}
    for k, t in state.items():
        by_id.setdefault(id(t), []).append(k)
    keep: dict[str, torch.Tensor] = {}
    drop: set[str] = set()
    for keys in by_id.values():
        if len(keys) > 1:
            preferred = [k for k in keys if record is not None and k in record.loaded_keys]
            chosen = preferred[0] if preferred else keys[0]
            drop.update(k for k in keys if k != chosen)
    for k, t in state.items():
        if k not in drop:
            keep[k] = t.detach()
    return keep


def reverting_transforms(model: nn.Module) -> list[WeightTransform]:
    """The forward transforms a save in original format inverts (see the module docstring)."""
    record = load_record(model)
    fusion = list(_fusion_transforms(model))
    if record is not None:
        base = [t for t in record.transforms if not t.__dict__.get(FUSION_TAG)]
    else:
        from .resolution import get_model_conversion_mapping

        base = [
            t
            for t in get_model_conversion_mapping(model, include_legacy=False)
            if not isinstance(t, PrefixChange)
        ]
    return base + fusion


@dataclass
class _Reverse:
    converters: list[WeightConverter]
    renamings: list[WeightTransform]


def _reverse_lists(forward: list[WeightTransform]) -> _Reverse:
    renamings, converters = split_transforms(forward)
    rev_conv: list[WeightConverter] = []
    for c in converters:
        r = c.reverse_transform()
        if not isinstance(r, WeightConverter):
            raise ConfigurationError(f"the reverse of {c!r} is not a converter.")
        rev_conv.append(r)
    return _Reverse(rev_conv, [r.reverse_transform() for r in reversed(renamings)])


def iter_reverted(model: nn.Module, *, original_format: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the model's tensors in the requested layout, one group at a time.

    Raises:
        ConversionError: a reversed op chain failed, or two tensors would be written under one key.
    """
    state = _dedup_state(model)
    if not original_format:
        for k, t in state.items():
            yield {k: t}
        return
    record = load_record(model)
    rev = _reverse_lists(reverting_transforms(model))
    stage1 = route_keys(list(state), rev.converters)
    if stage1.conflicts:
        raise ConversionError(f"saving: {stage1.conflicts[0]}; the reversed converters collide.")
    # Recorded checkpoint shapes/dtypes, named as the reversed renamings will see them.
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    if record is not None:
        fwd_renamings = [t for t in record.transforms if not isinstance(t, WeightConverter)]
        fwd = route_keys(list(record.source_shapes), fwd_renamings) if fwd_renamings else None
        for k, shape in record.source_shapes.items():
            name = fwd.routes[k].target_key if fwd is not None else k
            shapes[name] = shape
            dtypes[k] = record.source_dtypes[k]
    rename = _Renamer(rev.renamings)
    written: set[str] = set()
    for group in stage1.groups.values():
        if group.converter is None:
            (src,) = group.source_keys
            out = {src: state[src]}
        else:
            conv = rev.converters[group.converter]
            for key in group.source_keys:
                r = stage1.routes[key]
                conv.add_tensor(group.key, key, r.pattern_index or 0, state[key], index=r.index)
            targets = conv._expand_target_keys(group.key)
            ctx = OpContext(
                n_targets=len(targets),
                target_shapes=tuple(shapes.get(t.replace("*", "0")) for t in targets),
                config=None,
            )
            out = conv.convert(group.key, ctx)
        final: dict[str, torch.Tensor] = {}
        for k, t in out.items():
            name = rename(k)
            if name in written or name in final:
                raise ConversionError(
                    f"saving: two tensors would be written as {name!r} (one from {k!r}); "
                    "the reversed mapping is not one-to-one."
                )
            want = dtypes.get(name)
            if want is not None and t.dtype != want:
                t = t.to(want)
            final[name] = t
        written.update(final)
        yield final


class _Renamer:
    def __init__(self, renamings: list[WeightTransform]) -> None:
        self.renamings = renamings

    def __call__(self, key: str) -> str:
        for r in self.renamings:
            key, _ = r.rename_source_key(key)
        return key


def revert_state_dict(model: nn.Module, *, original_format: bool = True) -> dict[str, torch.Tensor]:
    """The model's tensors in the original checkpoint layout, in memory.

    Example:
        >>> sd = surgery.revert_state_dict(model)  # doctest: +SKIP
    """
    out: dict[str, torch.Tensor] = {}
    for part in iter_reverted(model, original_format=original_format):
        out.update(part)
    return out


def save_checkpoint(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    original_format: bool = True,
    max_shard_size: int | str = "5GB",
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Save ``model`` as safetensors, atomically.

    Args:
        model: the module tree.
        path: a directory (``model.safetensors`` or shards plus an index) or a ``.safetensors`` file.
        original_format: write the checkpoint layout the model was loaded from (inverting exactly
            the transforms that fired, and every fusion); ``False`` writes the runtime layout and
            persists the fusion config so a later load re-applies the fusions.
        max_shard_size: e.g. ``"5GB"``, ``"500MiB"`` or a byte count.
        metadata: extra safetensors metadata (string to string).

    Returns:
        The files written.

    Example:
        >>> surgery.save_checkpoint(model, "out/")  # doctest: +SKIP
    """
    meta = dict(metadata or {})
    fusion = _fusion_config_of(model)
    if not original_format and fusion:
        meta[FUSION_METADATA_KEY] = json.dumps(fusion, sort_keys=True)
    tensors = revert_state_dict(model, original_format=original_format)
    files = write_checkpoint(tensors, path, max_shard_size=max_shard_size, metadata=meta)
    _update_config_json(Path(path), None if original_format else fusion)
    return files


def _update_config_json(path: Path, fusion: dict[str, Any] | None) -> None:
    """Keep ``config.json`` (where the checkpoint has one) in step with the persisted fusions."""
    cfg = (path if path.is_dir() else path.parent) / "config.json"
    if not cfg.is_file():
        return
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(data, dict):
        return
    if fusion:
        data["fusion_config"] = fusion
    elif "fusion_config" in data:
        del data["fusion_config"]
    else:
        return
    tmp = cfg.with_name(f".{cfg.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, cfg)
