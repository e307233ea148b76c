"""After a save killed at any moment, or failing at any step, the directory holds the old
checkpoint or the new one: never a mix, never nothing, never a stray file once the next save ran.

Real processes, real files. A forked child runs ``write_checkpoint`` and SIGKILLs itself right
after the n-th file event of the save (every fsync, rename, hard link and unlink), for every n, in
every transition (sharded -> sharded, single -> sharded, sharded -> single, same-name
overwrite); then the directory is opened, which must not change it. A failing file system is an
``OSError`` raised by the n-th rename, link or fsync, once or from then on. And a saver process
rewrites a checkpoint in a loop while this process loads it a thousand times.
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import surgery
from surgery.checkpoint import (
    LEFTOVER_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    open_checkpoint,
    write_checkpoint,
    write_file_atomically,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
KEYS = [f"t{i}" for i in range(4)]
TWO_SHARDS = 3 * 64 + 1  # bytes per shard: 4 tensors of 64 bytes make 2 shards
FOUR_SHARDS = 64 + 1
SINGLE = 10**9
_EVENTS = ("replace", "fsync", "link", "unlink")


def state(value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full((16,), value) for k in KEYS}


# (shard size before, shard size after, saved to a .safetensors file path rather than a directory)
TRANSITIONS = {
    "sharded -> sharded": (TWO_SHARDS, TWO_SHARDS, False),
    "2 shards -> 4 shards": (TWO_SHARDS, FOUR_SHARDS, False),
    "single -> sharded": (SINGLE, TWO_SHARDS, False),
    "sharded -> single": (TWO_SHARDS, SINGLE, False),
    "same-name overwrite, directory": (SINGLE, SINGLE, False),
    "same-name overwrite, file": (SINGLE, SINGLE, True),
}


def target(directory: Path, as_file: bool) -> Path:
    return directory / "m.safetensors" if as_file else directory


def loaded_value(path: Path) -> float | str:
    """The one value every tensor of the checkpoint holds, or why there is no such value."""
    try:
        with open_checkpoint(path) as reader:
            if reader.keys() != KEYS:
                return f"keys {reader.keys()}"
            tensors = [reader.get_tensor(k) for k in KEYS]
    except surgery.CheckpointError as exc:
        return f"error: {exc}"
    value = float(tensors[0][0])
    if not all(torch.equal(t, torch.full((16,), value)) for t in tensors):
        return f"a mix of saves: {sorted({float(v) for t in tensors for v in t.unique()})}"
    return value


def files(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in directory.iterdir()}


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if LEFTOVER_NAME.fullmatch(p.name))


def _no_hard_links(*args, **kwargs):
    raise OSError(errno.EPERM, "Operation not permitted (a file system without hard links)")


def _save_and_die(path: str, value: float, shard_size: int, die_at: int, counter, hard_links: bool) -> None:
    count = [0]

    def counted(real):
        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            count[0] += 1
            counter.value = count[0]
            if count[0] == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        return call

    if not hard_links:
        os.link = _no_hard_links
    for name in _EVENTS:
        setattr(os, name, counted(getattr(os, name)))
    write_checkpoint(state(value), path, max_shard_size=shard_size)
    os._exit(0)


def run_save(
    path: Path, value: float, shard_size: int, die_at: int, *, hard_links: bool = True
) -> tuple[int, int]:
    """(exit code, file events seen) of a forked save that kills itself after event ``die_at`` (0: never)."""
    ctx = mp.get_context("fork")
    counter = ctx.Value("i", 0)
    child = ctx.Process(
        target=_save_and_die, args=(str(path), value, shard_size, die_at, counter, hard_links)
    )
    child.start()
    child.join(60)
    return child.exitcode if child.exitcode is not None else -1, counter.value


def count_events(tmp_path: Path, before: int, after: int, as_file: bool, *, hard_links: bool = True) -> int:
    probe = tmp_path / "probe"
    write_checkpoint(state(1.0), target(probe, as_file), max_shard_size=before)
    code, total = run_save(target(probe, as_file), 2.0, after, die_at=0, hard_links=hard_links)
    assert code == 0 and total >= 2
    return total


@pytest.mark.parametrize("hard_links", [True, False], ids=["hard links", "no hard links"])
@pytest.mark.parametrize("transition", list(TRANSITIONS))
def test_a_save_killed_after_any_file_event_leaves_exactly_the_old_or_the_new_checkpoint(
    tmp_path: Path, transition: str, hard_links: bool
) -> None:
    """Without hard links (some network and FUSE file systems) a replaced shard is renamed to its backup."""
    before, after, as_file = TRANSITIONS[transition]
    total = count_events(tmp_path, before, after, as_file, hard_links=hard_links)
    outcomes: list[float | str] = []
    recovered = 0  # kills after which no entry point was committed: the old one was moved away
    for die_at in range(1, total + 1):
        directory = tmp_path / f"kill-{die_at}"
        path = target(directory, as_file)
        write_checkpoint(state(1.0), path, max_shard_size=before)
        code, _ = run_save(path, 2.0, after, die_at, hard_links=hard_links)
        assert code == -signal.SIGKILL
        on_disk = files(directory)
        outcomes.append(loaded_value(path))
        assert outcomes[-1] in (1.0, 2.0), (die_at, outcomes[-1])
        assert files(directory) == on_disk, "opening a checkpoint must never change its directory"
        recovered += not ({SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, "m.safetensors"} & set(on_disk))
        write_checkpoint(state(3.0), path, max_shard_size=after)  # the next save recovers ...
        assert loaded_value(path) == 3.0
        assert leftovers(directory) == []  # ... and removes what the killed one left
    assert outcomes[0] == 1.0 and outcomes[-1] == 2.0
    assert outcomes == sorted(outcomes), "once the new checkpoint showed, a later kill brought back the old"
    if after != SINGLE:  # a sharded save moves the old entry point away before its shards
        assert recovered, "no kill fell between moving the old entry point away and the commit"


def test_a_first_save_killed_before_its_commit_leaves_no_checkpoint_and_says_so(tmp_path: Path) -> None:
    events = run_save(tmp_path / "probe", 2.0, TWO_SHARDS, die_at=0)[1]
    committed = 0
    for die_at in range(1, events + 1):
        directory = tmp_path / f"kill-{die_at}"
        run_save(directory, 2.0, TWO_SHARDS, die_at)
        outcome = loaded_value(directory)
        if outcome == 2.0:
            committed += 1
        else:  # nothing was there before: the old checkpoint is no checkpoint
            assert isinstance(outcome, str) and "did not commit" in outcome, outcome
        write_checkpoint(state(3.0), directory, max_shard_size=TWO_SHARDS)
        assert loaded_value(directory) == 3.0
        assert leftovers(directory) == []
    assert 0 < committed < events


def test_a_save_killed_while_it_recovers_a_killed_save_still_leaves_old_or_new(tmp_path: Path) -> None:
    total = count_events(tmp_path, TWO_SHARDS, TWO_SHARDS, False)
    # The first kill: after the first shard was replaced, before the index was (its .bak exists).
    for first in range(1, total + 1):
        directory = tmp_path / f"first-{first}"
        write_checkpoint(state(1.0), directory, max_shard_size=TWO_SHARDS)
        run_save(directory, 2.0, TWO_SHARDS, first)
        names = set(os.listdir(directory))
        if SAFE_WEIGHTS_INDEX_NAME not in names and any(n.endswith(".bak") for n in names):
            break
    else:
        pytest.fail("no kill left a replaced shard behind a moved-away index")
    events = run_save(directory, 3.0, TWO_SHARDS, die_at=0)[1]  # the recovering save's events
    for die_at in range(1, events + 1):
        killed = tmp_path / f"second-{die_at}"
        write_checkpoint(state(1.0), killed, max_shard_size=TWO_SHARDS)
        run_save(killed, 2.0, TWO_SHARDS, first)
        code, _ = run_save(killed, 3.0, TWO_SHARDS, die_at)
        assert code == -signal.SIGKILL
        assert loaded_value(killed) in (1.0, 3.0), die_at
        write_checkpoint(state(4.0), killed, max_shard_size=TWO_SHARDS)
        assert loaded_value(killed) == 4.0
        assert leftovers(killed) == []


# ------------------------------------------------------------------------------ a failing file system


@contextlib.contextmanager
def failing_file_system(fail_at: int, *, from_then_on: bool = False) -> Iterator[list[int]]:
    """The ``fail_at``-th rename, hard link or fsync (and, ``from_then_on``, every later one) raises EIO."""
    calls = [0]
    reals = {name: getattr(os, name) for name in ("replace", "link", "fsync")}

    def failing(real):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == fail_at or (from_then_on and calls[0] > fail_at):
                raise OSError(errno.EIO, "Input/output error (injected)")
            return real(*args, **kwargs)

        return call

    for name, real in reals.items():
        setattr(os, name, failing(real))
    try:
        yield calls
    finally:
        for name, real in reals.items():
            setattr(os, name, real)


def steps_of(tmp_path: Path, before: int, after: int, as_file: bool) -> int:
    path = target(tmp_path / "probe-steps", as_file)
    write_checkpoint(state(1.0), path, max_shard_size=before)
    with failing_file_system(0) as calls:
        write_checkpoint(state(2.0), path, max_shard_size=after)
    return calls[0]


@pytest.mark.parametrize("transition", list(TRANSITIONS))
def test_a_save_failing_at_any_step_raises_and_leaves_the_directory_as_it_was(
    tmp_path: Path, transition: str
) -> None:
    before, after, as_file = TRANSITIONS[transition]
    raised = 0
    for step in range(1, steps_of(tmp_path, before, after, as_file) + 1):
        directory = tmp_path / f"fail-{step}"
        path = target(directory, as_file)
        write_checkpoint(state(1.0), path, max_shard_size=before)
        was = files(directory)
        try:
            with failing_file_system(step):
                write_checkpoint(state(2.0), path, max_shard_size=after)
        except surgery.CheckpointError as exc:
            raised += 1
            assert "previous checkpoint there (if any) is unchanged" in str(exc)
            assert files(directory) == was, step  # the same files, the very same inodes
            assert loaded_value(path) == 1.0
        else:  # the step had a fallback (no hard link: the backup is a rename) or is best effort
            assert loaded_value(path) == 2.0
            assert leftovers(directory) == []
    assert raised


@pytest.mark.parametrize("transition", list(TRANSITIONS))
def test_a_save_whose_file_system_fails_for_good_leaves_the_old_checkpoint_loadable_and_the_next_save_puts_it_back(
    tmp_path: Path, transition: str
) -> None:
    before, after, as_file = TRANSITIONS[transition]
    for step in range(1, steps_of(tmp_path, before, after, as_file) + 1):
        directory = tmp_path / f"fail-{step}"
        path = target(directory, as_file)
        write_checkpoint(state(1.0), path, max_shard_size=before)
        try:
            with failing_file_system(step, from_then_on=True):
                write_checkpoint(state(2.0), path, max_shard_size=after)
        except surgery.CheckpointError as exc:
            assert loaded_value(path) == 1.0, step
            kept = leftovers(directory)
            # Only files that hold the old checkpoint stay, and the error names each of them.
            assert all(n.endswith((".bak", ".old")) for n in kept), kept
            assert all(n in str(exc) for n in kept), (kept, str(exc))
        else:  # failing from the directory fsync after the commit on, which is best effort
            assert loaded_value(path) == 2.0
        write_checkpoint(state(3.0), path, max_shard_size=after)
        assert loaded_value(path) == 3.0
        assert leftovers(directory) == []


# ------------------------------------------------------------------------------ loads racing saves


def _save_loop(path: str, stop, saves) -> None:
    sizes = (TWO_SHARDS, SINGLE, FOUR_SHARDS)  # every transition between them, in turn
    i = 0
    while not stop.is_set():
        i += 1
        write_checkpoint(state(float(i)), path, max_shard_size=sizes[i % len(sizes)])
        saves.value = i
    os._exit(0)


class Four(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for k in KEYS:
            self.register_parameter(k, nn.Parameter(torch.zeros(16)))


def test_a_thousand_loads_racing_a_save_loop_each_load_exactly_one_save(tmp_path: Path) -> None:
    write_checkpoint(state(0.0), tmp_path, max_shard_size=TWO_SHARDS)
    ctx = mp.get_context("fork")
    stop, saves = ctx.Event(), ctx.Value("i", 0)
    saver = ctx.Process(target=_save_loop, args=(str(tmp_path), stop, saves))
    saver.start()
    seen: list[float] = []
    try:
        for _ in range(1000):
            model = Four()
            report = surgery.load_checkpoint(model, tmp_path, sync=True, mmap=False, progress=False)
            assert report.ok, report
            values = {float(v) for v in torch.cat([p.detach() for p in model.parameters()]).unique()}
            assert len(values) == 1, f"a model mixed from saves {sorted(values)}"
            seen.append(values.pop())
    finally:
        stop.set()
        saver.join(60)
    assert saves.value > 10  # the saver really raced the loads
    assert len(set(seen)) > 10  # and the loads saw many of its saves


def test_a_side_file_killed_before_its_rename_leaves_a_file_the_next_save_removes(tmp_path: Path) -> None:
    """config.json and the like are written through a token-named temporary file, like the shards."""
    write_checkpoint(state(1.0), tmp_path, max_shard_size=SINGLE)
    ctx = mp.get_context("fork")

    def write_and_die() -> None:
        os.replace = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        write_file_atomically(tmp_path / "config.json", b"{}")

    child = ctx.Process(target=write_and_die)
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    left = leftovers(tmp_path)
    assert len(left) == 1 and left[0].startswith(".config.json.") and left[0].endswith(".tmp")
    assert not (tmp_path / "config.json").exists()
    write_checkpoint(state(2.0), tmp_path, max_shard_size=SINGLE)
    assert leftovers(tmp_path) == []
    write_file_atomically(tmp_path / "config.json", b'{"a": 1}')
    assert (tmp_path / "config.json").read_bytes() == b'{"a": 1}' and leftovers(tmp_path) == []
