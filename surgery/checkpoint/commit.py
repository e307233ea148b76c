"""The commit protocol of a save, and the checkpoint a save killed midway leaves readable.

A save is named by a token ``<pid>-<12 hex digits>``. Every file it puts into the directory
besides the checkpoint's own names is hidden and carries the token: ``.<name>.<token>.tmp`` (a
file being written), ``.<name>.<token>.bak`` (the previous file of that name, kept until the
commit is done) and ``.<name>.<token>.old`` (a moved-away entry point).

:func:`commit`, in this order:

1. *hide*: a sharded save renames the current entry points (the index, and a single
   ``model.safetensors``, which would win over any index) to ``.old``; directory fsync.
2. Each staged file but the last is renamed over its name; a name that exists is first
   hard-linked to its ``.bak`` (renamed to it where the file system has no hard links).
3. The last rename (the index, or the one file) is the commit point, over its name with no
   backup: one atomic rename that either leaves the previous file or commits (so a single-file
   save never has a moment without its entry point, hard links or not); directory fsync.
4. Clean-up: every ``.old`` first, then (only once they are gone) every ``.bak``, then the stale
   files of the previous checkpoint.

Two invariants hold at every moment a process may die at:

* the ``.old`` and ``.bak`` files are the previous checkpoint's files, unchanged (renamed or
  linked, never written);
* while a save's ``.old`` entry point exists, every name it replaced has its ``.bak`` (made before
  the replace, removed only after the last ``.old``).

So the previous checkpoint stays readable (:func:`interrupted_save`, read-only): when no entry
point is committed, the ``.old`` entry point is the checkpoint (a single file before an index, as
in a committed directory), and each shard it names is read from its ``.bak`` when there is one,
else under its own name. A reader racing a live save then checks, in this order, that no ``.bak``
appeared for a shard it read under its own name and that the ``.old`` entry point is still the
file it read: the clean-up removes ``.old`` before ``.bak``, so passing both proves every shard
read is the previous one.

The next save first undoes a dead save that never committed (:func:`recover`): its ``.bak``
files are renamed back over their names, then its ``.old`` entry points back into place; then the
leftovers of dead saves are removed. A failing save rolls back the same way before it raises;
if the roll-back fails too, the previous checkpoint stays in its ``.old``/``.bak`` files, where
readers find it and the next save restores it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

__all__ = [
    "LEFTOVER_NAME",
    "Interrupted",
    "commit",
    "fsync_directory",
    "interrupted_save",
    "recover",
    "save_in_progress",
    "save_token",
    "staged_name",
    "write_file_atomically",
]

LEFTOVER_NAME = re.compile(r"\.(?P<name>.+)\.(?P<token>(?P<pid>\d+)-[0-9a-f]{12})\.(?P<kind>tmp|bak|old)")
"""Temporary (``.tmp``), backup (``.bak``) and moved-away (``.old``) files of a save, by token."""
_LEGACY_LEFTOVER = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{12}\.(?:tmp|bak)")  # before process ids

_active: set[str] = set()  # tokens of saves running in this process
_active_lock = threading.Lock()


def staged_name(name: str, token: str, kind: str) -> str:
    """The hidden name of ``name``'s temporary (``tmp``), backup (``bak``) or moved-away (``old``) file."""
    return f".{name}.{token}.{kind}"


def write_file_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and one rename (a small side file).

    The temporary file carries a save token, so a process killed before the rename leaves a file
    the next save into the directory removes (:func:`recover`), not a stray one.
    """
    with save_token() as token:
        temp = path.with_name(staged_name(path.name, token, "tmp"))
        try:
            temp.write_bytes(data)
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                temp.unlink()
            raise


@contextlib.contextmanager
def save_token() -> Iterator[str]:
    """A fresh token, counted as a live save of this process until the block exits."""
    token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    with _active_lock:
        _active.add(token)
    try:
        yield token
    finally:
        with _active_lock:
            _active.discard(token)


def _alive(token: str) -> bool:
    pid = int(token.partition("-")[0])
    if pid == os.getpid():
        with _active_lock:
            return token in _active
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process: leave its files alone
    return True


def _leftovers(directory: Path) -> list[tuple[Path, re.Match[str]]]:
    found = []
    with contextlib.suppress(OSError):
        for p in directory.iterdir():
            m = LEFTOVER_NAME.fullmatch(p.name)
            if m is not None:
                found.append((p, m))
    return found


def save_in_progress(directory: Path) -> bool:
    """Whether a live save (of any process) has files in ``directory``."""
    return any(_alive(m["token"]) for _, m in _leftovers(directory))


def fsync_directory(directory: Path) -> None:
    """Make the renames in ``directory`` durable (a no-op where directories cannot be fsynced)."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class Interrupted:
    """The previous checkpoint of a save that moved the entry points away and has not committed.

    Attributes:
        token: the save's token.
        name: which entry point ``entry_point`` was (``model.safetensors``, or the index).
        entry_point: the moved-away entry point, ``.<name>.<token>.old``.
    """

    token: str
    name: str
    entry_point: Path

    def backup(self, path: Path) -> Path:
        """Where the previous content of ``path`` is while the save has replaced it."""
        return path.parent / staged_name(path.name, self.token, "bak")


