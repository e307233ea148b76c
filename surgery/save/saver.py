"""Saving: :func:`save_checkpoint`, :func:`revert_state_dict` and :func:`iter_reverted`.

The original format is the family's layout, however the weights arrived
(:mod:`surgery.save.inverse`); :class:`~surgery.save.reverted.RevertedState` computes it one group
at a time and :func:`~surgery.checkpoint.write_checkpoint` plans the files from its specs and
writes each value as soon as it is computed, so a save holds at most one group's outputs beyond
the model itself. A parallel model's save is shared out among its ranks by
:mod:`surgery.save.distributed`. What the files say about fusions and quantization (metadata and
``config.json``) is written as :mod:`surgery.persist` and :mod:`surgery.saved_config` say.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ..casting import SavedFiles, is_castable
from ..checkpoint import check_write_arguments, write_checkpoint, write_file_atomically
from ..checkpoint.writer import plan_files
from ..collective import Collective
from ..fusion import fusion_config_of
from ..persist import persisted_metadata
from ..quantization import QuantizerHooks
from ..record import record_of
from ..saved_config import SavedConfig, saved_config, write_config_json
from .distributed import write_distributed
from .quantized import kept_packed, quantized_on_the_fly
from .reverted import RevertedState

__all__ = [
    "iter_reverted",
    "revert_state_dict",
    "save_checkpoint",
]


def iter_reverted(
    model: nn.Module, *, original_format: bool = True, quantization: str = "as_loaded"
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the model's tensors in the requested layout, one converter group at a time.

    Raises:
        CheckpointError: a tensor is still on ``meta``.
        ConversionError: a reversed op chain failed, or two tensors would be written under one key.
    """
    collective = Collective.of_tensors(_model_tensors(model), what="revert_state_dict")
    with collective.step():
        state = RevertedState(
            model, original_format=original_format, quantization=quantization, collective=collective
        )
    collective.agree()
    yield from state.groups()


def _model_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def revert_state_dict(
    model: nn.Module, *, original_format: bool = True, quantization: str = "as_loaded"
) -> dict[str, torch.Tensor]:
    """The model's tensors in the original checkpoint layout, in memory (every group at once).

    Tensors that need no computation (plain keys, experts cut out of a fused parameter) share
    memory with the model's parameters; ``.clone()`` them before modifying them. For a
    tensor-parallel model the call is collective (every rank calls it) and every rank gets the
    whole tensors; a failure on one rank is raised on every rank (see :func:`save_checkpoint`).

    Example:
        >>> sd = surgery.revert_state_dict(model)  # doctest: +SKIP
    """
    out: dict[str, torch.Tensor] = {}
    for part in iter_reverted(model, original_format=original_format, quantization=quantization):
        out.update(part)
    return out


