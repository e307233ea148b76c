"""Benchmarks: runnable timing scripts (not tests); each module has ``run()`` and ``main()``.

Run them as ``surgery bench NAME [options]``; :func:`parser` gives each the same program name
and plain-text help, and :func:`positive_int` refuses counts that would divide by zero.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["parser", "positive_int"]


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