def interrupted_save(directory: Path, entry_points: Sequence[str]) -> Interrupted | None:
    """The previous checkpoint a save left in ``directory``, if no entry point is committed.

    Read-only. ``entry_points`` in order of precedence (a single file first). ``None`` when an
    entry point is committed, when no save moved one away, or when saves of two tokens did (two
    savers at once: nothing says which is the previous checkpoint).
    """
    if any((directory / name).is_file() for name in entry_points):
        return None
    moved: dict[str, dict[str, Path]] = {}
    for path, m in _leftovers(directory):
        if m["kind"] == "old" and m["name"] in entry_points:
            moved.setdefault(m["token"], {})[m["name"]] = path
    if len(moved) != 1:
        return None
    [(token, paths)] = moved.items()
    name = next(n for n in entry_points if n in paths)
    return Interrupted(token, name, paths[name])


def _roll_back(interrupted: Interrupted, directory: Path, entry_points: Sequence[str]) -> None:
    """Put a dead save's ``.bak`` files back over their names, then its ``.old`` entry points."""
    for path, m in _leftovers(directory):
        if m["token"] == interrupted.token and m["kind"] == "bak":
            os.replace(path, directory / m["name"])
    for name in entry_points:  # a single file first: it is the entry point as soon as it is back
        moved = directory / staged_name(name, interrupted.token, "old")
        if moved.is_file() and not (directory / name).exists():
            os.replace(moved, directory / name)
    fsync_directory(directory)


def recover(directory: Path, entry_points: Sequence[str]) -> None:
    """Undo a dead save that never committed, then remove what dead saves left in ``directory``.

    Raises:
        CheckpointError: the previous checkpoint could not be put back (it stays readable where
            it is; nothing of it is deleted).
    """
    interrupted = interrupted_save(directory, entry_points)
    if interrupted is not None and not _alive(interrupted.token):
        try:
            _roll_back(interrupted, directory, entry_points)
        except OSError as exc:
            raise CheckpointError(
                f"A save into '{directory}' was killed before it committed, and its previous checkpoint "
                f"cannot be put back in place: {exc}. It still loads from the {interrupted.entry_point.name} "
                "and .bak files there; fix the cause (permissions, disk) and save again."
            ) from exc
    found = _leftovers(directory)
    holding: set[str] = set()  # saves whose .old/.bak files may be the only previous checkpoint
    if not any((directory / name).is_file() for name in entry_points):
        holding = {m["token"] for _, m in found if m["kind"] == "old" and m["name"] in entry_points}
    order = {"old": 0, "bak": 1, "tmp": 2}  # .bak outlives .old, as in a commit's clean-up
    for path, m in sorted(found, key=lambda pm: order[pm[1]["kind"]]):
        if _alive(m["token"]) or (m["token"] in holding and m["kind"] != "tmp"):
            continue
        with contextlib.suppress(OSError):
            path.unlink()
    with contextlib.suppress(OSError):
        for p in directory.iterdir():
            if _LEGACY_LEFTOVER.fullmatch(p.name):
                with contextlib.suppress(OSError):
                    p.unlink()


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold back Ctrl-C while files are renamed, so a commit is not cut in half."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    except (ValueError, OSError):  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and callable(previous):
            previous(signal.SIGINT, None)
        elif received and previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def _keep_as_backup(final: Path, backup: Path) -> None:
    """Make ``backup`` the previous ``final``: a hard link, or a rename without hard links."""
    try:
        os.link(final, backup)
    except OSError:
        if not final.is_file():
            raise  # not a file a save replaces (a directory in the way): the commit fails
        os.replace(final, backup)


