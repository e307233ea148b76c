r"""Routing: send every checkpoint key through a transform list, once.

:func:`route_keys` is the seam between the transform engine and the loader. For each checkpoint
key it applies every matching renaming (in list order, chained), lets at most one converter claim
the result, and files the key under the *target group* it feeds: what the loader materializes as
one unit, a plain tensor or every key a converter gathers for one runtime parameter (all experts
of one layer, say). The result is a :class:`Routing`: one :class:`KeyRoute` per key, the
:class:`TargetGroup` objects and the :class:`RouteConflict` list.

Routing one key means a regex search per transform, which adds up over 100,000 keys. A template
cache (:class:`_TemplateCache`) lets keys that differ only in the digits of their *numeric
components* (``layers.3.`` and ``layers.17.``, the same widths) reuse the first key's decision:

1. It is used only when every transform is *digit-blind*
   (:attr:`~surgery.transforms.WeightTransform.digit_blind`): no source pattern can tell one
   digit of a numeric component from another, and no scope holds a digit. Regex matching then
   takes the same path on every key of a template, so the same transforms fire, at the same
   positions, and every character of every output is either fixed or a copy of one fixed
   position of the key.
2. Which positions are copied where is learned by routing a few probe keys exactly (per numeric
   component two probes whose digits differ at every position). A template whose outputs copy
   only part of a component, or reorder its digits, is not cached.
3. Everything else (the base-model-prefix check, grouping, conflicts) runs per key on the real
   strings.

``route_keys(..., cache=False)`` routes every key exactly; the property tests check that both
give the same :class:`Routing`.

The key names come from a file, so routing is linear in their total size whatever they are:

* Only keys of at most :data:`TEMPLATE_MAX_COMPONENTS` numeric components and
  :data:`TEMPLATE_MAX_LENGTH` characters are templates; longer ones are routed exactly and never
  probed. Learning a template routes ``2 * components`` probe keys, paid from a budget that grows
  with the characters of every key that missed the template cache (plus a small allowance):
  however many templates a file invents, probing costs at most about as much as routing its
  keys once.
* When the model's runtime keys are given, a key beyond :class:`KeyLimits` (far longer, or with
  far more components, than any key of the model) is routed only when it names a runtime key as
  it is (or with ``base_model_prefix`` added or stripped); otherwise it goes to
  :attr:`Routing.oversized` and to itself, unexpected, without any pattern running on it.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from .converter import WeightConverter, split_transforms
from .errors import CheckpointError, ConfigurationError, SurgeryError
from .transforms import WeightTransform

__all__ = [
    "TEMPLATE_MAX_COMPONENTS",
    "TEMPLATE_MAX_LENGTH",
    "BasePrefix",
    "KeyLimits",
    "KeyRoute",
    "RouteConflict",
    "Routing",
    "TargetGroup",
    "route_key",
    "route_keys",
]


# --------------------------------------------------------------------------- records


class BasePrefix(str, Enum):
    """How a key used the model's ``base_model_prefix`` (:attr:`KeyRoute.base_prefix`)."""

    UNUSED = ""
    """Not needed: the routed targets name runtime keys as they are."""
    ADDED_BEFORE = "added before routing"
    """Added to the checkpoint key, which was then routed (the first renaming)."""
    STRIPPED_BEFORE = "stripped before routing"
    """Stripped from the checkpoint key, which was then routed (the first renaming)."""
    ADDED_AFTER = "added after routing"
    """Added to the routed targets (the last renaming)."""
    STRIPPED_AFTER = "stripped after routing"
    """Stripped from the routed targets (the last renaming)."""

    @property
    def added(self) -> bool:
        """Whether the prefix was added (else stripped, or unused)."""
        return self in (BasePrefix.ADDED_BEFORE, BasePrefix.ADDED_AFTER)

    @property
    def after(self) -> bool:
        """Whether the prefix was changed on the routed targets (the last renaming)."""
        return self in (BasePrefix.ADDED_AFTER, BasePrefix.STRIPPED_AFTER)


