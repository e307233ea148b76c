"""Checkpoint I/O: the safetensors format, validated lazy reading, atomic streaming writes.

* :mod:`~surgery.checkpoint.format`: the safetensors header (parsed and validated before any
  tensor byte is read) and :class:`~surgery.checkpoint.format.SafetensorsFile`, one open file.
* :mod:`~surgery.checkpoint.layout`: :func:`open_checkpoint` finds the files of a file, a
  directory or a sharded checkpoint (index validated, shard paths confined to its directory);
  pickle files only with ``allow_pickle=True``, then with ``weights_only=True``.
* :mod:`~surgery.checkpoint.reader`: :class:`CheckpointReader`, reads tensors, slices and
  regions of those files on demand (zero-copy, ``preadv`` into place).
* :mod:`~surgery.checkpoint.writer`: :func:`write_checkpoint`, streaming, sharded, atomic
  (temporary files, fsync, rename); a failed save undoes itself and removes its files.
  :func:`check_write_arguments` checks its arguments without touching the disk (every rank of
  a collective save does, first); its steps (``plan_files``, ``stage_file``, ``commit_files``)
  let the ranks of a distributed save each write some files of one checkpoint.
* :mod:`~surgery.checkpoint.commit`: the commit protocol, so that after a save killed at any
  moment the directory loads as exactly the previous checkpoint or exactly the new one.
"""

from .commit import LEFTOVER_NAME, write_file_atomically
from .format import StoredTensor
from .layout import open_checkpoint
from .reader import CheckpointReader
from .writer import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SHARD_NAME,
    check_write_arguments,
    parse_size,
    write_checkpoint,
)

__all__ = [
    "LEFTOVER_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SHARD_NAME",
    "CheckpointReader",
    "StoredTensor",
    "check_write_arguments",
    "open_checkpoint",
    "parse_size",
    "write_checkpoint",
    "write_file_atomically",
]