@dataclass(slots=True)
class _Renames:
    """What a commit has done so far, to undo it."""

    hidden: list[tuple[Path, Path]]  # (moved-away entry point, its name)
    backups: list[tuple[Path, Path]]  # (backup, the name it backs up)
    created: list[Path]  # names that did not exist before

    def undo(self) -> list[Path]:
        """Undo every rename, newest first; the files still holding the previous checkpoint."""
        kept: list[Path] = []
        for backup, final in reversed(self.backups):
            try:
                if final.exists() and os.path.samefile(backup, final):
                    backup.unlink()  # not replaced yet; a rename between two links of one file does nothing
                else:
                    os.replace(backup, final)
            except OSError:
                kept.append(backup)
        for final in self.created:
            with contextlib.suppress(OSError):
                final.unlink()
        # An entry point goes back only over shards that are all the previous ones again:
        # otherwise it stays moved away and readers use the backups (no mix either way).
        for moved, final in reversed(self.hidden):
            if kept:
                kept.append(moved)
                continue
            try:
                os.replace(moved, final)
            except OSError:
                kept.append(moved)
        return kept


def commit(
    directory: Path,
    staged: list[tuple[Path, str]],
    stale: list[str],
    *,
    token: str,
    hide: tuple[str, ...] = (),
) -> None:
    """Rename staged temp files into place (the last one is the commit point), then delete ``stale``.

    ``hide``: entry points of the current checkpoint to move away before any file is replaced (a
    sharded save: the index and a single file), so that until the commit the previous checkpoint
    is what readers find (see the module docstring).

    Raises:
        CheckpointError: the commit failed and could not be undone (the message names the files
            that hold the previous checkpoint), or cleaning up after the commit failed (the new
            checkpoint is in place; the message names the files left).
    """
    done = _Renames([], [], [])
    with _sigint_deferred():
        try:
            for name in hide:
                final = directory / name
                if final.is_file():
                    moved = directory / staged_name(name, token, "old")
                    os.replace(final, moved)
                    done.hidden.append((moved, final))
            if done.hidden:
                fsync_directory(directory)  # the entry points are gone before any shard changes
            for i, (temp, name) in enumerate(staged):
                final = directory / name
                if i == len(staged) - 1:  # the commit point: one atomic rename, nothing to undo
                    os.replace(temp, final)
                elif final.exists():
                    backup = directory / staged_name(name, token, "bak")
                    _keep_as_backup(final, backup)
                    done.backups.append((backup, final))
                    os.replace(temp, final)
                else:
                    done.created.append(final)
                    os.replace(temp, final)
        except BaseException as exc:
            kept = done.undo()
            if kept:
                raise CheckpointError(
                    f"Saving into '{directory}' failed ({exc}), and undoing the commit failed too: the previous "
                    f"checkpoint is kept in {', '.join(p.name for p in kept)}. open_checkpoint still loads it "
                    "from there, and the next save into the directory puts it back; fix the cause (e.g. "
                    "permissions, disk space) and save again."
                ) from exc
            raise
        fsync_directory(directory)  # committed: the new checkpoint is what the directory holds
        left = _clean_up(
            [m for m, _ in done.hidden], [b for b, _ in done.backups], [directory / n for n in stale]
        )
    if left:
        raise CheckpointError(
            f"The new checkpoint is in place in '{directory}', but old files could not be removed: "
            f"{', '.join(left)}. They are not part of the checkpoint; delete them by hand."
        )


def _clean_up(hidden: list[Path], backups: list[Path], stale: list[Path]) -> list[str]:
    """Remove ``.old`` files, then ``.bak`` files (only once every ``.old`` is gone), then ``stale``."""
    left: list[str] = []

    def remove(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            left.append(f"{path.name} ({exc.strerror or exc})")

    for path in hidden:
        remove(path)
    if left:  # a reader racing the save relies on .bak outliving .old
        return [*left, *(p.name for p in backups)]
    for path in [*backups, *stale]:
        remove(path)
    return left
