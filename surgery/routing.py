"""Routing: send every checkpoint key through a transform list, once.

:func:`route_keys` is the seam between the transform engine and the loader. For each checkpoint
key it applies every matching renaming (in order, chained), then lets at most one converter claim
the result, and files the key under the *target group* it feeds. A target group is what the
loader materializes as one unit: a plain tensor, or every key a converter gathers for one runtime
parameter (all experts of one layer, say).

Routing is exact and cheap: keys that share a shape (the same text up to their numeric indices)
share one routing decision wherever the patterns provably cannot tell indices apart (see
:mod:`surgery.fastroute`); per key only slices of the key are read. :class:`KeyRoute` objects are
made on access from those shared decisions (:class:`RouteTable`).

How the per-key work stays in C: keys go through in chunks (what a chunk allocates stays in
the CPU caches). Per chunk, one translate gives every key's template, and a chain of ``map``
calls looks up each key's cached *verdict* (a callable that files it) and applies it, so the
interpreter runs no bytecode for a key whose verdict is cached; the first key of a selection
makes the verdict in Python (:meth:`_Filer.miss`). Verdicts append to a list per group slot,
and :meth:`_Filer.merge` turns each list into its slot with three more C-level passes. That
deferral is optimistic: a collision (a conflict or a duplicate key) restarts the call with
keys filed one at a time, which reports conflicts exactly as the per-key path does.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import partial
from itertools import compress, repeat
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

from .errors import ConfigurationError
from .fastroute import Decision, KeyClass, Selections, TemplateRouter, key_template, key_templates
from .gcpause import gc_paused
from .transforms import WeightConverter, WeightTransform, split_transforms


def _call(fn: Callable[..., Any], /, *args: Any) -> Any:
    return fn(*args)


call: Callable[..., Any] = getattr(operator, "call", _call)  # C-level from Python 3.11


__all__ = ["KeyRoute", "RouteConflict", "RouteTable", "Routing", "TargetGroup", "route_key", "route_keys"]


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
        roots: Iterable[KeyClass] = (),
    ) -> None:
        # ``caches[i]`` is the cache of ``keys[i]``'s template root, one of ``roots``; ``routed``
        # holds the keys that were routed on their own (their KeyRoute replaces the root).
        # Without ``caches`` every key is in ``routed``.
        self._parts: tuple[list[str], list[Selections] | None, dict[str, KeyRoute], Any] | None = (
            keys,
            caches,
            routed if routed is not None else {},
            {id(r.cache): r for r in roots},
        )
        self._made: dict[str, KeyRoute | KeyClass] | None = None
        self._index_of = _IndexCache()

    @property
    def _entries(self) -> dict[str, KeyRoute | KeyClass]:
        made = self._made
        if made is None:
            keys, caches, routed, root_of = self._parts  # type: ignore[misc]
            if caches is None:
                made = dict(routed)
            else:
                made = dict(zip(keys, map(root_of.__getitem__, map(id, caches))))
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


class _Router:
    """A transform list compiled for routing; reusable across keys."""

    def __init__(self, transforms: Sequence[WeightTransform]) -> None:
        self.transforms = tuple(transforms)
        renamings, converters = split_transforms(self.transforms)
        index = {id(t): i for i, t in enumerate(self.transforms)}
        self.renamings = [(index[id(t)], t) for t in renamings]
        self.converters = [(index[id(t)], t) for t in converters]
        self._gathers = {i: t.gathers for i, t in self.converters}

    def route(self, key: str) -> Decision:
        """Exact routing of one key: (first target, renamings, converter, pattern, stars, all targets)."""
        fired: list[int] = []
        current = key
        for i, t in self.renamings:
            renamed, pattern = t.rename_source_key(current)
            if pattern is not None:
                fired.append(i)
                current = renamed
        claimed: tuple[int, WeightConverter] | None = None
        for i, c in self.converters:
            m = c.match(current)
            if m is None:
                continue
            if claimed is not None:
                raise ConfigurationError(
                    f"Two converters claim checkpoint key {key!r} (renamed to {current!r}): "
                    f"{claimed[1]!r} and {c!r}. Make their source patterns disjoint."
                )
            claimed = (i, c)
            match = m
        if claimed is None:
            return current, tuple(fired), None, None, (), (current,)
        i, c = claimed
        targets = c.target_keys(match)
        stars = match.stars if self._gathers[i] else ()
        return targets[0], tuple(fired), i, match.pattern_index, stars, targets


def route_key(key: str, transforms: Sequence[WeightTransform]) -> KeyRoute:
    """Route a single key exactly (the reference for :func:`route_keys`)."""
    first, fired, conv, pat, stars, _ = _Router(transforms).route(key)
    return KeyRoute(key, first, fired, conv, pat, tuple(int(s) for s in stars))


def route_keys(
    keys: Iterable[str],
    transforms: Sequence[WeightTransform],
    *,
    runtime_keys: Collection[str] | None = None,
    base_model_prefix: str | None = None,
) -> Routing:
    """Route checkpoint keys through ``transforms`` and group them by target.

    Args:
        keys: checkpoint keys.
        transforms: a resolved, scoped transform list (renamings and converters in any order;
            renamings always fire first).
        runtime_keys: the model's runtime keys. With ``base_model_prefix`` they decide, per key,
            whether adding or stripping that prefix names a real parameter.
        base_model_prefix: e.g. ``"model"``: a key whose targets are not runtime keys is routed
            again with the prefix stripped (or added), and takes that route if its targets are.

    Returns:
        A :class:`Routing` with one :class:`KeyRoute` per key and the target groups.

    Raises:
        ConfigurationError: two converters claim the same key, or a key is not a string.

    Example:
        >>> from surgery import WeightRenaming
        >>> r = route_keys(["a.gamma"], [WeightRenaming(r"\\.gamma$", ".weight")])
        >>> r.routes["a.gamma"].target_key
        'a.weight'
    """
    keys = keys if isinstance(keys, list) else list(keys)
    router = TemplateRouter(_Router(transforms))
    with gc_paused():
        if router.exact_only:
            _check_str(keys)
            filer = _Filer(router, runtime_keys, base_model_prefix, deferred=False)
            file, route = filer.file, router.route_exact
            for key in keys:
                file(key, route(key))
            routes = RouteTable(keys, None, filer.entries)
            return Routing(router.router.transforms, routes, filer.groups, filer.conflicts)
        filer = _Filer(router, runtime_keys, base_model_prefix, deferred=True)
        try:
            caches = _route_in_chunks(keys, filer)
        except TypeError:
            _check_str(keys)  # names a key that is not a string
            raise
        except _Redo:  # a collision (rare): file again, each key at once, in order
            router = TemplateRouter(_Router(transforms))
            filer = _Filer(router, runtime_keys, base_model_prefix, deferred=False)
            caches = _route_in_chunks(keys, filer)
    routes = RouteTable(keys, caches, filer.entries, router.table.values())
    return Routing(router.router.transforms, routes, filer.groups, filer.conflicts)


def _route_keys_exact(
    keys: Iterable[str],
    transforms: Sequence[WeightTransform],
    *,
    runtime_keys: Collection[str] | None = None,
    base_model_prefix: str | None = None,
) -> Routing:
    """:func:`route_keys` computed key by key on the exact path (the reference; slow)."""
    router = _Router(transforms)
    use_prefix = bool(base_model_prefix) and runtime_keys is not None
    known = runtime_keys if runtime_keys is not None else ()
    pre = f"{base_model_prefix}." if base_model_prefix else ""
    routes: dict[str, KeyRoute] = {}
    groups: dict[str, TargetGroup] = {}
    conflicts: list[RouteConflict] = []
    for key in keys:
        first, fired, conv, pat, stars, targets = router.route(key)
        base = ""
        if use_prefix and not _names_real(targets, known):
            first, fired, conv, pat, stars, targets, base = _retry_with_prefix(
                key, (first, fired, conv, pat, stars, targets), pre, known, router.route
            )
        index = tuple(int(s) for s in stars)
        routes[key] = KeyRoute(key, first, fired, conv, pat, index, base)
        group = groups.get(first)
        if group is None:
            group = groups[first] = TargetGroup(first, conv, targets)
        elif group.converter != conv:
            conflicts.append(RouteConflict(first, group.source_keys[0], key))
            continue
        slot = group.sources.setdefault(pat if pat is not None else 0, {})
        if index in slot:
            conflicts.append(RouteConflict(first, slot[index], key))
            continue
        slot[index] = key
    return Routing(router.transforms, routes, groups, conflicts)


def _check_str(keys: list[Any]) -> None:
    try:
        "".join(keys)
    except TypeError:
        bad = next(k for k in keys if not isinstance(k, str))
        raise ConfigurationError(
            f"Checkpoint keys must be strings, got {bad!r}; pass the tensor names."
        ) from None


_SELECTOR = attrgetter("sel")
_KEYS = itemgetter(3)  # the key list of a pending entry


_CHUNK = 4096  # keys per pass: what one pass allocates stays in the CPU caches


def _route_in_chunks(keys: list[str], filer: _Filer) -> list[Selections]:
    """File every key (:func:`_file_all`) a chunk at a time; return each key's root cache."""
    cache_of = filer.router.caches.__getitem__
    caches: list[Selections] = []
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start : start + _CHUNK]
        chunk_caches = list(map(cache_of, key_templates(chunk)))
        caches += chunk_caches
        fresh = len(filer.pending)
        _file_all(chunk, chunk_caches, filer)
        # The lists made in this chunk, while their keys are still in the CPU caches; in a
        # checkpoint's usual order they hold most of their keys already. The rest wait for
        # the end, so that keys in random order do not merge each list once per chunk.
        filer.merge(fresh)
    filer.merge(0)
    filer.done()
    return caches


