r"""Fast routing: keys that differ only in their indices share one routing decision.

A checkpoint of a large model has few *shapes* of keys and many indices:
``model.layers.{L}.block_sparse_moe.experts.{E}.w{1,2,3}.weight`` covers most of a MoE checkpoint.
:class:`TemplateRouter` routes one representative per shape through the exact path
(:meth:`surgery.routing._Router.route`) and turns the result into a *format*: literal text plus
slices of the key. Every other key of that shape is then routed by slicing, with no regex at all.

**Key classes.** A *numeric component* is a dotted component made only of ASCII digits
(``12`` in ``layers.12.``). Its digits are *free*; every other digit (``1`` in ``w1``) is *fixed*.
A key's *template* is the key with every digit replaced by ``0`` (one ``str.translate`` for all
keys at once); two keys are in one class when they have the same template and the same fixed
digits. Within a class the free digits sit at the same positions, in runs of the same lengths.

**Why a shared decision is exact.** A regex engine's run is decided by the outcomes of its
single-character tests. A test is *uniform* when it accepts every ASCII digit or none of them
(``\d``, ``.``, ``[^.]``, letters, ``\b``); a transform list whose tests are all uniform cannot
tell the members of a class apart, so every member takes the same path, copies text from the same
positions and produces the same output up to the free digits it copied. One exception is admitted
and checked: a non-uniform test (the ``1`` of ``w1``) next to a *guard* in the same literal run,
where the guard is a single-character test that accepts no digit and no dot (the ``w``). A free
digit's neighbours are digits, dots or the end of the string, so the guard fails next to it
whatever its value, and the ``1`` never decides anything there. This holds in the original key by
construction and is re-checked on the intermediate key after every renaming that fires.
Backreferences, unguarded digit literals and digit subsets (``[0-3]``) make the whole list
*unsafe*: :attr:`TemplateRouter.exact_only` is then set and every key takes the exact path.
(:mod:`surgery.digitsafety` does this analysis; its names are re-exported here.)

A ``scope_prefix`` with digits (``model.layers.3``) compares free digits with a literal. The class
is then split on those positions (each value gets its own class), which keeps it exact.

**Formats.** For a class with ``n`` free digits the representative is routed once per *probe*:
probe 0 sets every free digit to ``0``; probe ``d`` sets free digit ``i`` to ``1 +`` the ``d``-th
base-9 digit of ``i``. A character of the output that is equal in all probes is literal; any
other character spells out which free digit it was copied from (:mod:`surgery.provenance`).
Each class is also checked against the exact route of a real key; any disagreement falls back to
the exact path for that class. Roots whose templates differ only in the width of their last
index can share one cache of verdicts (:mod:`surgery.families`).

A class is built on its second key: a key seen once is routed exactly (building costs a few exact
routes, which a one-off key such as ``lm_head.weight`` would never repay).

**Per key**, :func:`~surgery.routing.route_keys` then needs one ``itemgetter`` selection (the
fixed digits and the digits the targets copy), one cached lookup that yields how to file the
key, and one slice for the wildcard index; see :class:`KeyClass`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from .digitsafety import GUARDED, UNIFORM, UNSAFE, pattern_safety, transform_safety
from .errors import ConfigurationError
from .families import Family, join
from .provenance import Format, Pieces, compile_format, isolated, provenance, scope_dependence, to_pieces

if TYPE_CHECKING:
    from .routing import _Router

__all__ = [
    "GUARDED",
    "UNIFORM",
    "UNSAFE",
    "Decision",
    "KeyClass",
    "Selections",
    "TemplateRouter",
    "key_template",
    "key_templates",
    "pattern_safety",
    "transform_safety",
]

#: ``(first target, renamings fired, converter, pattern index, wildcard texts, all targets)``.
Decision = tuple[str, tuple[int, ...], "int | None", "int | None", tuple[str, ...], tuple[str, ...]]

_ZERO_BYTES = bytes.maketrans(b"123456789", b"000000000")
_NOTHING = itemgetter(slice(0, 0))  # selects "" from any key

# --------------------------------------------------------------------------- templates


def key_template(key: str) -> str:
    """``key`` with its digits replaced by ``0``.

    Example:
        >>> key_template("layers.12.w1")
        'layers.00.w0'
    """
    # A byte table beats ``str.translate``'s per-call setup; UTF-8 never puts an ASCII digit
    # byte inside a multi-byte character, so only the digits change.
    try:
        return key.encode().translate(_ZERO_BYTES).decode()
    except UnicodeEncodeError:  # a lone surrogate: encode it too (naming an error handler costs)
        return key.encode("utf-8", "surrogatepass").translate(_ZERO_BYTES).decode("utf-8", "surrogatepass")


def key_templates(keys: Sequence[str]) -> list[str]:
    """Every key's :func:`key_template`, computed in one pass over all keys.

    Raises:
        TypeError: a key is not a string.

    Example:
        >>> key_templates(["layers.12.w1", "layers.7.w3"])
        ['layers.00.w0', 'layers.0.w0']
    """
    out = key_template("\n".join(keys)).split("\n")
    if len(out) != len(keys):  # a key contains a newline: template one by one
        out = [key_template(k) for k in keys]
    return out


def _last_run(free: tuple[int, ...]) -> tuple[int, int]:
    """The span of the last run of adjacent free positions (the last numeric component); ``(0, 0)`` if none."""
    if not free:
        return 0, 0
    b = free[-1] + 1
    a = b - 1
    i = len(free) - 2
    while i >= 0 and free[i] == a - 1:
        a -= 1
        i -= 1
    return a, b


def _digit_layout(template: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Positions of free digits (numeric components) and of fixed digits in a template."""
    free: list[int] = []
    fixed: list[int] = []
    n = len(template)
    i = template.find("0")
    while i >= 0:
        j = i
        while j < n and template[j] == "0":
            j += 1
        component = (i == 0 or template[i - 1] == ".") and (j == n or template[j] == ".")
        (free if component else fixed).extend(range(i, j))
        i = template.find("0", j)
    return tuple(free), tuple(fixed)