class KeyRoute(NamedTuple):
    """How one checkpoint key travels.

    Attributes:
        source_key: the key as stored in the checkpoint.
        target_key: the runtime key it becomes (for a converter: the group's first target key).
        renamings: indices (into the transform list) of the renamings that fired, in order.
        converter: index of the converter that claimed the key, or ``None``.
        pattern_index: which source pattern of that converter matched.
        index: the wildcard indices, when the converter gathers (merges) keys.
        base_prefix: how ``base_model_prefix`` was used (:class:`BasePrefix`).
    """

    source_key: str
    target_key: str
    renamings: tuple[int, ...] = ()
    converter: int | None = None
    pattern_index: int | None = None
    index: tuple[int, ...] = ()  # type: ignore[assignment]  # a field, shadowing tuple.index
    base_prefix: BasePrefix = BasePrefix.UNUSED


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


_count_dots = operator.methodcaller("count", ".")


@dataclass(frozen=True)
class KeyLimits:
    """How large a checkpoint key may be and still go through the transforms.

    A key longer than ``max_length`` characters, or of more than ``max_components`` dotted
    components, cannot come from any key of the model (the limits are far above the model's own
    keys), so :func:`route_keys` files it as unexpected at once instead of running patterns over it.

    Attributes:
        max_length: the most characters a routed key may have.
        max_components: the most dotted components a routed key may have.

    Example:
        >>> KeyLimits.for_runtime_keys(["model.norm.weight"])
        KeyLimits(max_length=4096, max_components=64)
        >>> KeyLimits.for_runtime_keys(["model.norm.weight"]).exceeded_by("a." * 64 + "weight")
        True
    """

    max_length: int = 4096
    max_components: int = 64

    def __post_init__(self) -> None:
        for name in ("max_length", "max_components"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"KeyLimits.{name} must be a positive int, got {value!r}.")

    @classmethod
    def for_runtime_keys(cls, keys: Collection[str]) -> KeyLimits:
        """The default limits, raised to twice the longest and deepest of the model's own keys."""
        longest = max(map(len, keys), default=0)
        deepest = max(map(_count_dots, keys), default=0) + 1
        return cls(max(cls.max_length, 2 * longest), max(cls.max_components, 2 * deepest))

    def exceeded_by(self, key: str) -> bool:
        """Whether ``key`` is too long or too deep (cost: one ``len`` and one ``str.count``)."""
        return len(key) > self.max_length or key.count(".") >= self.max_components


@dataclass
class Routing:
    """The result of :func:`route_keys`.

    Attributes:
        transforms: the transform list the keys went through.
        routes: every routed key's :class:`KeyRoute`, in the order the keys were given.
        groups: target groups by first target key, in the order their first key was routed.
        conflicts: keys refused because another key already landed there, in routing order.
        oversized: keys beyond :attr:`limits` that name no runtime key, routed to themselves
            (so reported unexpected) without any transform running on them, in key order.
        limits: the :class:`KeyLimits` keys were held to (``None`` without runtime keys).
    """

    transforms: tuple[WeightTransform, ...]
    routes: dict[str, KeyRoute]
    groups: dict[str, TargetGroup]
    conflicts: list[RouteConflict]
    oversized: list[str] = field(default_factory=list)
    limits: KeyLimits | None = None

    def fired(self, source_keys: Iterable[str] | None = None) -> list[int]:
        """Indices of the transforms that fired on ``source_keys`` (all routed keys by default)."""
        keys = self.routes if source_keys is None else source_keys
        seen: set[int] = set()
        for key in keys:
            route = self.routes[key]
            seen.update(route.renamings)
            if route.converter is not None:
                seen.add(route.converter)
        return sorted(seen)

    def oversized_note(self) -> str | None:
        """A sentence for a load report about :attr:`oversized` (``None`` when there is none)."""
        if not self.oversized or self.limits is None:
            return None
        first = self.oversized[0]
        shown = first if len(first) <= 120 else f"{first[:60]}...{first[-40:]}"
        return (
            f"{len(self.oversized)} checkpoint key(s) longer than {self.limits.max_length} characters or "
            f"deeper than {self.limits.max_components} components, far beyond the model's own keys, are "
            f"reported unexpected without being routed (the first: {shown!r}, {len(first)} characters); "
            "remove them from the checkpoint, or rename them before loading"
        )


# --------------------------------------------------------------------------- exact routing


class _Decision(NamedTuple):
    """What the transforms make of one key (before the base-model-prefix check)."""

    targets: tuple[str, ...]  # every runtime key; targets[0] is the group key
    renamings: tuple[int, ...]
    converter: int | None
    pattern_index: int | None
    indices: tuple[int, ...]  # the wildcard indices of a gathering converter, else ()


