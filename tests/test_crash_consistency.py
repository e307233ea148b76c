"""A save killed at any moment, or racing a reader, never yields a model mixed from two saves.

Real processes, real files: a forked child runs ``write_checkpoint`` and SIGKILLs itself right
after the n-th file event of the save (every fsync of a written file and every rename of the
commit), for every n; then the directory is opened. And a saver process rewrites a sharded
checkpoint in a loop while this process loads it a thousand times.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

import surgery
from surgery.checkpoint import LEFTOVER_NAME, SAFE_WEIGHTS_INDEX_NAME, open_checkpoint, write_checkpoint

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
KEYS = [f"t{i}" for i in range(4)]
SHARDED = 3 * 64 + 1  # bytes per shard: 4 tensors of 64 bytes make 2 shards
SINGLE = 10**9


def state(value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full((16,), value) for k in KEYS}


def _save_and_die(path: str, value: float, shard_size: int, die_at: int, counter) -> None:
    events = [0]
    real_replace, real_fsync = os.replace, os.fsync

    def event() -> None:
        events[0] += 1
        counter.value = events[0]
        if events[0] == die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def replace(a, b):
        real_replace(a, b)
        event()

    def fsync(fd):
        real_fsync(fd)
        event()

    os.replace, os.fsync = replace, fsync  # type: ignore[assignment]
    write_checkpoint(state(value), path, max_shard_size=shard_size)
    os._exit(0)


def run_save(path: Path, value: float, shard_size: int, die_at: int) -> tuple[int, int]:
    """(exit code, events seen) of a forked save that kills itself at event ``die_at`` (0: never)."""
    ctx = mp.get_context("fork")
    counter = ctx.Value("i", 0)
    child = ctx.Process(target=_save_and_die, args=(str(path), value, shard_size, die_at, counter))
    child.start()
    child.join(60)
    return child.exitcode or 0, counter.value


def values_on_disk(path: Path) -> set[float] | str:
    """The distinct values the checkpoint holds, or the error opening it raised."""
    try:
        with open_checkpoint(path) as reader:
            assert reader.keys() == KEYS
            return {float(v) for k in KEYS for v in reader.get_tensor(k).unique()}
    except surgery.CheckpointError as exc:
        return str(exc)


TRANSITIONS = {
    "sharded -> sharded": (SHARDED, SHARDED),
    "single -> sharded": (SINGLE, SHARDED),
    "sharded -> single": (SHARDED, SINGLE),
}


@pytest.mark.parametrize("transition", sorted(TRANSITIONS))
def test_a_save_killed_at_any_event_leaves_the_old_checkpoint_the_new_one_or_a_clear_error(
    tmp_path, transition
):
    before, after = TRANSITIONS[transition]
    probe = tmp_path / "probe"
    write_checkpoint(state(1.0), probe, max_shard_size=before)
    code, total = run_save(probe, 2.0, after, die_at=0)
    assert code == 0 and total >= 3
    outcomes = []
    for die_at in range(1, total + 1):
        path = tmp_path / f"kill-{die_at}"
        write_checkpoint(state(1.0), path, max_shard_size=before)
        code, _ = run_save(path, 2.0, after, die_at)
        assert code == -signal.SIGKILL
        seen = values_on_disk(path)
        assert seen in ({1.0}, {2.0}) or (isinstance(seen, str) and "interrupted" in seen), (die_at, seen)
        outcomes.append(seen if isinstance(seen, set) else "error")
        write_checkpoint(state(3.0), path, max_shard_size=after)  # the next save recovers ...
        assert values_on_disk(path) == {3.0}
        assert not [p.name for p in path.iterdir() if LEFTOVER_NAME.fullmatch(p.name)]  # ... and cleans up
    assert outcomes[0] == {1.0} and outcomes[-1] == {2.0}


def test_a_killed_saves_temporary_files_are_removed_by_the_next_save(tmp_path: Path) -> None:
    write_checkpoint(state(1.0), tmp_path, max_shard_size=SHARDED)
    for die_at in (1, 2, 3):
        run_save(tmp_path, 2.0, SHARDED, die_at)
    assert [p for p in tmp_path.iterdir() if LEFTOVER_NAME.fullmatch(p.name)]
    write_checkpoint(state(4.0), tmp_path, max_shard_size=SHARDED)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        SAFE_WEIGHTS_INDEX_NAME,
    ]


def _save_loop(path: str, stop, saves) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        write_checkpoint(state(float(i)), path, max_shard_size=SHARDED)
        saves.value = i
    os._exit(0)


class Four(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for k in KEYS:
            self.register_parameter(k, nn.Parameter(torch.zeros(16)))


def test_loads_racing_a_save_loop_never_see_two_saves(tmp_path: Path) -> None:
    write_checkpoint(state(0.0), tmp_path, max_shard_size=SHARDED)
    ctx = mp.get_context("fork")
    stop, saves = ctx.Event(), ctx.Value("i", 0)
    saver = ctx.Process(target=_save_loop, args=(str(tmp_path), stop, saves))
    saver.start()
    loaded = refused = 0
    try:
        for _ in range(1000):
            model = Four()
            try:
                report = surgery.load_checkpoint(model, tmp_path, sync=True, mmap=False, progress=False)
            except surgery.CheckpointError:
                refused += 1
                continue
            assert report.ok, report
            values = {float(v) for v in torch.cat([p.detach() for p in model.parameters()]).unique()}
            assert len(values) == 1, f"a model mixed from saves {sorted(values)}"
            loaded += 1
    finally:
        stop.set()
        saver.join(60)
    assert saves.value > 10  # the saver really raced the loads
    assert loaded > 900, (loaded, refused)