# --------------------------------------------------------------------------- key classes


class _Children(dict):  # type: ignore[type-arg]
    """A split's children by selected text; a new text gets a new (unbuilt) child."""

    __slots__ = ("parent",)

    def __init__(self, parent: KeyClass) -> None:
        super().__init__()
        self.parent = parent

    def __missing__(self, text: str) -> KeyClass:
        child = self[text] = self.parent.make_child()
        return child


class Selections(dict):  # type: ignore[type-arg]
    """A template root's cache: selection → whatever the caller keeps (see :class:`KeyClass`).

    It carries the root's selector ``sel``, so that a caller holding the cache needs no other
    lookup per key.
    """

    __slots__ = ("sel",)

    def __init__(self) -> None:
        super().__init__()
        self.sel: Callable[[str], Any] = _NOTHING


class KeyClass:
    """A node of the class tree: a split on some key positions, or a class of keys.

    A *split* has ``sb > 0``: ``children`` maps the text ``key[sa:sb]`` to child nodes (``rest``
    holds the spans still to split on below). A *class* holds the shared decision once ``built``:
    ``first``, ``targets`` and ``stars`` are formats (literal text and ``(start, stop)`` slices of
    the key); ``tslices`` are the slices the targets copy and ``ia:ib`` the slice holding the
    wildcard index (``getix`` reads it; one getter object per slice, shared by classes). ``hot``
    is set when a key can be filed from those slices alone (at most one index, one slice).

    A template's root also carries the caller's cache for the whole tree: ``cache.sel(key)``
    selects the text of every split span and of every slice a gathering hot class's targets
    copy (``sel_slices``), which pins the class and, for a gathering class, the target group (a
    class that gathers nothing has one group per key: pinning it would cache nothing);
    ``cache`` maps that selection to whatever the caller wants to remember
    (:func:`~surgery.routing.route_keys` keeps how to file the key). :meth:`refresh` recomputes the selector and empties ``cache``.

    A root also knows its ``template``, its ``size`` and the span ``run_a:run_b`` of its last
    numeric component (``run_b == 0``: none). Its selector reads positions after that span
    counted from the key's end, so roots whose templates differ only in that component's width
    (:mod:`surgery.families`) select the same tuple from corresponding keys and can share one
    cache; ``own`` is the root's own cache and ``family`` its width family.
    """

    __slots__ = (
        "built",
        "cache",
        "cfirst",
        "children",
        "conv",
        "covered",
        "cstars",
        "ctargets",
        "family",
        "final",
        "fired",
        "first",
        "free",
        "getix",
        "hot",
        "ia",
        "ib",
        "own",
        "pat",
        "rest",
        "run_a",
        "run_b",
        "sa",
        "sb",
        "seen",
        "sel_slices",
        "size",
        "stars",
        "targets",
        "template",
        "tslices",
    )

    def __init__(self, free: tuple[int, ...], fixed: Iterable[int] = (), template: str = "") -> None:
        self.template = template  # "" below a root
        self.size = len(template)
        self.run_a, self.run_b = _last_run(free) if template else (0, 0)
        self.family: Family | None = None
        self.free = free
        self.sa = self.sb = 0
        self.rest: tuple[tuple[int, int], ...] = ()
        self.children = _Children(self)
        self.built = self.hot = self.final = self.covered = False
        self.seen = 0
        self.fired: tuple[int, ...] = ()
        self.conv: int | None = None
        self.pat: int | None = None
        self.first: Pieces = ()
        self.targets: tuple[Pieces, ...] = ()
        self.stars: tuple[Pieces, ...] = ()
        self.cfirst: Format = ("", None)
        self.ctargets: tuple[Format, ...] = ()
        self.cstars: tuple[Format, ...] = ()
        self.tslices: frozenset[tuple[int, int]] = frozenset()
        self.ia = self.ib = 0
        self.getix: Callable[[str], str] = _NOTHING
        self.sel_slices: frozenset[tuple[int, int]] = frozenset()
        self.cache = self.own = Selections()
        if fixed:
            self.split(fixed)
            self.refresh()

    def split(self, positions: Iterable[int]) -> None:
        """Turn this node into a split on ``positions``: one level per run of adjacent positions."""
        spans: list[tuple[int, int]] = []
        for p in sorted(positions):
            if spans and spans[-1][1] == p:
                spans[-1] = (spans[-1][0], p + 1)
            else:
                spans.append((p, p + 1))
        self.sa, self.sb = spans[0]
        self.rest = tuple(spans[1:])
        self.free = tuple(p for p in self.free if not any(a <= p < b for a, b in spans))

    def make_child(self) -> KeyClass:
        child = KeyClass(self.free)
        if self.rest:
            child.sa, child.sb = self.rest[0]
            child.rest = self.rest[1:]
        return child

    def refresh(self) -> None:
        """Recompute this root's selector from its tree and empty its cache."""
        slices: set[tuple[int, int]] = set()
        stack = [self]
        while stack:
            node = stack.pop()
            if node.sb:
                slices.add((node.sa, node.sb))
                stack.extend(node.children.values())
            elif node.hot and node.ib:  # a gathering class: the selection pins its group
                slices |= node.tslices
        self.sel_slices = frozenset(slices)
        # One character per position: single characters are shared objects, so a selection
        # costs one tuple (or nothing, for one position) however many digits it reads. Positions
        # after the last numeric component count from the end (see the class docstring).
        run_b, size = self.run_b, self.size
        positions = sorted({p for a, b in slices for p in range(a, b)})
        if run_b:
            positions = [p - size if p >= run_b else p for p in positions]
        self.cache.sel = itemgetter(*positions) if positions else _NOTHING
        self.cache.clear()

    def walk(self, key: str) -> KeyClass:
        """The class of ``key`` below this node (no counting, no building)."""
        node = self
        while node.sb:
            node = node.children[key[node.sa : node.sb]]
        return node

    def __repr__(self) -> str:
        if self.sb:
            return f"KeyClass(split on [{self.sa}:{self.sb}], {len(self.children)} children)"
        state = f"format {self.first!r}" if self.built else "exact"
        return f"KeyClass({state}, free={self.free})"

    def first_of(self, key: str) -> str:
        """The first target key of ``key`` (its target group)."""
        fmt, get = self.cfirst
        return fmt if get is None else fmt % get(key)

    def targets_of(self, key: str) -> tuple[str, ...]:
        """Every target key of ``key``."""
        return tuple([fmt if get is None else fmt % get(key) for fmt, get in self.ctargets])

    def stars_of(self, key: str) -> tuple[str, ...]:
        """The texts the wildcards matched in ``key``."""
        return tuple([fmt if get is None else fmt % get(key) for fmt, get in self.cstars])

    def index(self, key: str) -> tuple[int, ...]:
        """The wildcard indices of ``key``."""
        if self.hot:
            return (int(key[self.ia : self.ib]),) if self.ib else ()
        return tuple([int(s) for s in self.stars_of(key)])

    def decision(self, key: str) -> Decision:
        """The full routing decision for ``key`` (a built class only)."""
        return self.first_of(key), self.fired, self.conv, self.pat, self.stars_of(key), self.targets_of(key)