def _file_all(keys: list[str], caches: list[Selections], filer: _Filer) -> None:
    """The hot loop, run by the interpreter's C iterators: one verdict per key, applied to it.

    Each key's template root caches, per selection (see :class:`~surgery.fastroute.KeyClass`),
    a *verdict*: a callable that files the key. A selection seen for the first time gets
    :meth:`_Filer.miss`, which makes the verdict (and the target group), caches it and applies
    it. Everything is lazy, so key ``i`` sees every verdict made for keys ``0 … i-1``: keys are
    filed strictly in order, as on the exact path.
    """
    verdicts = map(dict.get, caches, map(call, map(_SELECTOR, caches), keys), repeat(filer.miss))
    deque(map(call, verdicts, keys), maxlen=0)


# Index tuples of small indices, made once: after the cycle collector has looked at them once it
# stops tracking them, and a dict whose keys are untracked tuples and whose values are strings
# is not tracked either, so a routing result's group slots cost the collector nothing.
_SMALL_INDICES = tuple((i,) for i in range(4096))


class _IndexCache(dict):  # type: ignore[type-arg]
    """Index text → index tuple (``""`` → ``()``), made once per distinct text."""

    def __missing__(self, text: str) -> tuple[int, ...]:
        value = self[text] = _index_of(text) if text else ()
        return value


