"""Provenance: where each character of a routed output was copied from, and formats built on it.

:class:`~surgery.fastroute.TemplateRouter` routes one representative key per class under a few
*probes* (the class's free digits set to chosen values). An output character that is the same
under every probe is literal; one that follows the probes spells out which free digit of the key
it copies (:func:`provenance`). A provenance compresses into :data:`Pieces` (literal text and
slices of the key, :func:`to_pieces`) and compiles into a :data:`Format` (a %-template and a
getter, :func:`compile_format`) that rebuilds the output from any key of the class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter

__all__ = [
    "Format",
    "Pieces",
    "Provenance",
    "compile_format",
    "isolated",
    "provenance",
    "scope_dependence",
    "to_pieces",
]

_DIGITS = frozenset("0123456789")
_PROBE = _DIGITS | {"."}

Pieces = tuple["str | tuple[int, int]", ...]

Format = tuple[str, "Callable[[str], str | tuple[str, ...]] | None"]


def compile_format(pieces: Pieces) -> Format:
    """A format as ``(%-template, getter of its slices)``; no getter when it is literal.

    ``template % getter(key)`` is the output: the getter returns the one slice's text, or a
    tuple of them (``%`` is about a third cheaper than ``str.format`` here).
    """
    parts: list[str] = []
    slices: list[slice] = []
    for p in pieces:
        if isinstance(p, str):
            parts.append(p.replace("%", "%%"))
        else:
            parts.append("%s")
            slices.append(slice(*p))
    if not slices:
        return "".join(p for p in pieces if isinstance(p, str)), None
    return "".join(parts), itemgetter(*slices)


class Provenance(list):  # type: ignore[type-arg]
    """Per output position: the literal character, or which free digit it was copied from.

    ``copied`` lists the positions holding a copy, in order.
    """

    __slots__ = ("copied",)

    def __init__(self, text: str, copies: dict[int, int]) -> None:
        super().__init__(text)
        for p, i in copies.items():
            self[p] = i
        self.copied = sorted(copies)


def provenance(strings: Sequence[str], n_free: int) -> Provenance | None:
    """Where each character of one output comes from, given that output under every probe.

    ``strings`` are probe 0's output first; ``None`` when they disagree in a way no copy explains.
    """
    base = strings[0]
    size = len(base)
    if any(len(s) != size for s in strings):
        return None
    zeros = []  # a copied free digit is 0 under probe 0
    p = base.find("0")
    while p >= 0:
        zeros.append(p)
        p = base.find("0", p + 1)
    varying: set[int] = set()
    for s in strings[1:]:
        if s != base:
            diff = [p for p in zeros if s[p] != "0"]
            rest = s
            for p in diff:
                rest = f"{rest[:p]}0{rest[p + 1 :]}"
            if rest != base:  # a difference where probe 0 has no 0: no copy explains it
                return None
            varying.update(diff)
    copies: dict[int, int] = {}
    for p in varying:
        i = 0
        for d, s in enumerate(strings[1:]):
            c = s[p]
            if not "1" <= c <= "9":
                return None
            i += (ord(c) - 49) * 9**d
        if i >= n_free:
            return None
        copies[p] = i
    return Provenance(base, copies)


def to_pieces(prov: Provenance, free: tuple[int, ...]) -> Pieces:
    """Compress a provenance into literal strings and ``(start, stop)`` slices of the key."""
    out: list[str | tuple[int, int]] = []
    done = 0  # prov[:done] is in out
    for p in prov.copied:
        pos = free[prov[p]]
        if p > done:
            out.append("".join(prov[done:p]))
        elif out and out[-1][1] == pos:  # right after the previous copy, and contiguous in the key
            out[-1] = (out[-1][0], pos + 1)  # type: ignore[index,assignment]
            done = p + 1
            continue
        out.append((pos, pos + 1))
        done = p + 1
    if done < len(prov):
        out.append("".join(prov[done:]))
    return tuple(out)


def isolated(prov: Provenance) -> bool:
    """Whether every copied free digit still sits between digits, dots and the string ends."""
    last = len(prov) - 1
    for p in prov.copied:
        for q in (p - 1, p + 1):
            if 0 <= q <= last:
                nb = prov[q]
                if nb.__class__ is str and nb not in _PROBE:
                    return False
    return True


def scope_dependence(prov: Provenance, scope: str, free: tuple[int, ...]) -> set[int]:
    """Key positions whose free digit decides whether ``key.startswith(scope + ".")``."""
    head = scope + "."
    if len(prov) < len(head):
        return set()
    dep: set[int] = set()
    for q, ch in enumerate(head):
        x = prov[q]
        if isinstance(x, str):
            if x != ch:
                return set()  # a fixed character already decides: never in scope
        elif ch in _DIGITS:
            dep.add(free[x])
        else:
            return set()  # a digit never equals a non-digit
    return dep