# --------------------------------------------------------------------------- router


class _Table(dict):  # type: ignore[type-arg]
    """Template → root node; a new template gets a new root (and joins its width family)."""

    __slots__ = ("cache_roots", "families")

    def __init__(self) -> None:
        super().__init__()
        self.families: dict[tuple[str, str], Family] = {}
        self.cache_roots: dict[tuple[int, int], KeyClass] = {}

    def __missing__(self, template: str) -> KeyClass:
        free, fixed = _digit_layout(template)
        node = self[template] = KeyClass(free, fixed, template)
        self.cache_roots[id(node.own), node.size] = node
        if node.run_b:
            join(self.families, node)
        return node


class _Caches(dict):  # type: ignore[type-arg]
    """Template → its root's :class:`Selections` (the root is made on first sight)."""

    __slots__ = ("table",)

    def __init__(self, table: dict[str, KeyClass]) -> None:
        super().__init__()
        self.table = table

    def __missing__(self, template: str) -> Selections:
        cache = self[template] = self.table[template].cache
        return cache


class TemplateRouter:
    """Route keys through a compiled :class:`~surgery.routing._Router`, sharing decisions.

    Attributes:
        router: the exact router.
        exact_only: the list has a pattern that may tell indices apart; every key goes exact.
        table: template → class tree (missing templates are added on lookup).
        caches: template → that tree's :class:`Selections` (likewise).
    """

    def __init__(self, router: _Router) -> None:
        self.router = router
        self.route_exact = router.route
        order = [t for _, t in router.renamings] + [c for _, c in router.converters]
        safety = [transform_safety(t) for t in order]
        self.exact_only = UNSAFE in safety
        # After renaming i fires, do later transforms rely on guards (free digits kept isolated)?
        self._guarded_after = [GUARDED in safety[i + 1 :] for i in range(len(router.renamings))]
        self.table = _Table()
        self.caches: dict[str, Selections] = _Caches(self.table)
        self._getters: dict[tuple[int, int | None], Callable[[str], str]] = {}

    def _getter(self, start: int, stop: int | None) -> Callable[[str], str]:
        """``itemgetter(slice(start, stop))``, one object per slice."""
        getter = self._getters.get((start, stop))
        if getter is None:
            getter = self._getters[start, stop] = itemgetter(slice(start, stop))
        return getter

    def route_one(self, key: str) -> Decision:
        """Route one key (shared decision where available, else exact)."""
        return self.decide(key)

    def route_many(self, keys: Iterable[str]) -> Iterator[tuple[str, Decision]]:
        """Route many keys, yielding ``(key, decision)`` in order."""
        keys = list(keys)
        if self.exact_only:
            for key in keys:
                yield key, self.route_exact(key)
            return
        for key, template in zip(keys, key_templates(keys)):
            yield key, self.decision(self.promote(self.table[template], key), key)

    def decide(self, key: str) -> Decision:
        """Route one key."""
        if self.exact_only:
            return self.route_exact(key)
        return self.decision(self.promote(self.table[key_template(key)], key), key)

    def decision(self, leaf: KeyClass, key: str) -> Decision:
        """``key``'s decision from its class ``leaf`` (the exact path when not built)."""
        return leaf.decision(key) if leaf.built else self.route_exact(key)

    def promote(self, node: KeyClass, key: str) -> KeyClass:
        """Walk from ``node`` to ``key``'s class, counting the key; build the class on its second key.

        Raises:
            ConfigurationError: two converters claim ``key`` (from the exact path).
        """
        while True:
            if node.sb:
                node = node.children[key[node.sa : node.sb]]
                continue
            if node.built or node.final:
                return node
            node.seen += 1
            if node.seen < 2:
                return node
            self._build(node, key)
            if not node.sb:
                return node

    # ------------------------------------------------------------------ building a class
    def _build(self, node: KeyClass, key: str) -> None:
        exact = self.route_exact(key)  # raises for overlapping converters, like the exact path
        free = node.free
        n = len(free)
        n_codes = 1
        while 9**n_codes < n:
            n_codes += 1
        chars = list(key)
        probes = []
        for d in range(n_codes + 1):
            for i, pos in enumerate(free):
                chars[pos] = "0" if d == 0 else str(1 + (i // 9 ** (d - 1)) % 9)
            probes.append("".join(chars))
        verdict = self._check_chain(probes, free)
        if isinstance(verdict, set):  # a scope compares free digits: split on them
            node.split(verdict)
            return
        node.final = True
        if not verdict or not self._set_format(node, probes, free):
            return
        if node.decision(key) != exact:  # defensive: never share a decision the exact path disowns
            node.built = node.hot = False

    def _check_chain(self, probes: list[str], free: tuple[int, ...]) -> bool | set[int]:
        """Replay the renamings on all probes; check scopes and that free digits stay isolated.

        Returns ``True`` when a shared decision is sound, ``False`` when it is not, or the key
        positions to split on when a scope prefix compares free digits.
        """
        current = probes
        n = len(free)
        for pos, (_, t) in enumerate(self.router.renamings):
            if t.scope_prefix:
                prov = provenance(current, n)
                if prov is None:
                    return False
                dep = scope_dependence(prov, t.scope_prefix, free)
                if dep:
                    return dep
            outs = [t.rename_source_key(c) for c in current]
            if len({p for _, p in outs}) != 1:
                return False
            if outs[0][1] is not None:
                current = [o for o, _ in outs]
                if self._guarded_after[pos]:
                    prov = provenance(current, n)
                    if prov is None or not isolated(prov):
                        return False
        scoped = [c.scope_prefix for _, c in self.router.converters if c.scope_prefix]
        if scoped:
            prov = provenance(current, n)
            if prov is None:
                return False
            for scope in scoped:
                dep = scope_dependence(prov, scope, free)
                if dep:
                    return dep
        return True

    def _set_format(self, node: KeyClass, probes: list[str], free: tuple[int, ...]) -> bool:
        try:
            decisions = [self.route_exact(p) for p in probes]
        except ConfigurationError:
            return False
        _, fired, conv, pat, stars, targets = decisions[0]
        for d in decisions[1:]:
            if (
                d[1] != fired
                or d[2] != conv
                or d[3] != pat
                or len(d[4]) != len(stars)
                or len(d[5]) != len(targets)
            ):
                return False
        n = len(free)

        def fmt(texts: list[str]) -> Pieces | None:
            prov = provenance(texts, n)
            return None if prov is None else to_pieces(prov, free)

        first = fmt([d[0] for d in decisions])
        target_fmts = [fmt([d[5][j] for d in decisions]) for j in range(len(targets))]
        star_fmts = [fmt([d[4][j] for d in decisions]) for j in range(len(stars))]
        if first is None or any(f is None for f in target_fmts) or any(f is None for f in star_fmts):
            return False
        node.fired, node.conv, node.pat = fired, conv, pat
        node.first = first
        node.targets = tuple(f for f in target_fmts if f is not None)
        node.stars = tuple(f for f in star_fmts if f is not None)
        node.cfirst = compile_format(first)
        node.ctargets = tuple(compile_format(f) for f in node.targets)
        node.cstars = tuple(compile_format(f) for f in node.stars)
        node.tslices = frozenset(p for f in (first, *node.targets) for p in f if isinstance(p, tuple))
        node.built = True
        if not node.stars:
            node.hot = True  # ia == ib == 0: the index text is "", the index ()
        elif len(node.stars) == 1 and len(node.stars[0]) == 1 and isinstance(node.stars[0][0], tuple):
            node.ia, node.ib = node.stars[0][0]
            # The index's end counted from the key's end (every key of a class has one length):
            # classes whose keys differ only in the index's width share one getter.
            size = len(probes[0])
            node.getix = self._getter(node.ia, node.ib - size if node.ib < size else None)
            node.hot = True
        return True