class _ExactRouter:
    """A transform list split for routing; :meth:`decide` routes one key by the contract."""

    def __init__(self, transforms: Sequence[WeightTransform]) -> None:
        self.transforms = tuple(transforms)
        renamings, converters = split_transforms(self.transforms)
        index = {id(t): i for i, t in enumerate(self.transforms)}
        self._renamings = [(index[id(t)], t) for t in renamings]
        self._converters: list[tuple[int, WeightConverter]] = [(index[id(t)], t) for t in converters]
        self.digit_blind = all(t.digit_blind for t in self.transforms)

    def decide(self, key: str, trace: list[str] | None = None) -> _Decision:
        """Route ``key``; ``trace`` (if given) receives the key after each renaming that fired."""
        fired: list[int] = []
        current = key
        for i, t in self._renamings:
            renamed, pattern = t.rename_source_key(current)
            if pattern is not None:
                fired.append(i)
                current = renamed
                if trace is not None:
                    trace.append(current)
        claimed = None
        for i, c in self._converters:
            m = c.match(current)
            if m is None:
                continue
            if claimed is not None:
                if _same_recipe(claimed[1], c) and claimed[1].target_keys(claimed[2]) == c.target_keys(m):
                    # One mapping resolved for a sub-model and again for an ancestor: the same
                    # conversion either way; the innermost scope names this key's sub-model.
                    if len(c.scope_prefix or "") > len(claimed[1].scope_prefix or ""):
                        claimed = (i, c, m)
                    continue
                raise ConfigurationError(
                    f"Two converters claim checkpoint key {key!r} (renamed to {current!r}): "
                    f"{claimed[1]!r} and {c!r}. Make their source patterns disjoint."
                )
            claimed = (i, c, m)
        if claimed is None:
            return _Decision((current,), tuple(fired), None, None, ())
        i, c, m = claimed
        index = tuple(map(int, m.stars)) if c.gathers else ()
        return _Decision(c.target_keys(m), tuple(fired), i, m.pattern_index, index)


def _same_recipe(a: WeightConverter, b: WeightConverter) -> bool:
    """Whether two converters differ at most in their scope (copies of one registered mapping)."""
    return (
        type(a) is type(b)
        and a.source_patterns == b.source_patterns
        and a.target_patterns == b.target_patterns
        and a.operations == b.operations
    )


# --------------------------------------------------------------------------- the template cache

# A numeric component after a dot; ``split`` yields [text, digits, text, digits, ..., text].
_NUMERIC = re.compile(r"\.(0|[1-9][0-9]*)(?=\.|\Z)")  # canonical: "01" stays literal text
_MISSING = object()

TEMPLATE_MAX_COMPONENTS = 16
"""A key with more numeric components than this is routed exactly (real keys have a handful)."""
TEMPLATE_MAX_LENGTH = 1024
"""A key longer than this (in characters) is routed exactly (real keys have a few dozen)."""
_PROBE_ALLOWANCE = 1 << 16  # characters of probe keys learning may route before any key paid for them


class _Replay:
    """One template's decision, with the key's numeric components as ``str.format`` fields.

    ``targets`` are formats (``"{0}"`` is the key's first numeric component); ``index`` holds,
    per wildcard, ``(component number, None)`` when it copies a component, else ``(None, value)``.
    """

    __slots__ = ("_formats", "_index", "_rest")

    def __init__(
        self, decision: _Decision, targets: list[str], index: list[tuple[int | None, int | None]]
    ) -> None:
        self._formats = tuple(t.format for t in targets)
        self._rest = (decision.renamings, decision.converter, decision.pattern_index)
        self._index = tuple(index)

    def decide(self, values: list[str]) -> _Decision:
        formats = self._formats
        if len(formats) == 1:  # the common case, without building a list
            targets: tuple[str, ...] = (formats[0](*values),)
        else:
            targets = tuple([f(*values) for f in formats])
        fields = self._index
        if len(fields) == 1 and fields[0][0] is not None:  # one wildcard copying a component
            index: tuple[int, ...] = (int(values[fields[0][0]]),)
        else:
            index = tuple([fixed if c is None else int(values[c]) for c, fixed in fields])  # type: ignore[misc]
        renamings, converter, pattern_index = self._rest
        return _Decision(targets, renamings, converter, pattern_index, index)


