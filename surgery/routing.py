"""Routing: send every checkpoint key through a transform list, once.

:func:`route_keys` is the seam between the transform engine and the loader. For each checkpoint
key it applies every matching renaming (in order, chained), then lets at most one converter claim
the result, and files the key under the *target group* it feeds. A target group is what the
loader materializes as one unit: a plain tensor, or every key a converter gathers for one runtime
parameter (all experts of one layer, say).

Routing is exact and cheap: each transform list is compiled once, and keys that share a shape
(the same text up to their numeric indices) share one routing decision wherever the patterns
provably cannot tell indices apart (see :mod:`surgery.fastroute`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from .errors import ConfigurationError
from .transforms import WeightConverter, WeightTransform, split_transforms

__all__ = ["KeyRoute", "TargetGroup", "RouteConflict", "Routing", "route_keys", "route_key"]


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
        base_prefix: ``"+"`` if ``base_model_prefix`` was added, ``"-"`` if stripped, else ``""``.
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


@dataclass
class Routing:
    """The result of :func:`route_keys`."""

    transforms: tuple[WeightTransform, ...]
    routes: dict[str, KeyRoute]
    groups: dict[str, TargetGroup]
    conflicts: list[RouteConflict]

    def fired(self, source_keys: Iterable[str] | None = None) -> list[int]:
        """Indices of the transforms that fired on ``source_keys`` (all routed keys by default)."""
        keys = self.routes.keys() if source_keys is None else source_keys
        seen: set[int] = set()
        for k in keys:
            r = self.routes[k]
            seen.update(r.renamings)
            if r.converter is not None:
                seen.add(r.converter)
        return sorted(seen)


class _Router:
    """A transform list compiled for routing; reusable across keys."""

    def __init__(self, transforms: Sequence[WeightTransform]) -> None:
        self.transforms = tuple(transforms)
        renamings, converters = split_transforms(self.transforms)
        index = {id(t): i for i, t in enumerate(self.transforms)}
        self.renamings = [(index[id(t)], t) for t in renamings]
        self.converters = [(index[id(t)], t) for t in converters]

    def route(self, key: str) -> tuple[str, tuple[int, ...], int | None, int | None, tuple[str, ...], tuple[str, ...]]:
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
        base_model_prefix: e.g. ``"model"``; see the class docstring of :class:`KeyRoute`.

    Returns:
        A :class:`Routing` with one :class:`KeyRoute` per key and the target groups.

    Raises:
        ConfigurationError: two converters claim the same key.

    Example:
        >>> from surgery import WeightRenaming
        >>> r = route_keys(["a.gamma"], [WeightRenaming(r"\\.gamma$", ".weight")])
        >>> r.routes["a.gamma"].target_key
        'a.weight'
    """
    from .fastroute import TemplateRouter

    router = TemplateRouter(_Router(transforms))
    use_prefix = bool(base_model_prefix) and runtime_keys is not None
    known = runtime_keys if runtime_keys is not None else ()
    pre = f"{base_model_prefix}." if base_model_prefix else ""
    routes: dict[str, KeyRoute] = {}
    groups: dict[str, TargetGroup] = {}
    conflicts: list[RouteConflict] = []
    transforms_t = router.router.transforms

    for key, decision in router.route_many(keys):
        first, fired, conv, pat, stars, targets = decision
        base = ""
        if use_prefix and not _names_real(targets, known):
            alt_key = key[len(pre) :] if key.startswith(pre) else pre + key
            alt = router.route_one(alt_key)
            if _names_real(alt[5], known):
                first, fired, conv, pat, stars, targets = alt
                base = "-" if key.startswith(pre) else "+"
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
    del transforms_t
    return Routing(router.router.transforms, routes, groups, conflicts)


def _names_real(targets: tuple[str, ...], known: Collection[str]) -> bool:
    return all((t.replace("*", "0") if "*" in t else t) in known for t in targets)
