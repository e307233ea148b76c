"""Benchmarks: runnable timing scripts (not tests); each module has ``run()`` and ``main()``.

Run them as ``surgery bench NAME [options]``; :func:`parser` gives each the same program name
and plain-text help, :func:`positive_int` refuses counts that would divide by zero, and
:func:`best_time` times a call the same way everywhere.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable

__all__ = ["best_time", "parser", "positive_int"]


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """The shortest wall time of ``repeat`` calls of ``fn``, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


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