def save_checkpoint(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    original_format: bool = True,
    max_shard_size: int | str = "5GB",
    metadata: dict[str, str] | None = None,
    quantization: str = "as_loaded",
    dtype: torch.dtype | None = None,
) -> SavedFiles:
    """Save ``model`` as safetensors, atomically.

    Args:
        model: the module tree. For a parallel model (DTensor parameters: TP, FSDP2, FSDP2
            over TP, on any mesh) the save is collective and distributed: every rank calls it;
            the files are shared out among the ranks by bytes, each rank assembles only the
            groups of its own files (their DTensors sent to it point-to-point by the ranks holding
            the parts, never the model on one rank, never a gather on every rank) and writes
            them, and rank 0 commits the index once every rank's files are on disk
            (:mod:`surgery.save.distributed`). The files and the index equal a single-process
            save's, byte for byte. Per-rank shard files are not offered: an original-layout key
            (one expert's ``w1``) is a slice of every rank's shard. Every rank checks the
            arguments before the first collective, and a failure on any rank (a refused path, a
            rank's write, a rank's reversed chain) is raised on every rank, within the step it
            happened in (:mod:`surgery.collective`); the ranks must share a file system.
        path: a directory (``model.safetensors`` or shards plus an index) or a ``.safetensors`` file.
        original_format: write the checkpoint layout the model was loaded from (inverting exactly
            the transforms that fired, and every fusion); ``False`` writes the runtime layout and
            persists the fusion config so a later load re-applies the fusions.
        max_shard_size: e.g. ``"5GB"``, ``"500MiB"`` or a byte count.
        metadata: extra safetensors metadata (string to string).
        quantization: weights that were stored quantized and decoded at load (FP8 with block
            scales): ``"as_loaded"`` (default) re-encodes them with the scales recorded at load, so
            an unchanged model writes its FP8 files back bit for bit (a block whose values
            outgrew its scale gets a fresh one); ``"dequantized"`` writes floats. Applies to the
            original layout; a runtime-layout save writes the decoded floats. A model quantized
            on the fly writes its quantized layout with ``original_format=False`` (and the
            quantizer's metadata, so a later load rebuilds it) and dequantized floats with
            ``original_format=True`` (lossy).
        dtype: write every floating tensor in this dtype (``torch.float16``, ``bfloat16``,
            ``float32`` or ``float64``). Without it, the original layout writes each tensor in
            the dtype the checkpoint had at load (so ``model.to(torch.bfloat16)`` then a save of a
            float32 checkpoint writes float32: load → save reproduces the input), and a tensor
            that was not loaded, or a runtime-layout save, in the dtype the model holds.
            Quantized storage is never cast: integer and bool tensors, FP8 codes re-encoded as
            loaded and their scales (which keep their stored dtype, float32 in DeepSeek-V3
            checkpoints), int8 codes and scales of a runtime layout. ``config.json``'s ``dtype``
            (and ``torch_dtype``) names the dtype most floating values were written in.

    The ``config.json`` and ``generation_config.json`` of the checkpoint the model was loaded from
    are copied into a directory that has none, and ``config.json`` is made to describe the tensors
    written (:mod:`surgery.saved_config`): its ``quantization_config`` matches the quantized
    tensors (none after writing floats), its ``fusion_config`` holds only fusions transformers
    performs, and a layout transformers cannot read (an int8 runtime layout, a ``gate_up``
    fusion) makes transformers refuse it with a message saying so, instead of loading it wrong.

    Returns:
        The files written (:class:`~surgery.casting.SavedFiles`, a list of paths), with the dtype
        casts made (``casts``; ``lossy_keys``: the tensors whose values the cast changed). A
        collective save returns on each rank the files that rank wrote (rank 0: also the index)
        and every rank's casts.

    Raises:
        CheckpointError: ``path`` cannot be written (a file where the directory goes, under a
            file, not writable), a tensor is still on ``meta``, or writing failed (the previous
            checkpoint at ``path`` is then left as it was).
        ConfigurationError: ``max_shard_size``, ``quantization`` or ``dtype`` is not valid.
        ConversionError: a reversed op chain failed.

        A collective save raises the same error on every rank: the failed rank's class, its
        message prefixed with ``save_checkpoint to '<path>' failed on rank R of N``.

    Example:
        >>> surgery.save_checkpoint(model, "out/")  # doctest: +SKIP
    """
    collective = Collective.of_tensors(_model_tensors(model), what=f"save_checkpoint to '{path}'")
    with collective.step():  # every rank checks everything before the first collective
        check_write_arguments(path, max_shard_size=max_shard_size, metadata=metadata)
        meta = dict(metadata or {})
        state = RevertedState(
            model,
            original_format=original_format,
            quantization=quantization,
            collective=collective,
            dtype=dtype,
        )
        written_quantized = quantized_on_the_fly(model) if not original_format else None
        if not original_format:  # what a load needs to rebuild the model: fusions, quantizer
            quantizer_metadata = written_quantized.metadata() if written_quantized is not None else {}
            meta.update(persisted_metadata(model, quantizer_metadata=quantizer_metadata))
        described = _describe_written(
            model, state, written_quantized, original_format=original_format, quantization=quantization
        )
        described = replace(described, dtype=_written_dtype(state), dtype_requested=dtype is not None)

    def finish() -> None:
        _carry_configs(model, Path(path))
        target = Path(path)
        write_config_json(target if target.is_dir() else target.parent, described)

    if collective.group is None:
        files = write_checkpoint(state, path, max_shard_size=max_shard_size, metadata=meta, specs=state.specs)
        finish()
        return SavedFiles(files, casts=state.casts, requantized=state.requantized)
    with collective.step():
        plan = plan_files(state, path, max_shard_size=max_shard_size, metadata=meta, specs=state.specs)
    collective.agree()  # every rank accepted the arguments and planned the same files: nothing touched yet
    return write_distributed(collective, state, plan, finish)