class _Redo(Exception):
    """Deferred filing met a collision; the call starts over in strict order."""


class _Filer:
    """Files routed keys into groups with the exact path's semantics (state of one call).

    *Deferred* (the first try): a hot class's keys are appended to a list per group slot (and
    index getter) and put in their slots by :meth:`merge`, a few C-level passes per list. Any
    collision (a conflict, a duplicate key) raises :class:`_Redo`, and the call is repeated
    *strict*: every key is put in its slot at once, and conflicts are reported in key order.
    """

    def __init__(
        self,
        router: TemplateRouter,
        runtime_keys: Collection[str] | None,
        base_model_prefix: str | None,
        *,
        deferred: bool,
    ) -> None:
        self.router = router
        self.table = router.table
        self.deferred = deferred
        self.entries: dict[str, KeyRoute] = {}
        self.groups: dict[str, TargetGroup] = {}
        self.conflicts: list[RouteConflict] = []
        self.pending: list[tuple[Callable[[str], str], TargetGroup, int, list[str]]] = []
        self.shared: dict[tuple[Callable[[str], str], int, int], Callable[[str], None]] = {}
        self.index_of = _IndexCache()
        self.use_prefix = bool(base_model_prefix) and runtime_keys is not None
        known: Collection[str] = runtime_keys if runtime_keys is not None else ()
        if self.use_prefix and not isinstance(known, (AbstractSet, Mapping)):
            known = set(known)
        self.known = known
        self.pre = f"{base_model_prefix}." if base_model_prefix else ""

    def conflict(self, conflict: RouteConflict | Callable[[], RouteConflict]) -> None:
        if self.deferred:
            raise _Redo
        self.conflicts.append(conflict if isinstance(conflict, RouteConflict) else conflict())

    def file(self, key: str, decision: Decision) -> None:
        """Route ``key`` given its decision (base-model prefix retry included) and file it."""
        first, fired, conv, pat, stars, targets = decision
        base = ""
        if self.use_prefix and not _names_real(targets, self.known):
            first, fired, conv, pat, stars, targets, base = _retry_with_prefix(
                key, decision, self.pre, self.known, self.router.decide
            )
        index = tuple(int(s) for s in stars)
        self.entries[key] = KeyRoute(key, first, fired, conv, pat, index, base)
        group = self.groups.get(first)
        if group is None:
            group = self.groups[first] = TargetGroup(first, conv, targets)
        elif group.converter != conv:
            self.conflict(lambda: RouteConflict(first, group.source_keys[0], key))
            return
        slot = group.sources.setdefault(pat if pat is not None else 0, {})
        if index in slot:
            self.conflict(RouteConflict(first, slot[index], key))
            return
        slot[index] = key

    def miss(self, key: str) -> None:
        """No verdict is cached for ``key``'s selection: make one (when the class allows) and apply it."""
        root = node = self.table[key_template(key)]
        while node.sb:  # KeyClass.walk, inlined
            node = node.children[key[node.sa : node.sb]]
        if not node.hot:  # route on its own; counts the key, and may build its class
            leaf = self.router.promote(root, key)
            self.file(key, self.router.decision(leaf, key))
            return
        if not node.covered:  # the selection must pin this class (and a gathering class's group)
            spans = set(node.tslices) if node.ib else set()
            n = root
            while n.sb:
                spans.add((n.sa, n.sb))
                n = n.children[key[n.sa : n.sb]]
            if not spans <= root.sel_slices:
                root.refresh()  # selectors only grow, so a covered class stays covered
            node.covered = True
        verdict = root.cache[root.cache.sel(key)] = self._verdict(root, node, key)
        verdict(key)

    def _verdict(self, root: KeyClass, c: KeyClass, key: str) -> Callable[[str], None]:
        """How to file every key of ``c`` that selects what ``key`` selects."""
        if not c.ib:  # gathers nothing: the selection pins only the class
            one_target = c.ctargets == (c.cfirst,)  # targets == (first target,)
            return partial(self._file_plain, c, c.pat if c.pat is not None else 0, one_target)
        if self.use_prefix and not _names_real(c.targets_of(key), self.known):
            return partial(self._retry, root)
        fmt, get = c.cfirst  # KeyClass.first_of, inlined (the exact path's first target key)
        first = fmt if get is None else fmt % get(key)
        groups = self.groups
        group = groups.get(first)
        if group is None:
            group = groups[first] = TargetGroup(first, c.conv, c.targets_of(key))
        elif group.converter != c.conv:
            return partial(self._refuse, group)
        pat = c.pat if c.pat is not None else 0
        slot = group.sources.get(pat)
        if slot is None:
            slot = group.sources[pat] = {}
        if self.deferred:
            # One list per group slot and index getter: keys that differ only in how many
            # digits their index has (experts 0-9, 10-99, 100-127: three templates) share one.
            spec = (c.getix, id(group), pat)
            verdict = self.shared.get(spec)
            if verdict is None:
                keys: list[str] = []
                self.pending.append((c.getix, group, pat, keys))
                verdict = self.shared[spec] = keys.append
            return verdict
        return partial(self._file_now, c, slot)

    def _file_now(self, c: KeyClass, slot: dict[tuple[int, ...], str], key: str) -> None:
        ix = self.index_of[c.getix(key)]
        if ix in slot:
            self.conflict(RouteConflict(c.first_of(key), slot[ix], key))
        else:
            slot[ix] = key

    def _file_plain(self, c: KeyClass, pat: int, one_target: bool, key: str) -> None:
        """File a key of a class that gathers nothing: a group of its own, or one pattern's slot."""
        fmt, get = c.cfirst
        first = fmt if get is None else fmt % get(key)
        if self.use_prefix and not _names_real(c.targets_of(key), self.known):
            self.file(key, c.decision(key))
            return
        group = self.groups.get(first)
        if group is None:
            targets = (first,) if one_target else c.targets_of(key)
            self.groups[first] = TargetGroup(first, c.conv, targets, {pat: {(): key}})
        elif group.converter != c.conv:
            self.conflict(lambda: RouteConflict(first, group.source_keys[0], key))
        else:
            slot = group.sources.get(pat)
            if slot is None:
                group.sources[pat] = {(): key}
            elif () in slot:
                self.conflict(RouteConflict(first, slot[()], key))
            else:
                slot[()] = key

    def _retry(self, root: KeyClass, key: str) -> None:
        """The class's targets name no runtime key: route with the base-model prefix."""
        self.file(key, root.walk(key).decision(key))

    def _refuse(self, group: TargetGroup, key: str) -> None:
        """The target group exists under another converter: ``key`` conflicts."""
        self.conflict(lambda: RouteConflict(group.key, group.source_keys[0], key))

    def merge(self, first: int) -> None:
        """Put the keys deferred in the lists made since the ``first``-th into their group slots.

        Raises:
            _Redo: a collision.
        """
        index_of = self.index_of
        entries = self.pending[first:]
        for getix, group, pat, keys in compress(entries, map(_KEYS, entries)):  # lists with keys
            slot = dict(zip(map(index_of.__getitem__, map(getix, keys)), keys))
            if len(slot) != len(keys):
                raise _Redo
            keys.clear()  # the verdict keeps appending to it
            sources = group.sources
            filed = sources[pat]
            if filed:  # copy the smaller into the larger (a slot's order is not promised)
                if len(filed) < len(slot):
                    filed, slot = slot, filed
                if not filed.keys().isdisjoint(slot.keys()):
                    raise _Redo
                filed.update(slot)
                slot = filed
            sources[pat] = slot

    def done(self) -> None:
        """Drop the verdicts (and the lists they hold) once every key is filed."""
        self.pending, self.shared = [], {}
        for root in self.table.values():
            root.cache.clear()