class _TemplateCache:
    """Exact decisions, shared by keys that differ only in the digits of numeric components.

    Only sound for a digit-blind transform list (see the module docstring). Learning a template
    of ``n`` numeric components routes ``2 * n`` probe keys as long as the key; it waits (the key
    is routed exactly) until the characters of the keys that missed the cache so far, plus an
    allowance, pay for the probes, so probing never costs much more than routing every key once.
    """

    def __init__(self, exact: _ExactRouter) -> None:
        self._exact = exact
        self._replays: dict[tuple[object, ...], _Replay | None] = {}
        self._budget = _PROBE_ALLOWANCE

    def decide(self, key: str) -> _Decision:
        if len(key) > TEMPLATE_MAX_LENGTH:
            return self._exact.decide(key)
        parts = _NUMERIC.split(key)
        if len(parts) == 1:
            return self._exact.decide(key)
        values = parts[1::2]
        template = (*parts[0::2], *map(len, values))
        replay = self._replays.get(template, _MISSING)
        if replay is _MISSING:
            trace: list[str] = []
            decision = self._exact.decide(key, trace)
            if len(values) > TEMPLATE_MAX_COMPONENTS:
                self._replays[template] = None  # never probed: routed exactly, every time
                return decision
            self._budget += len(key)
            cost = 2 * len(values) * len(key)
            if cost <= self._budget:
                self._budget -= cost
                self._replays[template] = _learn(self._exact, parts, decision, trace)
            return decision
        if replay is None:
            return self._exact.decide(key)
        return replay.decide(values)  # type: ignore[attr-defined]  # a _Replay here


def _learn(exact: _ExactRouter, parts: list[str], decision: _Decision, trace: list[str]) -> _Replay | None:
    """Turn one key's decision into a :class:`_Replay` by routing probe keys, or ``None``.

    For numeric component ``i`` of width ``w``, probe A puts ``1234...`` there (position ``k``
    holds ``k + 1`` mod 10) and probe B the same digits plus 5, so the two differ at every
    position and neither starts with ``0`` (``int`` tells them apart). A character of an output
    (or of the key after a renaming, in ``trace``) that differs between A and B is a copy of
    component ``i``, at the position its A digit names.

    A literal digit glued to a letter (``w1``) cannot meet a numeric component of the key, but
    it could meet one that a renaming glued to a letter (``layers.3.`` → ``layer3_``): the key
    after every renaming must therefore still hold each copied component whole, between dots.
    """
    values = parts[1::2]
    if any(len(v) > 10 for v in values):
        return None  # probe digits would repeat within the component
    texts = [*trace, *decision.targets]
    lengths = list(map(len, texts))
    owners: list[list[tuple[int, int] | None]] = [[None] * len(t) for t in texts]
    index: list[tuple[int | None, int | None]] = [(None, v) for v in decision.indices]
    for i, value in enumerate(values):
        probes = []
        for shift in (1, 6):
            probe_parts = list(parts)
            probe_parts[2 * i + 1] = _probe(len(value), shift)
            probe_trace: list[str] = []
            probe = exact.decide(_join(probe_parts), probe_trace)
            probes.append((probe, [*probe_trace, *probe.targets]))
        (a, texts_a), (b, texts_b) = probes
        if not (_same_shape(a, decision) and _same_shape(b, decision)):
            return None
        if not (list(map(len, texts_a)) == lengths == list(map(len, texts_b))):
            return None
        for owner, t, ta, tb in zip(owners, texts, texts_a, texts_b):
            for j, (c0, ca, cb) in enumerate(zip(t, ta, tb)):
                if ca == cb:
                    if ca != c0:
                        return None
                    continue
                k = (int(ca) - 1) % 10
                if owner[j] is not None or cb != str((k + 6) % 10) or c0 != value[k]:
                    return None
                owner[j] = (i, k)
        for n, (ia, ib) in enumerate(zip(a.indices, b.indices)):
            if ia == ib == decision.indices[n]:
                continue
            if ia != int(_probe(len(value), 1)) or ib != int(_probe(len(value), 6)):
                return None  # the wildcard caught part of a component
            index[n] = (i, None)
    fields = [_fields(owner, text, values) for owner, text in zip(owners, texts)]
    if any(f is None for f in fields):
        return None
    if not all(_delimited(f) for f in fields[: len(trace)]):  # type: ignore[arg-type]
        return None
    formats = [_format(f) for f in fields[len(trace) :]]  # type: ignore[arg-type]
    return _Replay(decision, formats, index)


