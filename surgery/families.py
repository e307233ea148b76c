"""Width families: template roots that differ only in how wide their last index is share one cache.

A MoE checkpoint's expert keys come in several templates per layer: experts 0-9, 10-99 and
100-127 have one-, two- and three-digit indices (``experts.0.w0``, ``experts.00.w0``, ...).
Each template has its own class tree (:class:`~surgery.fastroute.KeyClass`) and, alone, its own
cache of verdicts, so the first key of every layer and projection misses once per width. A
*width family* is the set of roots whose templates are equal outside their last numeric
component (:attr:`~surgery.fastroute.KeyClass.run_a` ... ``run_b``). Their selectors count the
positions after that component from the key's end, so corresponding keys select the same tuple,
and when the members' trees are provably interchangeable the family shares one cache: a verdict
made for one width then files the keys of every width.

The invariant: every entry of a shared cache files the keys of *every* sharing member that
select it exactly as that member's own class would. It holds because

* a family shares (:func:`try_share`, between chunks) only when every member's tree has the same
  shape, every class is a built, covered, gathering class whose wildcard index is the last
  numeric component, corresponding classes are :func:`equivalent`, and every cached verdict is
  a deferred list (the same object for equivalent classes);
* a verdict made while shared is stored only after the same check for the class it was made
  from (:func:`valid_everywhere`); otherwise, or when a member's selector must grow, the
  family stops sharing (:func:`unshare`) before anything is stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .fastroute import KeyClass, Selections
    from .provenance import Pieces

__all__ = ["Family", "equivalent", "join", "try_share", "unshare", "valid_everywhere"]


class Family:
    """The roots of one width family and, while they share one, their common cache.

    Attributes:
        members: every root of the family, in the order they were seen.
        shared: the cache the sharing members use, or ``None``.
        dirty: something changed (a member, a class built or covered) since the last
            :func:`try_share`.
    """

    __slots__ = ("counterparts", "dirty", "equal", "members", "shared")

    def __init__(self) -> None:
        self.members: list[KeyClass] = []
        self.shared: Selections | None = None
        self.dirty = True
        # What was proven, by ids (a built class never changes, and lives as long as the
        # router): pairs of equivalent classes, and (class, member) once the class's
        # counterpart in that member is known to be equivalent to it.
        self.equal: set[tuple[int, int]] = set()
        self.counterparts: set[tuple[int, int]] = set()

    def __repr__(self) -> str:
        state = "shared" if self.shared is not None else "separate"
        return f"Family({len(self.members)} members, {state})"


def join(families: dict[tuple[str, str], Family], root: KeyClass) -> None:
    """Add a new root to its family (made on first sight)."""
    name = (root.template[: root.run_a], root.template[root.run_b :])
    family = families.get(name)
    if family is None:
        family = families[name] = Family()
    family.members.append(root)
    family.dirty = True
    root.family = family


def _mapped(root: KeyClass, pieces: Pieces) -> tuple[Any, ...] | None:
    """``pieces`` with slices after the last numeric component counted from the end (``None``: one reads it)."""
    a, b, size = root.run_a, root.run_b, root.size
    out: list[Any] = []
    for p in pieces:
        if isinstance(p, tuple):
            s, e = p
            if e <= a:
                out.append(p)
            elif s >= b:
                out.append((s - size, e - size))
            else:
                return None
        else:
            out.append(p)
    return tuple(out)


def _mapped_slices(root: KeyClass) -> frozenset[tuple[int, int]] | None:
    mapped = _mapped(root, tuple(root.sel_slices))
    return None if mapped is None else frozenset(mapped)


def _gathers_by_run(root: KeyClass, c: KeyClass) -> bool:
    """``c`` is a built, covered, hot class that gathers by the root's last numeric component."""
    return c.built and c.hot and c.covered and c.ia == root.run_a and c.ib == root.run_b


