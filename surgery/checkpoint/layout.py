"""Finding a checkpoint's files: single files, sharded checkpoints, and pickle files only on request.

:func:`open_checkpoint` accepts a ``.safetensors`` file, a directory holding ``model.safetensors``,
or a sharded checkpoint described by ``model.safetensors.index.json``. Every header (and the
index) is parsed and validated up front, before a single tensor byte is read: the index's shard
names stay inside its directory, every shard holds exactly the keys the index gives it, no
numbered shard is left out, and a save committing into the directory meanwhile is waited for (or
its interrupted state read as the checkpoint it leaves). The files then go to a
:class:`~surgery.checkpoint.reader.CheckpointReader`.

Pickle checkpoints (``.bin``, ``.pt``, ...) are refused unless the caller opts in with
``allow_pickle=True``; they are then loaded with ``torch.load(weights_only=True, mmap=True)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointError
from .commit import LEFTOVER_NAME, Interrupted, interrupted_save, save_in_progress
from .format import SafetensorsFile, unique_pairs
from .reader import CheckpointReader, PickleFile, TensorFile
from .writer import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

__all__ = ["open_checkpoint"]

_PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
_PICKLE_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
_PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt"})
_MAX_INDEX_BYTES = 100_000_000  # like the safetensors header: read whole, so bounded
_OPEN_ATTEMPTS = 20  # while a save into the directory is in progress, opening is retried
_RETRY_SECONDS = 0.05  # the longest wait between two attempts; the first ones wait 1, 2, 4 ... ms


class _IndexChanged(Exception):
    """The index was replaced while its shards were being opened (a save committed meanwhile)."""


_NUMBERED = re.compile(r"(.+)-\d{5}-of-(\d{5})(\.\w+)")
_ENTRY_POINTS = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)  # the same precedence as transformers


def _refuse_pickle(path: Path) -> CheckpointError:
    return CheckpointError(
        f"'{path}' is a pickle checkpoint; unpickling can run arbitrary code, so it is refused by "
        "default. Convert it to safetensors, or, if you trust its source, pass allow_pickle=True (on the "
        "command line: --allow-pickle); it is then loaded with torch.load(weights_only=True, mmap=True)."
    )


def _open_file(path: Path, *, allow_pickle: bool) -> TensorFile:
    if path.suffix in _PICKLE_SUFFIXES:
        if not allow_pickle:
            raise _refuse_pickle(path)
        return PickleFile(path)
    return SafetensorsFile(path)


def _index_error(index: Path, problem: str, fix: str) -> CheckpointError:
    return CheckpointError(f"Invalid checkpoint index '{index}': {problem}. {fix}")


def _shard_path(index: Path, name: object, key: str, interrupted: Interrupted | None = None) -> Path:
    """Resolve one weight_map entry, refusing anything that leaves the index's directory.

    With ``interrupted``, the index is the previous one of a save that has not committed: a shard
    that save replaced is read from its backup.
    """
    directory = index.parent
    if not isinstance(name, str) or not name:
        raise _index_error(
            index, f"key {key!r} maps to {name!r}, not a file name", "Fix the weight_map entry."
        )
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise _index_error(
            index,
            f"key {key!r} maps to shard {name!r}, which escapes the checkpoint directory",
            "Shard paths must be relative to the index's directory without '..'; fix the weight_map.",
        )
    candidate = directory / relative
    if interrupted is not None and interrupted.backup(candidate).is_file():
        candidate = interrupted.backup(candidate)
    try:
        real = candidate.resolve(strict=True)
    except (OSError, RuntimeError):
        raise _index_error(
            index,
            f"shard '{candidate}' (holding key {key!r}) does not exist",
            "Download or copy the missing shard, or regenerate the index.",
        ) from None
    if not real.is_relative_to(directory.resolve()):
        raise _index_error(
            index,
            f"shard {name!r} (holding key {key!r}) is a symlink to '{real}', outside the checkpoint directory",
            "Copy the shard into the directory instead of linking outside it.",
        )
    if not real.is_file():
        raise _index_error(
            index, f"shard '{candidate}' is not a regular file", "Point the weight_map at files."
        )
    return candidate


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _open_index(
    given: Path, index: Path, *, allow_pickle: bool, interrupted: Interrupted | None = None
) -> CheckpointReader:
    try:
        f = open(index, "rb")  # noqa: SIM115 - held open until the shards are checked against it
    except OSError as exc:
        raise CheckpointError(f"Cannot read checkpoint index '{index}': {exc.strerror or exc}.") from None
    # While the index is open its inode cannot be reused by a later save's index, so an index
    # with the identity of the one read is the one read.
    with f:
        return _open_pinned_index(given, index, f, allow_pickle=allow_pickle, interrupted=interrupted)


def _open_pinned_index(
    given: Path, index: Path, f: BinaryIO, *, allow_pickle: bool, interrupted: Interrupted | None
) -> CheckpointReader:
    try:
        seen = _identity(os.fstat(f.fileno()))
        size = seen[2]
        if size > _MAX_INDEX_BYTES:
            raise _index_error(
                index,
                f"it is {size} bytes, more than the {_MAX_INDEX_BYTES} an index may hold (the safetensors "
                "header limit)",
                "Restore or regenerate the index file.",
            )
        text = f.read().decode("utf-8")
        raw = json.loads(text, object_pairs_hook=unique_pairs)
    except OSError as exc:
        raise CheckpointError(f"Cannot read checkpoint index '{index}': {exc.strerror or exc}.") from None
    except ValueError as exc:
        raise _index_error(
            index, f"not valid JSON ({exc})", "Restore or regenerate the index file."
        ) from None
    except RecursionError:
        raise _index_error(
            index, "JSON nested too deeply to parse", "Restore or regenerate the index file."
        ) from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        raise _index_error(
            index,
            "no 'weight_map' object",
            'It must look like {"metadata": {...}, "weight_map": {key: file}}.',
        )
    index_metadata = raw.get("metadata") or {}
    if not isinstance(index_metadata, dict):
        raise _index_error(index, "'metadata' is not an object", "Fix or remove the 'metadata' entry.")
    by_name: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str):
            _shard_path(index, name, key)  # raises, naming the key
        by_name.setdefault(str(Path(name)), []).append(key)  # "./a" and "a" are one shard
    paths = {name: _shard_path(index, name, keys[0], interrupted) for name, keys in by_name.items()}
    _check_no_orphan_shards(index, {name: index.parent / name for name in paths})
    pickled = sorted(n for n, p in paths.items() if p.suffix in _PICKLE_SUFFIXES)
    if pickled and not allow_pickle:
        raise _refuse_pickle(paths[pickled[0]])
    files: list[TensorFile] = []
    try:
        try:
            for name in sorted(paths):
                shard = _open_file(paths[name], allow_pickle=allow_pickle)
                files.append(shard)
                _check_shard_against_index(index, shard, name, by_name[name])
        except CheckpointError:
            if _changed(index, seen, paths, interrupted):
                raise _IndexChanged from None  # a save replaced shards under us: open again
            raise
        if _changed(index, seen, paths, interrupted):  # the shards held may be from two saves
            raise _IndexChanged
    except BaseException:
        for shard in files:
            shard.close()
        raise
    return CheckpointReader(given, files, index=index, index_metadata=index_metadata)


def _changed(
    index: Path, seen: tuple[int, int, int, int], paths: Mapping[str, Path], interrupted: Interrupted | None
) -> bool:
    """Whether the shards opened may not be the ones ``index`` names: open again.

    A committed index: it is no longer the file read (a sharded save moves it away before any
    shard). The previous index of an interrupted save: a shard read under its own name has a
    backup now (the save replaced it), or the index is gone; checked in this order, because a save
    removes its backups only after its moved-away index (:mod:`surgery.checkpoint.commit`).
    """
    if interrupted is not None:
        for name, path in paths.items():
            own = index.parent / name
            if path == own and interrupted.backup(own).exists():
                return True
    try:
        return _identity(os.stat(index)) != seen
    except OSError:
        return True


def _check_no_orphan_shards(index: Path, paths: Mapping[str, Path]) -> None:
    """A file named like the index's shards (``<stem>-0000i-of-0000N``) must be in the index."""
    series = {
        (p.parent, m.group(1), m.group(2), m.group(3))
        for p in paths.values()
        if (m := _NUMBERED.fullmatch(p.name))
    }
    referenced = {p.name for p in paths.values()}
    for parent, stem, total, suffix in sorted(series):
        for i in range(1, int(total) + 1):
            name = f"{stem}-{i:05d}-of-{total}{suffix}"
            if name not in referenced and (parent / name).exists():
                raise _index_error(
                    index,
                    f"shard '{parent / name}' belongs to the same series but no key is mapped to it, so "
                    "its tensors would be dropped",
                    "Regenerate the index from all shards, or delete the stray shard.",
                )