_Fields = list[str | int]  # literal characters, and numeric component numbers where copied whole


def _fields(owner: list[tuple[int, int] | None], text: str, values: list[str]) -> _Fields | None:
    """``text`` as literals and whole component copies, or ``None`` if a copy is partial."""
    out: _Fields = []
    j = 0
    while j < len(text):
        o = owner[j]
        if o is None:
            out.append(text[j])
            j += 1
            continue
        i, k = o
        width = len(values[i])
        if k != 0 or owner[j : j + width] != [(i, p) for p in range(width)]:
            return None
        out.append(i)
        j += width
    return out


def _delimited(fields: _Fields) -> bool:
    """Whether every copied component stands between dots (or the ends) of the text."""
    for n, f in enumerate(fields):
        before_ok = n == 0 or fields[n - 1] == "."
        after_ok = n + 1 == len(fields) or fields[n + 1] == "."
        if isinstance(f, int) and not (before_ok and after_ok):
            return False
    return True


def _format(fields: _Fields) -> str:
    return "".join(
        f"{{{f}}}" if isinstance(f, int) else f.replace("{", "{{").replace("}", "}}") for f in fields
    )


def _probe(width: int, shift: int) -> str:
    return "".join(str((k + shift) % 10) for k in range(width))


def _join(parts: list[str]) -> str:
    """Inverse of ``_NUMERIC.split``."""
    out = [parts[0]]
    for digits, text in zip(parts[1::2], parts[2::2]):
        out += (".", digits, text)
    return "".join(out)


def _same_shape(a: _Decision, b: _Decision) -> bool:
    return (
        a.renamings == b.renamings
        and a.converter == b.converter
        and a.pattern_index == b.pattern_index
        and len(a.indices) == len(b.indices)
    )


# --------------------------------------------------------------------------- route_keys


def route_key(key: str, transforms: Sequence[WeightTransform]) -> KeyRoute:
    """Route a single key exactly (no base-model prefix)."""
    d = _ExactRouter(transforms).decide(key)
    return KeyRoute(key, d.targets[0], d.renamings, d.converter, d.pattern_index, d.indices)


