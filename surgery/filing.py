"""Filing: how routed keys become target groups, fast and in key order.

:func:`~surgery.routing.route_keys` hands its keys to :func:`file_in_chunks`. Keys go through
in chunks (what a chunk allocates stays in the CPU caches). Per chunk, one translate gives every
key's template, and a chain of ``map`` calls looks up each key's cached *verdict* (a callable
that files it) and applies it, so the interpreter runs no bytecode for a key whose verdict is
cached; the first key of a selection makes the verdict in Python (:meth:`Filer.miss`).
Verdicts append to a list per group slot, and :meth:`Filer.merge` turns each list into its slot
with three more C-level passes. That deferral is optimistic: a collision (a conflict or a
duplicate key) raises :class:`Redo`, and the caller files every key again one at a time
(``deferred=False``), which reports conflicts exactly as the per-key path does.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Collection, Mapping
from collections.abc import Set as AbstractSet
from functools import partial
from itertools import compress, repeat
from operator import attrgetter, itemgetter
from typing import Any

from .families import try_share, unshare, valid_everywhere
from .fastroute import Decision, KeyClass, Selections, TemplateRouter, key_template, key_templates
from .routes import IndexCache, KeyRoute, RouteConflict, TargetGroup

__all__ = ["Filer", "Redo", "file_in_chunks", "names_real", "retry_with_prefix"]


def _call(fn: Callable[..., Any], /, *args: Any) -> Any:
    return fn(*args)


call: Callable[..., Any] = getattr(operator, "call", _call)  # C-level from Python 3.11


_SELECTOR = attrgetter("sel")
_KEYS = itemgetter(3)  # the key list of a pending entry


_CHUNK = 4096  # keys per pass: what one pass allocates stays in the CPU caches


def file_in_chunks(keys: list[str], filer: Filer) -> list[Selections]:
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
        if filer.deferred:
            filer.share()
    filer.merge(0)
    filer.done()
    return caches


def _file_all(keys: list[str], caches: list[Selections], filer: Filer) -> None:
    """The hot loop, run by the interpreter's C iterators: one verdict per key, applied to it.

    Each key's template root caches, per selection (see :class:`~surgery.fastroute.KeyClass`),
    a *verdict*: a callable that files the key. A selection seen for the first time gets
    :meth:`Filer.miss`, which makes the verdict (and the target group), caches it and applies
    it. Everything is lazy, so key ``i`` sees every verdict made for keys ``0 … i-1``: keys are
    filed strictly in order, as on the exact path.
    """
    verdicts = map(dict.get, caches, map(call, map(_SELECTOR, caches), keys), repeat(filer.miss))
    deque(map(call, verdicts, keys), maxlen=0)


class Redo(Exception):
    """Deferred filing met a collision; the call starts over in strict order."""


class Filer:
    """Files routed keys into groups with the exact path's semantics (state of one call).

    *Deferred* (the first try): a hot class's keys are appended to a list per group slot (and
    index getter) and put in their slots by :meth:`merge`, a few C-level passes per list. Any
    collision (a conflict, a duplicate key) raises :class:`Redo`, and the call is repeated
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
        self.appends: dict[tuple[Callable[[str], str], int, int], Callable[[str], None]] = {}  # by list spec
        self.index_of = IndexCache()
        self.use_prefix = bool(base_model_prefix) and runtime_keys is not None
        known: Collection[str] = runtime_keys if runtime_keys is not None else ()
        if self.use_prefix and not isinstance(known, (AbstractSet, Mapping)):
            known = set(known)
        self.known = known
        self.pre = f"{base_model_prefix}." if base_model_prefix else ""

    def conflict(self, conflict: RouteConflict | Callable[[], RouteConflict]) -> None:
        if self.deferred:
            raise Redo
        self.conflicts.append(conflict if isinstance(conflict, RouteConflict) else conflict())

    def file(self, key: str, decision: Decision) -> None:
        """Route ``key`` given its decision (base-model prefix retry included) and file it."""
        first, fired, conv, pat, stars, targets = decision
        base = ""
        if self.use_prefix and not names_real(targets, self.known):
            first, fired, conv, pat, stars, targets, base = retry_with_prefix(
                key, decision, self.pre, self.known, self.router.decide
            )
        index = tuple(int(s) for s in stars)
        self.entries[key] = KeyRoute(key, first, fired, conv, pat, index, base)
        self._place(key, first, conv, targets, pat if pat is not None else 0, index)

    def _place(
        self,
        key: str,
        first: str,
        conv: int | None,
        targets: tuple[str, ...],
        pat: int,
        index: tuple[int, ...],
    ) -> None:
        """Put ``key`` in its group's slot at once (a collision is a conflict)."""
        group = self.groups.get(first)
        if group is None:
            self.groups[first] = TargetGroup(first, conv, targets, {pat: {index: key}})
        elif group.converter != conv:
            self.conflict(lambda: RouteConflict(first, group.source_keys[0], key))
        else:
            slot = group.sources.get(pat)
            if slot is None:
                group.sources[pat] = {index: key}
            elif index in slot:
                self.conflict(RouteConflict(first, slot[index], key))
            else:
                slot[index] = key

    def miss(self, key: str) -> None:
        """No verdict is cached for ``key``'s selection: make one (when the class allows) and apply it."""
        root = node = self.table[key_template(key)]
        while node.sb:  # KeyClass.walk, inlined
            node = node.children[key[node.sa : node.sb]]
        family = root.family
        if not node.hot:  # route on its own; counts the key, and may build its class
            if family is not None:
                family.dirty = True
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
                if root.cache is not root.own:  # the family's selector would change: stop sharing
                    unshare(family, self.router.caches)
                root.refresh()  # selectors only grow, so a covered class stays covered
            node.covered = True
            if family is not None:
                family.dirty = True
        cache = root.cache
        verdict = self._verdict(root, node, key)
        if cache is not root.own and not valid_everywhere(family, root, node, key, verdict):
            unshare(family, self.router.caches)
            cache = root.cache
        cache[cache.sel(key)] = verdict
        verdict(key)

    def share(self) -> None:
        """Between chunks: let each width family that changed share one cache if it can."""
        caches, cache_roots = self.router.caches, self.table.cache_roots
        for family in self.table.families.values():
            if family.dirty and len(family.members) > 1:
                try_share(family, caches, cache_roots)

    def _verdict(self, root: KeyClass, c: KeyClass, key: str) -> Callable[[str], None]:
        """How to file every key of ``c`` that selects what ``key`` selects."""
        if not c.ib:  # gathers nothing: the selection pins only the class
            one_target = c.targets == (c.first,)  # the only target is the first
            return partial(self._file_plain, c, c.pat if c.pat is not None else 0, one_target)
        if self.use_prefix and not names_real(c.targets_of(key), self.known):
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
            verdict = self.appends.get(spec)
            if verdict is None:
                keys: list[str] = []
                self.pending.append((c.getix, group, pat, keys))
                verdict = self.appends[spec] = keys.append
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
        if self.use_prefix and not names_real(c.targets_of(key), self.known):
            self.file(key, c.decision(key))
            return
        self._place(key, first, c.conv, (first,) if one_target else c.targets_of(key), pat, ())

    def _retry(self, root: KeyClass, key: str) -> None:
        """The class's targets name no runtime key: route with the base-model prefix."""
        self.file(key, root.walk(key).decision(key))

    def _refuse(self, group: TargetGroup, key: str) -> None:
        """The target group exists under another converter: ``key`` conflicts."""
        self.conflict(lambda: RouteConflict(group.key, group.source_keys[0], key))

    def merge(self, first: int) -> None:
        """Put the keys deferred in the lists made since the ``first``-th into their group slots.

        Raises:
            Redo: a collision.
        """
        index_of = self.index_of
        entries = self.pending[first:]
        for getix, group, pat, keys in compress(entries, map(_KEYS, entries)):  # lists with keys
            slot = dict(zip(map(index_of.__getitem__, map(getix, keys)), keys))
            if len(slot) != len(keys):
                raise Redo
            keys.clear()  # the verdict keeps appending to it
            sources = group.sources
            filed = sources[pat]
            if filed:  # copy the smaller into the larger (a slot's order is not promised)
                if len(filed) < len(slot):
                    filed, slot = slot, filed
                if not filed.keys().isdisjoint(slot.keys()):
                    raise Redo
                filed.update(slot)
                slot = filed
            sources[pat] = slot

    def done(self) -> None:
        """Drop the verdicts (and the lists they hold) once every key is filed."""
        self.pending, self.appends = [], {}
        for root in self.table.values():
            root.cache.clear()
            root.own.clear()


def retry_with_prefix(
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
    if names_real(moved, known):
        return moved[0], fired, conv, pat, stars, moved, mark
    alt_key = key[len(pre) :] if key.startswith(pre) else pre + key
    alt = route(alt_key)
    if names_real(alt[5], known):
        return (*alt, "-" if key.startswith(pre) else "+")
    return (*decision, "")


def names_real(targets: tuple[str, ...], known: Collection[str]) -> bool:
    return all((t.replace("*", "0") if "*" in t else t) in known for t in targets)