def _check_shard_against_index(index: Path, shard: TensorFile, name: str, indexed: list[str]) -> None:
    missing = [k for k in indexed if k not in shard.infos]
    if missing:
        raise _index_error(
            index,
            f"{len(missing)} key(s) mapped to shard {name!r} are not in it, e.g. {missing[:5]}",
            "The shard and index are from different saves; re-download the shard or regenerate the index.",
        )
    listed = set(indexed)
    extra = [k for k in shard.infos if k not in listed]
    if extra:
        raise _index_error(
            index,
            f"shard {name!r} holds {len(extra)} key(s) the index does not map to it, e.g. {extra[:5]}",
            "Add them to the weight_map (or remove them from the shard); they are never dropped silently.",
        )


def _directory_entry(directory: Path, *, allow_pickle: bool) -> Path | Interrupted:
    """The directory's entry point, or the previous checkpoint of a save that has not committed."""
    for name in _ENTRY_POINTS:
        if (directory / name).is_file():
            return directory / name
    for name in (_PICKLE_WEIGHTS_NAME, _PICKLE_WEIGHTS_INDEX_NAME):
        if (directory / name).is_file():
            if not allow_pickle:
                raise _refuse_pickle(directory / name)
            return directory / name
    interrupted = interrupted_save(directory, _ENTRY_POINTS)
    if interrupted is not None:
        return interrupted
    names = [p.name for p in directory.iterdir()]
    if any((directory / name).is_file() for name in _ENTRY_POINTS):
        raise _IndexChanged  # a save committed while the directory was listed: open again
    leftovers = sorted(n for n in names if LEFTOVER_NAME.fullmatch(n))
    if leftovers:
        raise CheckpointError(
            f"Directory '{directory}' holds no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}, only files of "
            f"saves that did not commit (left: {', '.join(leftovers[:4])}), and none of them moved a previous "
            "checkpoint away alone. Save the checkpoint again (that also removes these files)."
        )
    found = sorted(n for n in names if Path(n).suffix in {".safetensors", ".json"})
    raise CheckpointError(
        f"Directory '{directory}' holds no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} (found: "
        f"{found or 'nothing relevant'}). Pass the path of the checkpoint file itself."
    )


