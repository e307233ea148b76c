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

How the per-key work stays in C is :mod:`surgery.filing`; the records a routing returns are
:mod:`surgery.routes` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

from .errors import ConfigurationError
from .fastroute import Decision, TemplateRouter
from .filing import Filer, Redo, file_in_chunks, names_real, retry_with_prefix
from .gcpause import gc_paused
from .routes import KeyRoute, RouteConflict, RouteTable, Routing, TargetGroup
from .transforms import WeightConverter, WeightTransform, split_transforms

__all__ = ["KeyRoute", "RouteConflict", "RouteTable", "Routing", "TargetGroup", "route_key", "route_keys"]


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
            filer = Filer(router, runtime_keys, base_model_prefix, deferred=False)
            file, route = filer.file, router.route_exact
            for key in keys:
                file(key, route(key))
            routes = RouteTable(keys, None, filer.entries)
            return Routing(router.router.transforms, routes, filer.groups, filer.conflicts)
        filer = Filer(router, runtime_keys, base_model_prefix, deferred=True)
        try:
            caches = file_in_chunks(keys, filer)
        except TypeError:
            _check_str(keys)  # names a key that is not a string
            raise
        except Redo:  # a collision (rare): file again, each key at once, in order
            router = TemplateRouter(_Router(transforms))
            filer = Filer(router, runtime_keys, base_model_prefix, deferred=False)
            caches = file_in_chunks(keys, filer)
    routes = RouteTable(keys, caches, filer.entries, router.table.cache_roots)
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
        if use_prefix and not names_real(targets, known):
            first, fired, conv, pat, stars, targets, base = retry_with_prefix(
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
