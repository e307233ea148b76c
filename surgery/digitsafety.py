r"""Static analysis: can a regex tell the digits of a numeric key component apart?

:mod:`surgery.fastroute` lets keys that differ only in their numeric components share one
routing decision, which is exact only when no pattern of the transform list can tell those
digits apart. This module answers that question from the parsed regex, without running it (the
argument is in :mod:`surgery.fastroute`'s docstring):

* :data:`UNIFORM`: every single-character test accepts all ten digits or none of them;
* :data:`GUARDED`: a test accepts only some digits, but sits next to a *guard* (a test that
  accepts no digit and no dot, the ``w`` of ``w1``), so it never sees a free digit;
* :data:`UNSAFE`: anything else (a digit literal such as ``layers\.0\.``, a subset such as
  ``[0-3]``, a backreference, a construct the analysis does not know).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

try:  # Python 3.11+
    from re import _constants as _sre  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

if TYPE_CHECKING:
    from .transforms import WeightTransform

__all__ = ["GUARDED", "UNIFORM", "UNSAFE", "pattern_safety", "transform_safety"]

UNIFORM = 0  #: every character test accepts all digits or none
GUARDED = 1  #: uniform as long as free digits sit between digits, dots and the string ends
UNSAFE = 2  #: a test may tell free digits apart; the list must route every key exactly

_DIGITS = frozenset("0123456789")
_PROBE = _DIGITS | {"."}


class _Unsafe(Exception):
    """A regex construct the analysis does not understand (always treated as unsafe)."""


def _op(name: str) -> object:
    return getattr(_sre, name, object())  # a fresh object never equals a real opcode


_LITERAL, _NOT_LITERAL, _ANY, _IN = _op("LITERAL"), _op("NOT_LITERAL"), _op("ANY"), _op("IN")
_RANGE, _NEGATE, _CATEGORY = _op("RANGE"), _op("NEGATE"), _op("CATEGORY")
_AT, _BRANCH, _SUBPATTERN = _op("AT"), _op("BRANCH"), _op("SUBPATTERN")
_ASSERTS = (_op("ASSERT"), _op("ASSERT_NOT"))
_REPEATS = (_op("MAX_REPEAT"), _op("MIN_REPEAT"), _op("POSSESSIVE_REPEAT"))
_ATOMIC = _op("ATOMIC_GROUP")
_CATEGORIES: dict[object, frozenset[str]] = {
    _op("CATEGORY_DIGIT"): _DIGITS,
    _op("CATEGORY_NOT_DIGIT"): frozenset("."),
    _op("CATEGORY_WORD"): _DIGITS,
    _op("CATEGORY_NOT_WORD"): frozenset("."),
    _op("CATEGORY_SPACE"): frozenset(),
    _op("CATEGORY_NOT_SPACE"): _PROBE,
    _op("CATEGORY_LINEBREAK"): frozenset(),
    _op("CATEGORY_NOT_LINEBREAK"): _PROBE,
}


def _accepts(op: object, av: Any) -> frozenset[str] | None:
    """Which of ``0-9`` and ``.`` a single-character test accepts; ``None`` for other nodes."""
    if op is _LITERAL:
        return _PROBE & {chr(av)}
    if op is _NOT_LITERAL:
        return _PROBE - {chr(av)}
    if op is _ANY:
        return _PROBE
    if op is not _IN:
        return None
    got: set[str] = set()
    negate = False
    for item_op, item in av:
        if item_op is _NEGATE:
            negate = True
        elif item_op is _LITERAL:
            got.add(chr(item))
        elif item_op is _RANGE:
            got.update(c for c in _PROBE if item[0] <= ord(c) <= item[1])
        elif item_op is _CATEGORY and item in _CATEGORIES:
            got.update(_CATEGORIES[item])
        else:
            raise _Unsafe(item_op)
    return frozenset(_PROBE - got if negate else _PROBE & got)


def _is_guard(items: list[tuple[object, Any]], j: int) -> bool:
    if not 0 <= j < len(items):
        return False
    acc = _accepts(*items[j])
    return acc is not None and not acc


def _sequence_safety(items: list[tuple[object, Any]]) -> int:
    worst = UNIFORM
    for idx, (op, av) in enumerate(items):
        acc = _accepts(op, av)
        if acc is not None:
            digits = acc & _DIGITS
            if digits and digits != _DIGITS:
                if not (_is_guard(items, idx - 1) or _is_guard(items, idx + 1)):
                    return UNSAFE
                worst = GUARDED
            continue
        if op is _AT:
            continue  # anchors and \b: every digit is a word character
        if op is _BRANCH:
            parts = av[1]
        elif op is _SUBPATTERN or op in _ASSERTS or op in _REPEATS:
            parts = [av[-1]]
        elif op is _ATOMIC:
            parts = [av]
        else:
            return UNSAFE  # backreferences, conditionals, anything unknown
        for part in parts:
            worst = max(worst, _sequence_safety(list(part)))
            if worst == UNSAFE:
                return UNSAFE
    return worst


@lru_cache(maxsize=4096)
def pattern_safety(pattern: str, flags: int = 0) -> int:
    r"""Classify a compiled regex: :data:`UNIFORM`, :data:`GUARDED` or :data:`UNSAFE`.

    Args:
        pattern: regex text (as compiled, e.g. ``SourcePattern.regex.pattern``).
        flags: the regex flags.

    Returns:
        How the regex treats free digits (see the module docstring).

    Example:
        >>> pattern_safety(r"experts\.(\d+)\.w1\.weight") == GUARDED
        True
        >>> pattern_safety(r"layers\.0\.") == UNSAFE
        True
    """
    try:
        return _sequence_safety(list(_sre_parse.parse(pattern, flags)))
    except Exception:  # _Unsafe, or a parser this analysis does not know: never share
        return UNSAFE


def transform_safety(transform: WeightTransform) -> int:
    """The worst :func:`pattern_safety` over a transform's compiled source patterns."""
    return max(pattern_safety(sp.regex.pattern, sp.regex.flags) for sp in transform._sources)