def _retry_with_prefix(
    key: str, decision: Decision, pre: str, known: Collection[str], route: Any
) -> tuple[str, tuple[int, ...], int | None, int | None, tuple[str, ...], tuple[str, ...], str]:
    """Find the base-model-prefix form of a key whose targets name no runtime key.

    First the routed targets themselves with ``pre`` stripped or added (the transformers order:
    a checkpoint of the model with a head, renamed, then loaded into the bare base model), then
    the checkpoint key with ``pre`` stripped or added and routed again (so that transforms scoped
    under the prefix see it). The last element says which form won (see :class:`KeyRoute`).
    """
    _first, fired, conv, pat, stars, targets = decision
    if all(t.startswith(pre) for t in targets):
        moved = tuple(t[len(pre) :] for t in targets)
        mark = "-after"
    else:
        moved = tuple(pre + t for t in targets)
        mark = "+after"
    if _names_real(moved, known):
        return moved[0], fired, conv, pat, stars, moved, mark
    alt_key = key[len(pre) :] if key.startswith(pre) else pre + key
    alt = route(alt_key)
    if _names_real(alt[5], known):
        return (*alt, "-" if key.startswith(pre) else "+")
    return (*decision, "")


def _names_real(targets: tuple[str, ...], known: Collection[str]) -> bool:
    return all((t.replace("*", "0") if "*" in t else t) in known for t in targets)
