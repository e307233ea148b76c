"""The architecture as checks on the source: what no module of ``surgery/`` or ``specs/`` does.

Each rule reads the AST of every module (nothing is imported). Where today's code still breaks a
rule that issue 26 is removing in parallel branches, the offenders are listed, with why, in the
rule's ``KNOWN_*`` list: a rule fails on an offender that is not listed *and* on a listed one
that no longer offends, so each list holds exactly what is left to fix and ends up empty.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("surgery", "specs")


@dataclass(frozen=True)
class Module:
    name: str  # dotted: surgery.load.loader; a package is its __init__: surgery.load
    path: Path
    is_package: bool

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix() if self.path.is_relative_to(ROOT) else self.path.name

    @functools.cached_property
    def tree(self) -> ast.Module:
        return ast.parse(self.path.read_text(), str(self.path))


@functools.cache
def _modules() -> dict[str, Module]:
    out: dict[str, Module] = {}
    for top in FIRST_PARTY:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            out[name] = Module(name, path, is_package)
    return out


def _imported_from(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _first_party(name: str) -> bool:
    return name.split(".")[0] in FIRST_PARTY


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method, with its qualified name (``Class.method``, ``outer.inner``)."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _enclosing(tree: ast.Module) -> dict[ast.AST, str]:
    """Node -> the qualified name of the innermost function around it (``<module>`` outside any)."""
    where: dict[ast.AST, str] = {}
    for node in ast.walk(tree):
        where.setdefault(node, "<module>")
    for qualname, fn in _functions(tree):  # outer functions come first: inner ones overwrite
        for node in ast.walk(fn):
            where[node] = qualname
    return where


# --------------------------------------------------------------------------- (a) private names


def _private_uses(module: Module) -> list[str]:
    """``from x import _y`` and ``x._y`` where ``x`` is another first-party module."""
    found: list[str] = []
    bound: dict[str, str] = {}  # local name -> first-party module it is bound to
    modules = _modules()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _first_party(alias.name):
                    local = alias.asname or alias.name.split(".")[0]
                    bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            source = _imported_from(module, node)
            if not _first_party(source):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"from {source} import {alias.name}")
                if f"{source}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
    for node in ast.walk(module.tree):
        if not (
            isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        ):
            continue
        chain = _dotted(node.value)
        if chain is None or chain.split(".")[0] not in bound:
            continue
        head, _, rest = chain.partition(".")
        target = ".".join(filter(None, (bound[head], rest)))
        if target in modules and target != module.name:
            found.append(f"{target}.{node.attr}")
    return found


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def test_no_module_imports_or_reads_another_modules_private_names() -> None:
    found = {f"{m.rel}: {use}" for m in _modules().values() for use in _private_uses(m)}
    assert sorted(found) == []  # make the name public (in its module's __all__), or move the code


# --------------------------------------------------------------------------- (b) tags and repr identity

_KEY_CONSTANT = re.compile(r"_?[A-Z][A-Z0-9_]*")


def _is_tag_key(key: ast.expr) -> bool:
    """A constant key: a string literal or an UPPER_CASE name (a module's tag constant)."""
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return True
    name = key.attr if isinstance(key, ast.Attribute) else key.id if isinstance(key, ast.Name) else ""
    return bool(_KEY_CONSTANT.fullmatch(name))


def _owned(obj: ast.expr) -> bool:
    """``self`` or an attribute of it: an object the code's own class holds."""
    chain = _dotted(obj)
    return chain is not None and chain.split(".")[0] in ("self", "cls")


def _dict_of(node: ast.expr) -> ast.expr | None:
    """``obj`` when ``node`` is ``obj.__dict__``, else ``None``."""
    return node.value if isinstance(node, ast.Attribute) and node.attr == "__dict__" else None


def _tags(module: Module) -> set[str]:
    """Where a module reads or writes a constant key in the ``__dict__`` of an object it does not own.

    The rule: ``obj.__dict__[KEY]``, ``obj.__dict__.get/setdefault/pop(KEY, ...)`` and
    ``KEY in obj.__dict__``, with ``KEY`` a string literal or an UPPER_CASE constant and ``obj``
    not ``self`` (or an attribute of it). That is a side channel: state handed to another module
    through an object neither owns. Bulk ``__dict__`` work on ``nn.Module`` internals (copying a
    module's attributes, looking a variable name up) uses variable keys and is not a tag.
    """
    where = _enclosing(module.tree)
    found: set[str] = set()
    for node in ast.walk(module.tree):
        obj = key = None
        if isinstance(node, ast.Subscript) and (obj := _dict_of(node.value)) is not None:
            key = node.slice
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "setdefault", "pop")
            and (obj := _dict_of(node.func.value)) is not None
            and node.args
        ):
            key = node.args[0]
        elif (
            isinstance(node, ast.Compare)
            and isinstance(node.ops[0], (ast.In, ast.NotIn))
            and (obj := _dict_of(node.comparators[0])) is not None
        ):
            key = node.left
        if obj is not None and key is not None and _is_tag_key(key) and not _owned(obj):
            found.add(f"{module.rel}:{where[node]}: {ast.unparse(key)}")
    return found


