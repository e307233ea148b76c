"""The records of a routing: how each key travels, and the target groups it fills.

:func:`~surgery.routing.route_keys` returns a :class:`Routing`: per checkpoint key a
:class:`KeyRoute` (read from a :class:`RouteTable`, which makes them on access from the decisions
that keys of one shape share), the :class:`TargetGroup` objects the loader materializes, and the
:class:`RouteConflict` list. :mod:`surgery.routing` re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .fastroute import KeyClass, Selections
from .transforms import WeightTransform

__all__ = ["IndexCache", "KeyRoute", "RouteConflict", "RouteTable", "Routing", "TargetGroup"]


class KeyRoute(NamedTuple):
    """How one checkpoint key travels (an immutable record; a loader reads one per key).

    Attributes:
        source_key: the key as stored in the checkpoint.
        target_key: the runtime key it becomes (for a converter: the group's first target key).
        renamings: indices (into the transform list) of the renamings that fired, in order.
        converter: index of the converter that claimed the key, or ``None``.
        pattern_index: which source pattern of that converter matched.
        index: the wildcard indices, when the converter gathers (merges) keys.
        base_prefix: how ``base_model_prefix`` was used: ``"+after"`` / ``"-after"`` when it was
            added to / stripped from the routed targets, ``"+"`` / ``"-"`` when it was added to /
            stripped from the checkpoint key before routing, ``""`` when it was not needed.
    """

    source_key: str
    target_key: str
    renamings: tuple[int, ...] = ()
    converter: int | None = None
    pattern_index: int | None = None
    index: tuple[int, ...] = ()  # type: ignore[assignment]  # a field, shadowing tuple.index
    base_prefix: str = ""


@dataclass(slots=True)
class TargetGroup:
    """The checkpoint keys that together produce one set of runtime keys.

    Attributes:
        key: the group's identity: its first target key.
        converter: index of the converter, or ``None`` for a plain (renamed or untouched) tensor.
        target_keys: the runtime keys produced (``*`` is filled when the op chain returns a list).
        sources: per converter source pattern, ``{wildcard index: checkpoint key}`` (a mapping:
            its order is not promised; :attr:`source_keys` is ordered).
    """

    key: str
    converter: int | None
    target_keys: tuple[str, ...]
    sources: dict[int, dict[tuple[int, ...], str]] = field(default_factory=dict)

    @property
    def source_keys(self) -> list[str]:
        """Checkpoint keys in pattern order, then wildcard-index order."""
        return [k for i in sorted(self.sources) for _, k in sorted(self.sources[i].items())]


@dataclass(frozen=True)
class RouteConflict:
    """Two checkpoint keys that land on the same place."""

    target_key: str
    first: str
    second: str

    def __str__(self) -> str:
        return f"{self.first!r} and {self.second!r} both land on {self.target_key!r}"


_new_route = tuple.__new__  # KeyRoute without its keyword handling: every field given, in order


def _index_of(text: str) -> tuple[int, ...]:
    """The index tuple of a non-empty index text (shared for small indices)."""
    i = int(text)
    return _SMALL_INDICES[i] if i < len(_SMALL_INDICES) else (i,)


class RouteTable(Mapping[str, KeyRoute]):
    """Checkpoint key → :class:`KeyRoute`, read-only; routes are made on access.

    Keys of one shape share one decision; storing that decision instead of one object per key is
    what keeps routing a large checkpoint cheap. The table itself is built on first use (many
    callers only need :attr:`Routing.groups`), and a route is made on first access and kept.
    Iteration follows the order the keys were given in.
    """

    __slots__ = ("_index_of", "_made", "_parts")

    def __init__(
        self,
        keys: list[str],
        caches: list[Selections] | None = None,
        routed: dict[str, KeyRoute] | None = None,
        cache_roots: Mapping[tuple[int, int], KeyClass] | None = None,
    ) -> None:
        # ``caches[i]`` is the cache ``keys[i]`` was filed through, and ``cache_roots`` maps
        # ``(id(cache), len(key))`` to the key's template root (roots of one width family share
        # a cache; their keys differ in length). ``routed`` holds the keys that were routed on
        # their own (their KeyRoute replaces the root). Without ``caches`` every key is in ``routed``.
        self._parts: tuple[list[str], list[Selections] | None, dict[str, KeyRoute], Any] | None = (
            keys,
            caches,
            routed if routed is not None else {},
            cache_roots if cache_roots is not None else {},
        )
        self._made: dict[str, KeyRoute | KeyClass] | None = None
        self._index_of = IndexCache()

    @property
    def _entries(self) -> dict[str, KeyRoute | KeyClass]:
        made = self._made
        if made is None:
            keys, caches, routed, root_of = self._parts  # type: ignore[misc]
            if caches is None:
                made = dict(routed)
            else:
                made = dict(zip(keys, map(root_of.__getitem__, zip(map(id, caches), map(len, keys)))))
                made.update(routed)
            self._made, self._parts = made, None
        return made

    def __getitem__(self, key: str) -> KeyRoute:
        entries = self._made if self._made is not None else self._entries
        entry = entries[key]
        if entry.__class__ is KeyRoute:
            return entry  # type: ignore[return-value]
        c: KeyClass = entry  # type: ignore[assignment]
        while c.sb:  # KeyClass.walk, first_of and index, inlined: a loader reads every route
            c = c.children[key[c.sa : c.sb]]
        fmt, get = c.cfirst
        first = fmt if get is None else fmt % get(key)
        if c.hot:
            index = self._index_of[key[c.ia : c.ib]]
        else:
            index = c.index(key)
        route = _new_route(KeyRoute, (key, first, c.fired, c.conv, c.pat, index, ""))
        entries[key] = route  # made once; the loader reads each route more than once
        return route

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __repr__(self) -> str:
        return f"RouteTable({len(self._entries)} keys)"


@dataclass
class Routing:
    """The result of :func:`route_keys`.

    Attributes:
        transforms: the transform list the keys went through.
        routes: every routed key's :class:`KeyRoute` (a :class:`RouteTable` or a ``dict``).
        groups: target groups by first target key, in the order their first key was routed.
        conflicts: keys refused because another key already landed there, in routing order.
    """

    transforms: tuple[WeightTransform, ...]
    routes: Mapping[str, KeyRoute]
    groups: dict[str, TargetGroup]
    conflicts: list[RouteConflict]

    def fired(self, source_keys: Iterable[str] | None = None) -> list[int]:
        """Indices of the transforms that fired on ``source_keys`` (all routed keys by default)."""
        raw: Mapping[str, Any] = self.routes._entries if isinstance(self.routes, RouteTable) else self.routes
        keys = raw.keys() if source_keys is None else source_keys
        seen: set[int] = set()
        shared: set[int] = set()
        for k in keys:
            e = raw[k]
            if e.__class__ is not KeyRoute:
                e = e.walk(k)
            if e.__class__ is KeyRoute:
                renamings, converter = e.renamings, e.converter
            elif id(e) in shared:
                continue
            else:
                shared.add(id(e))
                renamings, converter = e.fired, e.conv
            seen.update(renamings)
            if converter is not None:
                seen.add(converter)
        return sorted(seen)


# Index tuples of small indices, made once: after the cycle collector has looked at them once it
# stops tracking them, and a dict whose keys are untracked tuples and whose values are strings
# is not tracked either, so a routing result's group slots cost the collector nothing.
_SMALL_INDICES = tuple((i,) for i in range(4096))


class IndexCache(dict):  # type: ignore[type-arg]
    """Index text → index tuple (``""`` → ``()``), made once per distinct text."""

    def __missing__(self, text: str) -> tuple[int, ...]:
        value = self[text] = _index_of(text) if text else ()
        return value