def open_checkpoint(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> CheckpointReader:
    """Open a checkpoint lazily: headers (and the index) are read and validated, no tensor data.

    A directory that a save is writing into (or that a save killed midway left) opens as the
    previous checkpoint until the save commits, and as the new one after: never a mix. Before the
    commit the previous checkpoint is read, read-only, from the files the save moved away
    (``.model.safetensors.index.json.<token>.old``, ``.<shard>.<token>.bak``); the rule is in
    :mod:`surgery.checkpoint.commit`.

    Args:
        path: a ``.safetensors`` file, an index ``*.index.json``, or a directory holding
            ``model.safetensors`` or ``model.safetensors.index.json`` (the single file wins if both
            exist, as in transformers).
        allow_pickle: read ``.bin`` / ``.pt`` / ``.pth`` / ``.ckpt`` files, with
            ``torch.load(weights_only=True, mmap=True)``. Refused by default.

    Returns:
        A :class:`CheckpointReader`; use it as a context manager.

    Raises:
        CheckpointError: missing or unsafe shard paths, a corrupt header, an index that disagrees
            with its shards, or a pickle file without ``allow_pickle``.

    Example:
        >>> with open_checkpoint("ckpt/") as reader:  # doctest: +SKIP
        ...     rows = reader.get_slice("lm_head.weight", 0, 0, 1024)
    """
    given = Path(path)
    directory = given if given.is_dir() else given.parent
    for attempt in range(_OPEN_ATTEMPTS):
        with _pinned_entry_points(directory) as entry_points:
            # No committed entry point: the previous checkpoint may be read from a dead save's
            # moved-away files, which the next save's recovery renames back while we read them.
            staged = None if any(entry_points) else _leftover_names(directory)
            try:
                return _open(given, allow_pickle=allow_pickle)
            except _IndexChanged:
                pass  # a save committed while the shards were opened: open again, after a short wait
            except CheckpointError:
                # Opening raced a save into the directory (an entry point or a shard replaced or
                # removed, or a killed save's files put back, while it was opened): open again.
                # Otherwise the error stands.
                raced = (
                    _identities(directory) != entry_points
                    or save_in_progress(directory)
                    or (staged is not None and _leftover_names(directory) != staged)
                )
                if attempt + 1 == _OPEN_ATTEMPTS or not raced:
                    raise
        time.sleep(min(_RETRY_SECONDS, 0.001 * 2**attempt))
    raise CheckpointError(
        f"'{given}' kept changing while it was opened ({_OPEN_ATTEMPTS} attempts): another process is saving "
        "into it. Open it once that save has finished."
    )


def _leftover_names(directory: Path) -> frozenset[str]:
    """The names of the save files (``.tmp``, ``.bak``, ``.old``) in ``directory``."""
    try:
        return frozenset(n for n in os.listdir(directory) if LEFTOVER_NAME.fullmatch(n))
    except OSError:
        return frozenset()


def _identities(directory: Path) -> list[tuple[int, int, int, int] | None]:
    """Which files the directory's entry points are now (a save replaces or moves them)."""
    found: list[tuple[int, int, int, int] | None] = []
    for name in _ENTRY_POINTS:
        try:
            found.append(_identity(os.stat(directory / name)))
        except OSError:
            found.append(None)
    return found


@contextlib.contextmanager
def _pinned_entry_points(directory: Path) -> Iterator[list[tuple[int, int, int, int] | None]]:
    """The entry points' identities, held open so that no later file can take their inodes."""
    held: list[int] = []
    found: list[tuple[int, int, int, int] | None] = []
    try:
        for name in _ENTRY_POINTS:
            try:  # O_NONBLOCK: a FIFO in the way must not block
                held.append(os.open(directory / name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)))
                found.append(_identity(os.fstat(held[-1])))
            except OSError:
                found.append(None)
        yield found
    finally:
        for fd in held:
            os.close(fd)