KNOWN_TAGS = {
    # The one attribute a model carries (issue 26): surgery/record.py owns it, and every other
    # module reads and writes the model's record through record_of / update_record.
    "surgery/record.py:record_of: _ATTRIBUTE",
    "surgery/record.py:update_record: _ATTRIBUTE",
}


def test_no_module_passes_state_through_tags_in_objects_it_does_not_own() -> None:
    found = set().union(*(_tags(m) for m in _modules().values()))
    assert sorted(found - KNOWN_TAGS) == []  # pass a typed record instead (see surgery/record.py)
    assert sorted(KNOWN_TAGS - found) == []  # fixed: take it off KNOWN_TAGS


def _repr_identities(module: Module) -> set[str]:
    """Where ``repr(x)`` stands for ``x``'s identity: compared (``==``, ``!=``, ``in``) or used
    as a set element or dict key. Showing a repr to a person is fine; deciding with it is not."""
    where = _enclosing(module.tree)

    def is_repr(node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "repr"

    found: set[str] = set()
    for node in ast.walk(module.tree):
        operands: list[ast.expr] = []
        if isinstance(node, ast.Compare) and all(
            isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops
        ):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Set):
            operands = list(node.elts)
        elif isinstance(node, ast.SetComp):
            operands = [node.elt]
        elif isinstance(node, ast.DictComp):
            operands = [node.key]
        elif isinstance(node, ast.Dict):
            operands = [k for k in node.keys if k is not None]
        if any(is_repr(o) for o in operands):
            found.add(f"{module.rel}:{where[node]}")
    return found


KNOWN_REPR_IDENTITIES: set[str] = set()  # transforms are frozen values (issue 26 step 1)


def test_no_module_compares_objects_by_their_repr() -> None:
    found = set().union(*(_repr_identities(m) for m in _modules().values()))
    assert sorted(found - KNOWN_REPR_IDENTITIES) == []  # compare the values (a frozen dataclass)
    assert sorted(KNOWN_REPR_IDENTITIES - found) == []  # fixed: take it off the list


# --------------------------------------------------------------------------- (c) import circles


def _import_graph() -> nx.DiGraph:
    """Module -> the first-party modules it imports anywhere: top level, in a function, or under
    ``TYPE_CHECKING``. ``from p import m`` counts as importing ``p.m`` when that is a module."""
    modules = _modules()
    graph = nx.DiGraph()
    for module in modules.values():
        graph.add_node(module.name)
        for node in ast.walk(module.tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name in modules]
            elif isinstance(node, ast.ImportFrom):
                source = _imported_from(module, node)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in modules:
                        targets.append(sub)
                    elif source in modules:
                        targets.append(source)
            graph.add_edges_from((module.name, t) for t in targets if t != module.name)
    return graph


KNOWN_CIRCLES: set[frozenset[str]] = set()


def test_no_two_modules_import_each_other_even_indirectly() -> None:
    circles = {frozenset(c) for c in nx.strongly_connected_components(_import_graph()) if len(c) > 1}
    assert sorted(map(sorted, circles - KNOWN_CIRCLES)) == []  # one side should not know the other
    assert sorted(map(sorted, KNOWN_CIRCLES - circles)) == []  # fixed: take it off the list


def test_the_import_graph_sees_imports_in_functions_and_under_type_checking() -> None:
    graph = _import_graph()
    assert graph.has_edge("surgery", "surgery.load")  # only under TYPE_CHECKING
    assert graph.has_edge("surgery.ops", "surgery.meta")  # ``from . import meta``
    assert graph.has_edge("specs.sibling_linears", "surgery.fusion.matching")


# --------------------------------------------------------------------------- (d) function length

MAX_FUNCTION_LINES = 80
SHORT_FUNCTION_PACKAGES = ("surgery/load", "surgery/save", "surgery/parallel")
"""Packages whose functions stay short (issue 26: planning as named passes); a package that
does not exist yet is checked once it does."""


def _docstring_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A public function's Args/Returns/Raises text is documentation, not length to split."""
    first = fn.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return (first.end_lineno or first.lineno) - first.lineno + 1
    return 0


