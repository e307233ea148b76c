"""The measuring tools every benchmark shares: timing, memory, page cache, a fork server, tables.

* :func:`best_time`, :func:`positive_int`, :func:`parser`: how a benchmark times a call, takes a
  count and describes itself on the command line.
* :func:`peak_rss`, :func:`reset_peak_rss`: the high-water mark of resident memory of this process
  (``VmHWM``, resettable on Linux).
* :func:`warm`, :func:`drop_page_cache`, :func:`madvise`: page-cache and page-fault control for the
  load benchmarks (Linux; elsewhere they say what they could not do); :func:`fsynced_save_file`,
  the floor of a durable save.
* :func:`serve` and :class:`Servers`: a fork server, so every run is a fresh process that has
  already imported its modules.
* :class:`Row`, :func:`measure`, :func:`interleaved`, :func:`table`, :func:`verdict`: best-of runs
  of each variant, and the table and target lines they print as.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "MADV_HUGEPAGE",
    "MADV_POPULATE_WRITE",
    "MB",
    "Row",
    "Servers",
    "best_time",
    "drop_page_cache",
    "end_rank",
    "fsynced_save_file",
    "interleaved",
    "madvise",
    "measure",
    "median_per_call",
    "parser",
    "peak_rss",
    "positive_int",
    "reset_peak_rss",
    "result_of",
    "serve",
    "summary",
    "table",
    "verdict",
    "warm",
]

MB = 2**20
"""One MiB, the unit of the memory columns."""

MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
"""``madvise`` advice values from Linux's ``<asm-generic/mman-common.h>`` (not in Python's ``mmap``)."""


# --------------------------------------------------------------------------- command line and timing


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """The shortest wall time of ``repeat`` calls of ``fn``, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def median_per_call(
    fns: Mapping[str, Callable[[], Any]], *, device: str, rounds: int, min_run_time: float
) -> dict[str, float]:
    """Median seconds per call of each function, measured in interleaved rounds (the device
    synchronized around each run on CUDA).

    Each round runs every function for about ``min_run_time / rounds`` seconds, in turn, so load
    drift on a shared machine hits all of them alike.
    """
    per_call: dict[str, list[float]] = {name: [] for name in fns}
    numbers: dict[str, int] = {}
    for name, fn in fns.items():  # warm up and size the inner loop
        fn()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        once = max(time.perf_counter() - start, 1e-7)
        numbers[name] = max(1, int(min_run_time / rounds / once))
    for _ in range(rounds):
        for name, fn in fns.items():
            n = numbers[name]
            _sync(device)
            start = time.perf_counter()
            for _ in range(n):
                fn()
            _sync(device)
            per_call[name].append((time.perf_counter() - start) / n)
    return {name: statistics.median(times) for name, times in per_call.items()}


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (one line of error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The argument parser of ``surgery bench NAME``, described by the first line of ``doc`` in plain text."""
    first = (doc or "").strip().split("\n\n")[0].replace("\n", " ")
    return argparse.ArgumentParser(
        prog=f"surgery bench {name}", description=re.sub(r"``([^`]*)``", r"\1", first)
    )


def end_rank() -> None:
    """Leave a spawned rank's process now that its results are on disk and its group destroyed.

    A gloo group that DTensor's caches keep alive is freed while the interpreter tears down, and
    that can abort the process by thread timing ("terminate called without an active exception",
    SIGABRT; pytorch#65231), which ``torch.multiprocessing.spawn`` reports as a failed rank.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- memory


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> int:
    """Reset the peak-RSS mark to the current RSS (Linux) and return the mark."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status("VmRSS:")
    except OSError:
        return peak_rss()


def peak_rss() -> int:
    """Peak RSS of this process.

    ``ru_maxrss`` survives ``fork`` + ``exec`` (a child starts with its parent's peak), so on Linux
    the per-address-space high-water mark ``VmHWM`` is read instead.
    """
    try:
        return _status("VmHWM:")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------- page cache and page faults


def _files(paths: Sequence[Path]) -> list[Path]:
    """The safetensors files under each directory of ``paths``, and each plain file."""
    return [f for p in paths for f in (sorted(p.rglob("*.safetensors")) if p.is_dir() else [p])]


def warm(paths: Sequence[Path]) -> None:
    """Read every file once so that all variants start from a warm page cache."""
    for f in _files(paths):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 * MB):
                continue


def _resident_fraction(path: Path) -> float | None:
    """The fraction of ``path``'s pages in the page cache (``mincore``), or ``None`` off Linux."""
    import ctypes
    import mmap

    size = path.stat().st_size
    if size == 0 or not sys.platform.startswith("linux"):
        return None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        page = mmap.PAGESIZE
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        buf = ctypes.c_char.from_buffer(mm)
        try:
            if libc.mincore(ctypes.addressof(buf), size, vec) != 0:
                return None
        finally:
            del buf
        return sum(v & 1 for v in vec) / len(vec)


def drop_page_cache(paths: Sequence[str]) -> str:
    """``posix_fadvise(DONTNEED)`` every checkpoint file; say how much of them stayed cached."""
    files = _files([Path(p) for p in paths if p])
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            return f"not allowed ({exc})"
        finally:
            os.close(fd)
    sizes = [f.stat().st_size for f in files]
    fractions = [_resident_fraction(f) for f in files]
    if any(x is None for x in fractions):
        return "dropped (residency unknown)"
    cached = sum(x * n for x, n in zip(fractions, sizes) if x is not None) / max(sum(sizes), 1)
    return f"cache dropped, {cached:.0%} still resident"


def madvise(t: torch.Tensor, lo: int, hi: int, advice: int, *, inward: int) -> str:
    """``madvise(advice)`` on bytes ``[lo, hi)`` of ``t``'s memory, shrunk to multiples of ``inward``
    bytes (pages; 2 MiB for huge pages: only whole ones can be advised); Linux only."""
    import ctypes

    start = (t.data_ptr() + lo + inward - 1) & ~(inward - 1)
    end = (t.data_ptr() + hi) & ~(inward - 1)
    if end <= start or not sys.platform.startswith("linux"):
        return "not applicable"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return "ok" if libc.madvise(start, end - start, advice) == 0 else f"refused (errno {ctypes.get_errno()})"


def fsynced_save_file(state: dict[str, torch.Tensor], file: Path) -> None:
    """``safetensors.torch.save_file`` and ``fsync``: the floor of a durable save."""
    from safetensors.torch import save_file

    save_file(state, file)
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the fork server


def serve(child: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """A fork server: fork one fresh process per spec read from stdin, which runs ``child(spec)``.

    The caller imports what the runs need first, so every run pays its own one-time work but not
    the interpreter start-up. Results go back one JSON line per spec (``{"result": ...}`` or
    ``{"error": ...}``).
    """
    for line in sys.stdin:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: stdout belongs to the protocol, so talk to stderr only
            os.close(read_end)
            os.dup2(2, 1)
            try:
                reply: dict[str, Any] = {"result": child(json.loads(line))}
            except BaseException as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            with os.fdopen(write_end, "w") as pipe:
                json.dump(reply, pipe)
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            data = pipe.read()
        os.waitpid(pid, 0)
        sys.stdout.write((data or json.dumps({"error": "the run died without a result"})) + "\n")
        sys.stdout.flush()


class Servers:
    """Fork servers started on first use: ``command(spec)`` is the argv of the server a spec runs in
    (one server per distinct argv, e.g. one with and one without transformers imported)."""

    def __init__(self, command: Callable[[dict[str, Any]], list[str]]) -> None:
        self._command = command
        self._procs: dict[tuple[str, ...], subprocess.Popen[str]] = {}

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        """One run of ``spec`` in a fresh forked process; its result, or ``RuntimeError`` with its error."""
        cmd = tuple(self._command(spec))
        proc = self._procs.get(cmd)
        if proc is None or proc.poll() is not None:
            proc = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self._procs[cmd] = proc
        if proc.stdin is None or proc.stdout is None:
            raise RuntimeError("the fork server has no pipes")
        proc.stdin.write(json.dumps(spec) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited ({proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["result"]

    def close(self) -> None:
        """End every server (each exits when its stdin closes) and wait for it."""
        for proc in self._procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait()
        self._procs.clear()


# --------------------------------------------------------------------------- best-of runs and tables


@dataclass
class Row:
    """One line of a table: a variant's best-of result, or the error that stopped it."""

    name: str
    label: str
    result: dict[str, Any] | None
    error: str = ""


def _best_of(servers: Servers, spec: dict[str, Any], repeat: int, budget_s: float) -> dict[str, Any]:
    """Run ``spec`` up to ``repeat`` times, each in a fresh forked process: fastest run, worst peak.

    Runs stop early once they took ``budget_s`` together: a variant that slow is far from any
    target, and best-of-N only matters against noise on short runs.
    """
    runs = [servers.run(spec)]
    while len(runs) < repeat and sum(r["total_s"] for r in runs) < budget_s:
        runs.append(servers.run(spec))
    return summary(runs)


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from several runs of a variant: the fastest run, the worst peak, every time."""
    best = dict(min(runs, key=lambda r: r["total_s"]))
    best["delta"] = max(r["delta"] for r in runs)
    best["peak"] = max(r["peak"] for r in runs)
    best["runs"] = [round(r["total_s"], 3) for r in runs]
    return best


def measure(
    servers: Servers,
    rows: list[Row],
    name: str,
    label: str,
    spec: dict[str, Any],
    repeat: int,
    budget_s: float = 8.0,
) -> None:
    """Append the row of variant ``name``: the best of up to ``repeat`` fresh-process runs."""
    print(f"  running {label.strip()} ...", file=sys.stderr, flush=True)
    try:
        rows.append(Row(name, label, _best_of(servers, {**spec, "variant": name}, repeat, budget_s)))
    except RuntimeError as exc:
        rows.append(Row(name, label, None, str(exc)[:200]))


def interleaved(
    servers: Servers, rows: list[Row], variants: list[tuple[str, str, dict[str, Any]]], repeat: int
) -> None:
    """Like :func:`measure` for several variants whose runs take turns (one of each per round).

    Each round is compared on its own (``runs[i]`` of every variant), so a slow spell of the
    shared machine lands on a floor and the runs measured against it alike.
    """
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
    errors: dict[str, str] = {}
    for _ in range(repeat):
        for name, label, spec in variants:
            if name in errors:
                continue
            print(f"  running {label.strip()} ...", file=sys.stderr, flush=True)
            try:
                runs[name].append(servers.run({**spec, "variant": name}))
            except RuntimeError as exc:
                errors[name] = str(exc)[:200]
    for name, label, _ in variants:
        if name in errors:
            rows.append(Row(name, label, None, errors[name]))
        else:
            rows.append(Row(name, label, summary(runs[name])))


def result_of(rows: list[Row], name: str) -> dict[str, Any] | None:
    """The result of variant ``name`` (``None`` when it failed or did not run)."""
    return next((r.result for r in rows if r.name == name), None)


def table(rows: list[Row], floor: str, model_bytes: int) -> str:
    """The rows as a table; ``x floor`` is each time over variant ``floor``'s."""
    ref = result_of(rows, floor)
    head = (
        f"  {'variant':<55} {'best s':>7} {'load s':>7} {'x floor':>8} {'peak MiB':>9} {'+MiB':>6} "
        f"{'+/model':>7}  runs (s); notes"
    )
    lines = [head, "  " + "-" * (len(head) + 8)]
    for r in rows:
        if r.result is None:
            lines.append(f"  {r.label:<55} {'failed':>7}  {r.error}")
            continue
        res = r.result
        ratio = f"{res['total_s'] / ref['total_s']:.2f}x" if ref else "-"
        grow = res.get("delta", res.get("extra")) or 0
        runs = "/".join(f"{t:.2f}" for t in res.get("runs", [res["total_s"]]))
        lines.append(
            f"  {r.label:<55} {res['total_s']:>7.3f} {res['load_s']:>7.3f} {ratio:>8} {res['peak'] / MB:>9.0f} "
            f"{grow / MB:>6.0f} {grow / model_bytes:>7.2f}  {runs}; {res.get('notes', '')}"
        )
    return "\n".join(lines)


def verdict(ok: bool | None, text: str) -> str:
    """One target line: PASS, MISS, or n/a when it was not measured."""
    tag = "n/a " if ok is None else ("PASS" if ok else "MISS")
    return f"  [{tag}] {text}"