def _open(given: Path, *, allow_pickle: bool) -> CheckpointReader:
    path = given
    if path.is_dir():
        entry = _directory_entry(path, allow_pickle=allow_pickle)
        if isinstance(entry, Interrupted):
            return _open_interrupted(given, entry, allow_pickle=allow_pickle)
        path = entry
    elif not path.exists():
        interrupted = interrupted_save(path.parent, _ENTRY_POINTS)
        if interrupted is not None and interrupted.name == path.name:
            return _open_interrupted(given, interrupted, allow_pickle=allow_pickle)
        raise CheckpointError(f"Checkpoint '{path}' does not exist; check the path.")
    if path.name.endswith(".index.json"):
        return _open_index(given, path, allow_pickle=allow_pickle)
    if path.suffix != ".safetensors" and path.suffix not in _PICKLE_SUFFIXES:
        raise CheckpointError(
            f"'{path}' is not a known checkpoint format; expected .safetensors, an .index.json, or (with "
            "allow_pickle=True) .bin/.pt/.pth/.ckpt."
        )
    return CheckpointReader(given, [_open_file(path, allow_pickle=allow_pickle)])


def _open_interrupted(given: Path, interrupted: Interrupted, *, allow_pickle: bool) -> CheckpointReader:
    """The previous checkpoint of a save that moved the entry point away and has not committed."""
    if interrupted.name.endswith(".index.json"):
        return _open_index(given, interrupted.entry_point, allow_pickle=allow_pickle, interrupted=interrupted)
    return CheckpointReader(given, [SafetensorsFile(interrupted.entry_point)])