def route_keys(
    keys: Iterable[str],
    transforms: Sequence[WeightTransform],
    *,
    runtime_keys: Collection[str] | None = None,
    base_model_prefix: str | None = None,
    cache: bool = True,
    limits: KeyLimits | None = None,
) -> Routing:
    r"""Route checkpoint keys through ``transforms`` and group them by target.

    Args:
        keys: checkpoint keys.
        transforms: a resolved, scoped transform list (renamings and converters in any order;
            renamings always fire first).
        runtime_keys: the model's runtime keys. With ``base_model_prefix`` they decide, per key,
            whether adding or stripping that prefix names a real parameter.
        base_model_prefix: e.g. ``"model"``: a key whose targets are not runtime keys is routed
            again with the prefix stripped (or added), and takes that route if its targets are.
        cache: share decisions between keys of one template where that is provably exact (see
            the module docstring); ``False`` routes every key on its own (the reference).
        limits: with ``runtime_keys``, a key beyond these limits that names no runtime key (as it
            is, or with ``base_model_prefix`` added or stripped) goes to :attr:`Routing.oversized`,
            routed to itself (unexpected) without any transform running on it. Default:
            :meth:`KeyLimits.for_runtime_keys` of ``runtime_keys``. Ignored without ``runtime_keys``.

    Returns:
        A :class:`Routing` with one :class:`KeyRoute` per key and the target groups.

    Raises:
        ConfigurationError: two converters claim the same key, or a key is not a string.
        CheckpointError: a gathered index has more digits than Python converts.

    Example:
        >>> from surgery import WeightRenaming
        >>> r = route_keys(["a.gamma"], [WeightRenaming(r"\.gamma$", ".weight")])
        >>> r.routes["a.gamma"].target_key
        'a.weight'
    """
    router = _ExactRouter(transforms)
    decide = _TemplateCache(router).decide if cache and router.digit_blind else router.decide
    known: Collection[str] = runtime_keys if runtime_keys is not None else ()
    prefix = f"{base_model_prefix}." if base_model_prefix and runtime_keys is not None else ""
    routes: dict[str, KeyRoute] = {}
    groups: dict[str, TargetGroup] = {}
    conflicts: list[RouteConflict] = []
    oversized: list[str] = []
    keys = keys if isinstance(keys, list) else list(keys)
    bad = next((k for k in keys if not isinstance(k, str)), _MISSING)
    if bad is not _MISSING:
        raise ConfigurationError(f"Checkpoint keys must be strings, got {bad!r}; pass the tensor names.")
    if runtime_keys is None:
        limits = None
    elif limits is None:
        limits = KeyLimits.for_runtime_keys(known)
    elif not isinstance(limits, KeyLimits):
        raise ConfigurationError(
            f"limits must be a KeyLimits, got {limits!r}; e.g. limits=KeyLimits(max_length=4096)."
        )
    try:
        for key in keys:
            how = BasePrefix.UNUSED
            if limits is not None and limits.exceeded_by(key) and not _is_runtime_key(key, prefix, known):
                d = _Decision((key,), (), None, None, ())  # no pattern runs over it: unexpected
                oversized.append(key)
            else:
                d = decide(key)
                if prefix and not _names_runtime_keys(d.targets, known):
                    d, how = _with_base_prefix(key, d, prefix, known, decide)
            targets, renamings, converter, pattern_index, index = d
            first = targets[0]
            routes[key] = KeyRoute(key, first, renamings, converter, pattern_index, index, how)
            group = groups.get(first)
            if group is None:
                group = groups[first] = TargetGroup(first, converter, targets)
            elif group.converter != converter:
                conflicts.append(RouteConflict(first, group.source_keys[0], key))
                continue
            slot = group.sources.setdefault(pattern_index or 0, {})
            if index in slot:
                conflicts.append(RouteConflict(first, slot[index], key))
                continue
            slot[index] = key
    except SurgeryError:
        raise  # our own errors are ValueErrors too
    except ValueError as exc:  # int() of an index too long to convert (Python's digit limit)
        shown = key if len(key) <= 120 else f"{key[:60]}...{key[-40:]}"
        raise CheckpointError(
            f"Checkpoint key {shown!r} ({len(key)} characters) has an index too long to use ({exc}); "
            "expert and layer indices are small numbers. Fix or drop the key."
        ) from None
    return Routing(router.transforms, routes, groups, conflicts, oversized, limits)


def _is_runtime_key(key: str, prefix: str, known: Collection[str]) -> bool:
    """Whether ``key`` names a runtime key as it is, or with ``prefix`` added or stripped."""
    if key in known:
        return True
    if not prefix:
        return False
    return (key[len(prefix) :] if key.startswith(prefix) else prefix + key) in known


def _names_runtime_keys(targets: tuple[str, ...], known: Collection[str]) -> bool:
    # A target whose ``*`` the op chain fills is checked by its first member.
    if len(targets) == 1:  # the common case, without a generator
        t = targets[0]
        return (t.replace("*", "0") if "*" in t else t) in known
    return all((t.replace("*", "0") if "*" in t else t) in known for t in targets)


def _with_base_prefix(
    key: str, d: _Decision, prefix: str, known: Collection[str], decide: object
) -> tuple[_Decision, BasePrefix]:
    """The base-model-prefix form of a key whose targets name no runtime key (else ``d``).

    First the routed targets with ``prefix`` stripped or added (a checkpoint of the model with a
    head, renamed, then loaded into the bare base model), then the checkpoint key with ``prefix``
    stripped or added and routed again (so that transforms scoped under the prefix see it).
    """
    if all(t.startswith(prefix) for t in d.targets):
        moved, how = tuple(t[len(prefix) :] for t in d.targets), BasePrefix.STRIPPED_AFTER
    else:
        moved, how = tuple(prefix + t for t in d.targets), BasePrefix.ADDED_AFTER
    if _names_runtime_keys(moved, known):
        return d._replace(targets=moved), how
    stripped = key.startswith(prefix)
    alt: _Decision = decide(key[len(prefix) :] if stripped else prefix + key)  # type: ignore[operator]
    if _names_runtime_keys(alt.targets, known):
        return alt, BasePrefix.STRIPPED_BEFORE if stripped else BasePrefix.ADDED_BEFORE
    return d, BasePrefix.UNUSED