def _long_functions() -> dict[str, int]:
    found: dict[str, int] = {}
    for module in _modules().values():
        if not module.rel.startswith(tuple(p + "/" for p in SHORT_FUNCTION_PACKAGES)):
            continue
        for qualname, fn in _functions(module.tree):
            lines = (fn.end_lineno or fn.lineno) - fn.lineno + 1 - _docstring_lines(fn)
            if lines > MAX_FUNCTION_LINES:
                found[f"{module.rel}:{qualname}"] = lines
    return found


KNOWN_LONG_FUNCTIONS: set[str] = set()  # prepare and load_checkpoint are named passes (issue 26)


def test_no_function_in_load_save_or_parallel_is_longer_than_80_lines() -> None:
    """Counted without the docstring: signature and code."""
    found = _long_functions()
    assert sorted(set(found) - KNOWN_LONG_FUNCTIONS) == []  # split it into named steps
    assert sorted(KNOWN_LONG_FUNCTIONS - set(found)) == []  # fixed: take it off the list


# --------------------------------------------------------------------------- package maps


def _packages() -> list[Module]:
    return [m for m in _modules().values() if m.is_package and m.name.startswith("surgery")]


def _children(package: Module) -> set[str]:
    folder = package.path.parent
    files = {p.stem for p in folder.glob("*.py")} - {"__init__", "__main__"}
    return files | {p.parent.name for p in folder.glob("*/__init__.py")}


def _package_map(package: Module) -> tuple[set[str], set[str]] | None:
    """What a package docstring's map names: ``(at the head of a bullet, anywhere in it)``, or
    ``None`` when the docstring has no map. A module is written ``name`` or :mod:`~package.name`."""
    doc = ast.get_docstring(package.tree) or ""
    bullets = re.findall(r"^\* (.*(?:\n  .*)*)", doc, re.M)
    if not bullets:
        return None

    def names(text: str) -> set[str]:
        found = set(re.findall(r"``(\w+)``", text))
        return found | {n.rsplit(".", 1)[-1] for n in re.findall(r":mod:`~?([\w.]+)`", text)}

    heads = set().union(*(names(b.split(": ", 1)[0]) for b in bullets))
    return heads, set().union(*(names(b) for b in bullets))


@pytest.mark.parametrize("package", _packages(), ids=lambda p: p.name)
def test_a_package_map_names_each_of_its_modules_and_nothing_else(package: Module) -> None:
    found = _package_map(package)
    if found is None:
        assert package.name != "surgery"  # the top-level package is always mapped
        pytest.skip(f"{package.name}'s docstring has no map")
    heads, named = found
    assert sorted(_children(package) - named) == []  # add it to the map
    assert sorted(heads - _children(package)) == []  # a bullet names a module that is gone


def test_the_top_level_names_every_public_name_lazily_and_for_type_checkers() -> None:
    """``surgery.__all__`` is the lazy map's keys; each is re-exported under ``TYPE_CHECKING``
    (``from .m import X as X``) from the module the lazy map names."""
    import surgery

    tree = _modules()["surgery"].tree
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                for alias in imp.names:
                    assert alias.asname == alias.name, f"{alias.name}: write it `as {alias.name}`"
                    module = "." + (imp.module or "")
                    typed[alias.name] = module if imp.module else "." + alias.name
    lazy = importlib.import_module("surgery")._LAZY
    assert surgery.__all__ == sorted(lazy)
    assert typed == lazy


def test_the_rules_catch_what_they_describe(tmp_path: Path) -> None:
    path = tmp_path / "offender.py"
    path.write_text(
        "from surgery.load.planner import _private\n"
        "import surgery.load.loader as loader\n"
        "from . import ops\n"
        "def f(t, m, name, a, b):\n"
        "    ops._cat, loader._x, ops.Chunk\n"
        "    t.__dict__[FUSION_TAG] = True\n"
        "    self.__dict__['_variants'] = 1  # its own object\n"
        "    m.__dict__.get(name)  # a variable key: nn.Module internals\n"
        "    print(repr(a))  # shown, not compared\n"
        "    return repr(a) == repr(b) or a in {repr(x) for x in b}\n"
    )
    module = Module("surgery.offender", path, is_package=False)
    assert sorted(_private_uses(module)) == [
        "from surgery.load.planner import _private",
        "surgery.load.loader._x",
        "surgery.ops._cat",
    ]
    assert _tags(module) == {"offender.py:f: FUSION_TAG"}
    assert _repr_identities(module) == {"offender.py:f"}