def equivalent(family: Family, r1: KeyClass, c1: KeyClass, r2: KeyClass, c2: KeyClass) -> bool:
    """Whether class ``c1`` of root ``r1`` files every key exactly as ``c2`` of ``r2`` files its counterpart.

    Both gather by their roots' last numeric component with one index getter (counted from the
    end, so the same object), claim with the same converter and pattern after the same
    renamings, and build the same targets from the same positions (mapped as the selector maps
    them): a key and its counterpart then land in the same group, slot and list.
    """
    pair = (id(c1), id(c2))
    if pair in family.equal:
        return True
    if not (_gathers_by_run(r1, c1) and _gathers_by_run(r2, c2)):
        return False
    if c1.getix is not c2.getix or (c1.fired, c1.conv, c1.pat) != (c2.fired, c2.conv, c2.pat):
        return False
    for p1, p2 in zip((c1.first, *c1.targets), (c2.first, *c2.targets)):
        m1 = _mapped(r1, p1)
        if m1 is None or m1 != _mapped(r2, p2):
            return False
    if len(c1.targets) != len(c2.targets):
        return False
    family.equal.add(pair)
    return True


def _leaves(root: KeyClass) -> dict[tuple[str, ...], KeyClass]:
    """Every class of a root's tree, by the texts its splits select."""
    out: dict[tuple[str, ...], KeyClass] = {}
    stack: list[tuple[tuple[str, ...], KeyClass]] = [((), root)]
    while stack:
        path, node = stack.pop()
        if node.sb:
            stack.extend(((*path, text), child) for text, child in node.children.items())
        else:
            out[path] = node
    return out


def _is_deferred_list(verdict: object) -> bool:
    return getattr(verdict, "__self__", None).__class__ is list


def try_share(
    family: Family, caches: dict[str, Selections], cache_roots: dict[tuple[int, int], KeyClass]
) -> None:
    """Put every member that is interchangeable with the others on one cache (at least two of them).

    A family already sharing takes in the members that were not (a width seen later).
    """
    family.dirty = False
    shared = family.shared
    sharing = [m for m in family.members if m.cache is shared] if shared is not None else []
    waiting = [m for m in family.members if shared is None or m.cache is not shared]
    ref = sharing[0] if sharing else waiting[0]
    ref_leaves = _leaves(ref)
    ref_slices = _mapped_slices(ref)
    if ref_slices is None or not all(_gathers_by_run(ref, c) for c in ref_leaves.values()):
        return
    joining = [
        m
        for m in waiting
        if m is ref
        or (
            _mapped_slices(m) == ref_slices
            and (leaves := _leaves(m)).keys() == ref_leaves.keys()
            and all(equivalent(family, ref, ref_leaves[p], m, c) for p, c in leaves.items())
        )
    ]
    if len(sharing) + len(joining) < 2 or not joining:
        return
    staged: dict[Any, Any] = {}
    for m in joining:
        for selection, verdict in m.own.items():
            known = shared.get(selection, verdict) if shared is not None else verdict
            if not _is_deferred_list(verdict) or staged.setdefault(selection, verdict) is not known:
                return
    if shared is None:
        shared = family.shared = type(ref.own)()
        shared.sel = ref.own.sel
    shared.update(staged)
    for m in joining:
        m.cache = shared
        caches[m.template] = shared
        cache_roots[id(shared), m.size] = m


def valid_everywhere(family: Family, root: KeyClass, c: KeyClass, key: str, verdict: object) -> bool:
    """Whether ``verdict``, made for ``key`` of class ``c``, files every sharing member's counterpart keys."""
    if not _is_deferred_list(verdict):
        return False
    a, b = root.run_a, root.run_b
    proven = family.counterparts
    for m in family.members:
        if m is root or m.cache is not family.shared or (id(c), id(m)) in proven:
            continue
        counterpart = f"{key[:a]}{'0' * (m.run_b - a)}{key[b:]}"
        if not equivalent(family, root, c, m, m.walk(counterpart)):
            return False
        proven.add((id(c), id(m)))  # every key of c has its counterpart in that class of m
    return True


def unshare(family: Family, caches: dict[str, Selections]) -> None:
    """Every member back on its own cache (emptied, with its current selector)."""
    shared = family.shared
    if shared is None:
        return
    for m in family.members:
        if m.cache is shared:
            m.cache = m.own
            caches[m.template] = m.own
            m.refresh()
    shared.clear()  # keys of this chunk that still look here miss, and are filed on their own
    family.shared = None
    family.dirty = True
