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
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigurationError
from .fastroute import Decision, KeyClass, TemplateRouter, key_templates
from .gcpause import gc_paused
from .transforms import WeightConverter, WeightTransform, split_transforms

__all__ = ["KeyRoute", "RouteConflict", "RouteTable", "Routing", "TargetGroup", "route_key", "route_keys"]


@dataclass(frozen=True, slots=True)
class KeyRoute:
    """How one checkpoint key travels.

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
    index: tuple[int, ...] = ()
    base_prefix: str = ""


@dataclass
class TargetGroup:
    """The checkpoint keys that together produce one set of runtime keys.

    Attributes:
        key: the group's identity: its first target key.
        converter: index of the converter, or ``None`` for a plain (renamed or untouched) tensor.
        target_keys: the runtime keys produced (``*`` is filled when the op chain returns a list).
        sources: per converter source pattern, ``{wildcard index: checkpoint key}``.
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


class RouteTable(Mapping[str, KeyRoute]):
    """Checkpoint key → :class:`KeyRoute`, read-only; routes are made on access.

    Keys of one shape share one decision; storing that decision instead of one object per key is
    what keeps routing a large checkpoint cheap. A route is made on first access and kept.
    Iteration follows the order the keys were given in.
    """

    __slots__ = ("_entries",)

    def __init__(self, entries: dict[str, KeyRoute | KeyClass]) -> None:
        self._entries = entries

    def __getitem__(self, key: str) -> KeyRoute:
        entry = self._entries[key]
        if entry.__class__ is KeyRoute:
            return entry  # type: ignore[return-value]
        c = entry.walk(key)  # type: ignore[union-attr]
        route = KeyRoute(key, c.first_of(key), c.fired, c.conv, c.pat, c.index(key))
        self._entries[key] = route  # made once; the loader reads each route more than once
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
        stars = match.stars if c.gathers else ()
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
    _check_str(keys)
    with gc_paused():
        return _route_keys_fast(keys, transforms, runtime_keys, base_model_prefix)


def _route_keys_fast(
    keys: list[str],
    transforms: Sequence[WeightTransform],
    runtime_keys: Collection[str] | None,
    base_model_prefix: str | None,
) -> Routing:
    router = TemplateRouter(_Router(transforms))
    filer = _Filer(router, runtime_keys, base_model_prefix)
    if router.exact_only:
        file = filer.file
        route = router.route_exact
        for key in keys:
            file(key, route(key))
        entries: dict[str, KeyRoute | KeyClass] = filer.entries
    else:
        roots = list(map(router.table.__getitem__, key_templates(keys)))
        # Every key maps to its template's root (the route is read from it on access), except
        # the keys that took the exact path, which keep their KeyRoute (added below).
        entries = dict(zip(keys, roots))
        _route_shared(keys, roots, filer, unique=len(entries) == len(keys))
        entries.update(filer.entries)
    return Routing(router.router.transforms, RouteTable(entries), filer.groups, filer.conflicts)


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


def _route_shared(keys: list[str], roots: list[KeyClass], filer: _Filer, *, unique: bool) -> None:
    """The hot loop: one selection per key finds its group slot; the index is one more slice.

    A template root caches, per selection (see :class:`~surgery.fastroute.KeyClass`), a verdict
    ``(slot, ia, ib)``: the group slot the key files into and where its index is. Anything
    unusual (a class not built yet, a refused key, a prefix retry, a collision) is a *detour*
    (:class:`_Detour` claims to hold every index, so it lands in the collision branch) handled by
    :class:`_Filer` with the exact path's semantics.
    """
    miss = filer.miss
    detour = filer.detour
    index_of = _IndexCache()
    if unique:
        # ``setdefault`` returns ``k`` itself unless the index is taken (or the slot is a detour).
        for k, c in zip(keys, roots):
            v = c.cache.get(s := c.sel(k))
            if v is None:
                v = miss(k, c, s)
            slot, ia, ib = v
            ix = index_of[k[ia:ib]]
            if slot.setdefault(ix, k) is not k:
                detour(k, c, slot, ix)
        return
    for k, c in zip(keys, roots):  # a key occurs twice: compare the slot's content, not identity
        v = c.cache.get(s := c.sel(k))
        if v is None:
            v = miss(k, c, s)
        slot, ia, ib = v
        ix = index_of[k[ia:ib]]
        if ix in slot:
            detour(k, c, slot, ix)
        else:
            slot[ix] = k