_CARRIED_CONFIGS = ("config.json", "generation_config.json")


def _carry_configs(model: nn.Module, path: Path) -> None:
    """Copy ``config.json``/``generation_config.json`` of the checkpoint the model was loaded from.

    Only into a directory that has none yet, so the output loads in transformers with its own
    config (without one, transformers builds a default config silently). Written atomically.
    """
    record = record_of(model).load
    if record is None or not record.checkpoint:
        return
    source = Path(record.checkpoint)
    source_dir = source if source.is_dir() else source.parent
    target_dir = path if path.is_dir() else path.parent
    if source_dir.resolve() == target_dir.resolve():
        return
    for name in _CARRIED_CONFIGS:
        src, dst = source_dir / name, target_dir / name
        if not src.is_file() or dst.exists():
            continue
        try:
            data = src.read_bytes()
        except OSError:
            continue
        write_file_atomically(dst, data)


def _written_dtype(state: RevertedState) -> str | None:
    """The dtype most floating values are written in (what ``config.json`` calls the model's dtype)."""
    numel: dict[torch.dtype, int] = {}
    for spec in state.specs.values():
        if is_castable(spec.dtype):
            numel[spec.dtype] = numel.get(spec.dtype, 0) + math.prod(spec.shape)
    return str(max(numel, key=numel.__getitem__)).removeprefix("torch.") if numel else None


def _describe_written(
    model: nn.Module,
    state: RevertedState,
    written_quantized: QuantizerHooks | None,
    *,
    original_format: bool,
    quantization: str = "as_loaded",
) -> SavedConfig:
    """What the ``config.json`` of this save must say: the fusions and the quantization written.

    ``written_quantized``: the quantizer whose codes a runtime-layout save writes (``None``: none).
    """
    fusions = None if original_format else fusion_config_of(model)
    record = record_of(model).load
    encoded = set(state.encoded_keys)
    if encoded and record is not None and record.quantizer is not None:  # FP8 re-encoded as loaded
        hooks = QuantizerHooks(record.quantizer)
        unquantized = tuple(
            sorted(
                k.removesuffix(".weight")
                for k, spec in state.specs.items()
                if k.endswith(".weight")
                and len(spec.shape) >= 2
                and spec.dtype.is_floating_point
                and k not in encoded
            )
        )
        return saved_config(
            fusions=fusions,
            quantization=hooks.quantization_config(),
            quantization_loads_in_transformers=hooks.loads_in_transformers,
            unquantized_modules=unquantized,
            original_format=original_format,
        )
    if written_quantized is not None:  # int8 codes and scales
        return saved_config(
            fusions=fusions,
            quantization=written_quantized.quantization_config(),
            quantization_loads_in_transformers=written_quantized.loads_in_transformers,
        )
    packed = kept_packed(model) if quantization == "as_loaded" or not original_format else None
    if packed is not None:  # packed tensors kept at runtime, written as loaded
        return saved_config(
            fusions=fusions,
            quantization=packed.quantization_config(),
            quantization_loads_in_transformers=packed.loads_in_transformers,
        )
    return saved_config(fusions=fusions)  # floats only