class _IndexCache(dict):  # type: ignore[type-arg]
    """Index text → index tuple (``""`` → ``()``), made once per distinct text."""

    def __missing__(self, text: str) -> tuple[int, ...]:
        value = self[text] = (int(text),) if text else ()
        return value


class _Detour(dict):  # type: ignore[type-arg]
    """A cached verdict that is not a group slot; it claims to hold every index.

    ``kind`` is ``"walk"`` (route the key on its own: class not built or not shareable),
    ``"retry"`` (targets are not runtime keys: try the base-model prefix) or ``"refused"``
    (``group`` exists under another converter: the key conflicts).
    """

    __slots__ = ("group", "kind")

    def __init__(self, kind: str, group: TargetGroup | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.group = group

    def __contains__(self, ix: object) -> bool:
        return True

    def setdefault(self, ix: object, default: object = None) -> _Detour:  # type: ignore[override]
        return self


_WALK: tuple[dict[tuple[int, ...], str], int, int] = (_Detour("walk"), 0, 0)


class _Filer:
    """Files routed keys into groups with the exact path's semantics (state of one call)."""

    def __init__(
        self, router: TemplateRouter, runtime_keys: Collection[str] | None, base_model_prefix: str | None
    ) -> None:
        self.router = router
        self.entries: dict[str, KeyRoute | KeyClass] = {}
        self.groups: dict[str, TargetGroup] = {}
        self.conflicts: list[RouteConflict] = []
        self.use_prefix = bool(base_model_prefix) and runtime_keys is not None
        known: Collection[str] = runtime_keys if runtime_keys is not None else ()
        if self.use_prefix and not isinstance(known, (AbstractSet, Mapping)):
            known = set(known)
        self.known = known
        self.pre = f"{base_model_prefix}." if base_model_prefix else ""

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
            self.conflicts.append(RouteConflict(first, group.source_keys[0], key))
            return
        slot = group.sources.setdefault(pat if pat is not None else 0, {})
        if index in slot:
            self.conflicts.append(RouteConflict(first, slot[index], key))
            return
        slot[index] = key

    def miss(self, key: str, root: KeyClass, selection: Any) -> tuple[dict[tuple[int, ...], str], int, int]:
        """No verdict cached for ``key``'s ``selection``: make one (without counting the key)."""
        node = root.walk(key)
        verdict: tuple[dict[tuple[int, ...], str], int, int]
        if not node.hot:
            verdict = _WALK  # valid for any key: the detour walks with the key itself
        else:
            if not node.covered:  # the selection must pin this class and its target group
                spans = set(node.tslices)
                n = root
                while n.sb:
                    spans.add((n.sa, n.sb))
                    n = n.children[key[n.sa : n.sb]]
                if not spans <= root.sel_slices:
                    root.refresh()  # selectors only grow, so a covered class stays covered
                    selection = root.sel(key)
                node.covered = True
            verdict = (self._slot(key, node), node.ia, node.ib)
        root.cache[selection] = verdict
        return verdict

    def _slot(self, key: str, c: KeyClass) -> dict[tuple[int, ...], str]:
        targets = c.targets_of(key)
        if self.use_prefix and not _names_real(targets, self.known):
            return _Detour("retry")
        first = targets[0]  # the exact path's first target is always its first target key
        group = self.groups.get(first)
        if group is None:
            group = self.groups[first] = TargetGroup(first, c.conv, targets)
        if group.converter != c.conv:
            return _Detour("refused", group)
        return group.sources.setdefault(c.pat if c.pat is not None else 0, {})

    def detour(self, key: str, root: KeyClass, slot: dict[tuple[int, ...], str], ix: tuple[int, ...]) -> None:
        """``key`` found its index taken in its group slot, or its verdict is a detour."""
        if slot.__class__ is not _Detour:
            self.conflicts.append(RouteConflict(root.walk(key).first_of(key), slot[ix], key))
            return
        d: _Detour = slot  # type: ignore[assignment]
        if d.kind == "walk":
            leaf = self.router.promote(root, key)  # counts the key; may build its class
            if leaf.hot:
                root.cache.pop(root.sel(key), None)  # stale: the next key of this class goes fast
            self.file(key, self.router.decision(leaf, key))
        elif d.group is None:  # "retry"
            self.file(key, root.walk(key).decision(key))
        else:  # "refused"
            self.conflicts.append(RouteConflict(d.group.key, d.group.source_keys[0], key))


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
