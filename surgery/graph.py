"""A networkx view of a module tree: which modules exist, which are sub-models, what each one owns.

:class:`ModuleGraph` has one node per module, named by its dotted path (``""`` is the root), and
one edge parent → child, in ``named_modules()`` order. A module reachable under several paths
(a shared or tied module) is one node at its *canonical* path, the first one
``named_modules(remove_duplicate=False)`` reaches; the other paths are listed in the node's
``aliases``. So a walk over the graph visits every module, and every tensor, exactly once.

Node attributes (``graph.nodes[path]``):

* ``name``: the attribute name under the parent (``""`` for the root).
* ``class_name``, ``class_module``: ``type(module).__name__`` and ``type(module).__module__``.
* ``model_type``: ``module.config.model_type`` when the module has one, else ``None``.
* ``is_submodel``: see below.
* ``aliases``: the other paths of the same module instance, in visiting order.
* ``parameters``, ``buffers``: the module's *own* tensors (``recurse=False``), name →
  :class:`ModuleTensor` (shape, dtype, device; tensor data is never touched).

A module is a *sub-model* when its class name is registered in the conversion registry, or it
has a ``config.model_type`` and is a model rather than a layer holding its model's config: the
root, a module whose config is not the one of its nearest sub-model ancestor, or a module whose
class declares ``base_model_prefix`` (the transformers ``PreTrainedModel`` convention). Without
that last rule every transformers attention and MLP layer (they keep ``self.config``) would count.

Example:
    >>> import torch
    >>> g = ModuleGraph(torch.nn.Sequential(torch.nn.Linear(2, 3)))
    >>> list(g.graph.nodes)
    ['', '0']
    >>> g.nodes["0"]["parameters"]["weight"].shape
    (3, 2)
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .errors import ConfigurationError
from .registry import registered_keys

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["ModuleGraph", "ModuleTensor", "match_modules", "submodels_of", "swap_module"]


@dataclass(frozen=True, slots=True)
class ModuleTensor:
    """What the graph records about one parameter or buffer.

    Attributes:
        shape: the tensor's shape.
        dtype: its dtype.
        device: its device (``meta`` for a model built without storage).
        tied_to: the runtime key this name shares its tensor with, when another name reached the
            same tensor first (``lm_head.weight`` → ``model.embed_tokens.weight``); else ``None``.
        persistent: ``False`` for a buffer registered with ``persistent=False`` (not in the state dict).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    tied_to: str | None = None
    persistent: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def match_modules(model: nn.Module, pattern: str) -> list[str]:
    """Module paths matching ``pattern`` component by component (``*`` = one component).

    The pattern language of a ``tp_plan`` and of a quantizer's ``targets``: each dotted component
    is an :func:`fnmatch.fnmatchcase` pattern for one attribute name; ``""`` is the root.

    Example:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> match_modules(m, "*")
        ['0', '1']
    """
    if pattern == "":
        return [""]
    atoms = pattern.split(".")
    found: list[str] = []

    def walk(module: nn.Module, prefix: str, depth: int) -> None:
        for name, child in module.named_children():
            if fnmatch.fnmatchcase(name, atoms[depth]):
                path = f"{prefix}{name}"
                if depth + 1 == len(atoms):
                    found.append(path)
                else:
                    walk(child, path + ".", depth + 1)

    walk(model, "", 0)
    return found


def swap_module(model: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``path`` (a child of its parent instance, never a class change); return the old module."""
    if not path:
        raise ConfigurationError("cannot swap the root module; pass its parent and the child's path.")
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    if name not in parent._modules:
        raise ConfigurationError(f"{path!r} is not a submodule of {type(model).__name__}.")
    old = parent._modules[name]
    parent._modules[name] = new
    return old  # type: ignore[return-value]


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _model_type(module: nn.Module) -> str | None:
    try:
        config = getattr(module, "config", None)
        model_type = getattr(config, "model_type", None) if config is not None else None
    except Exception:  # a broken ``config`` property is not our concern here
        return None
    return model_type if isinstance(model_type, str) and model_type else None


def _check_module(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigurationError(
            f"ModuleGraph needs a torch.nn.Module, got {type(model).__name__}: {model!r}."
        )


def _walk(
    model: nn.Module, registered: frozenset[str]
) -> Iterator[tuple[str, nn.Module, str | None, str | None, bool]]:
    """``named_modules(remove_duplicate=False)`` with what the graph records per module.

    Yields ``(path, module, canonical, model_type, is_submodel)``: ``canonical`` is the path of
    the module's first visit when ``path`` is an alias (then the other two are ``None``/``False``),
    else ``None``.
    """
    path_of: dict[int, str] = {}
    context: dict[str, object] = {}  # path -> config of the nearest sub-model at or above it
    for path, module in model.named_modules(remove_duplicate=False):
        canonical = path_of.get(id(module))
        if canonical is not None:
            yield path, module, canonical, None, False
            continue
        path_of[id(module)] = path
        cls = type(module)
        model_type = _model_type(module)
        parent_config = context.get(_parent(path)) if path else None
        config = getattr(module, "config", None) if model_type is not None else None
        is_submodel = cls.__name__ in registered or (
            model_type is not None
            and (not path or config is not parent_config or hasattr(cls, "base_model_prefix"))
        )
        context[path] = config if is_submodel and config is not None else parent_config
        yield path, module, None, model_type, is_submodel


def submodels_of(model: nn.Module) -> list[tuple[str, nn.Module, str | None]]:
    """``(path, module, model_type)`` of every sub-model, as :meth:`ModuleGraph.submodels` lists them.

    The same walk as building a :class:`ModuleGraph`, without the graph: no ``networkx`` import
    and no per-tensor records, for callers (resolution on every load) that need only this.

    Raises:
        ConfigurationError: ``model`` is not a module.

    Example:
        >>> import torch
        >>> submodels_of(torch.nn.Sequential(torch.nn.Linear(2, 3)))
        []
    """
    _check_module(model)
    return [
        (path, module, model_type)
        for path, module, canonical, model_type, is_submodel in _walk(model, registered_keys())
        if canonical is None and is_submodel
    ]


class ModuleGraph:
    """A ``networkx.DiGraph`` of ``model``'s modules (see the module docstring for the attributes).

    Args:
        model: the module tree to describe. The graph is a snapshot: rebuild it after a rewrite.

    Attributes:
        model: the module the graph was built from.
        graph: the ``networkx.DiGraph``; nodes are canonical dotted paths, edges parent → child
            (edge attribute ``name``), children in ``named_modules()`` order.

    Example:
        >>> import torch
        >>> emb = torch.nn.Embedding(4, 2)
        >>> head = torch.nn.Linear(2, 4, bias=False)
        >>> head.weight = emb.weight
        >>> ModuleGraph(torch.nn.ModuleDict({"emb": emb, "head": head})).tied_parameters()
        [['emb.weight', 'head.weight']]
    """

    def __init__(self, model: nn.Module) -> None:
        _check_module(model)
        self.model = model
        import networkx  # here, not at module level: `import surgery` stays fast (docs/benchmarks.md)

        self.graph: nx.DiGraph = networkx.DiGraph()
        self._modules: dict[str, nn.Module] = {}  # canonical path -> module
        self._canonical: dict[str, str] = {}  # every path (aliases too) -> canonical path
        self._tensor_keys: dict[int, list[str]] = {}  # id(parameter) -> runtime keys, first = canonical
        self._totals: dict[str, int] | None = None
        self._build(registered_keys())

    # ------------------------------------------------------------------ construction
    def _build(self, registered: frozenset[str]) -> None:
        nodes: list[tuple[str, dict[str, Any]]] = []
        edges: list[tuple[str, str, dict[str, str]]] = []
        aliases: dict[str, list[str]] = {}
        tensor_keys = self._tensor_keys
        for path, module, canonical, model_type, is_submodel in _walk(self.model, registered):
            if canonical is not None:
                self._canonical[path] = canonical
                aliases.setdefault(canonical, []).append(path)
                for name, p in module._parameters.items():
                    if p is not None:
                        tensor_keys.setdefault(id(p), []).append(_join(path, name))
                continue
            self._canonical[path] = path
            self._modules[path] = module
            cls = type(module)
            nodes.append(
                (
                    path,
                    {
                        "name": path.rpartition(".")[2],
                        "class_name": cls.__name__,
                        "class_module": cls.__module__,
                        "model_type": model_type,
                        "is_submodel": is_submodel,
                        "aliases": (),
                        "parameters": self._own_parameters(path, module),
                        "buffers": self._own_buffers(path, module),
                    },
                )
            )
            if path:
                edges.append((_parent(path), path, {"name": path.rpartition(".")[2]}))
        self.graph.add_nodes_from(nodes)
        self.graph.add_edges_from(edges)
        for canonical, others in aliases.items():
            self.graph.nodes[canonical]["aliases"] = tuple(others)

    def _own_parameters(self, path: str, module: nn.Module) -> dict[str, ModuleTensor]:
        out: dict[str, ModuleTensor] = {}
        for name, p in module._parameters.items():
            if p is None:
                continue
            keys = self._tensor_keys.setdefault(id(p), [])
            key = _join(path, name)
            out[name] = ModuleTensor(tuple(p.shape), p.dtype, p.device, keys[0] if keys else None)
            keys.append(key)
        return out

    @staticmethod
    def _own_buffers(path: str, module: nn.Module) -> dict[str, ModuleTensor]:
        skip = module._non_persistent_buffers_set
        return {
            name: ModuleTensor(tuple(b.shape), b.dtype, b.device, None, name not in skip)
            for name, b in module._buffers.items()
            if b is not None
        }

    # ------------------------------------------------------------------ lookups
    @property
    def nodes(self) -> Any:
        """``graph.nodes``: ``graph.nodes[path]`` is the attribute dict of a canonical path."""
        return self.graph.nodes

    def __len__(self) -> int:
        return self.graph.number_of_nodes()

    def __iter__(self) -> Iterator[str]:
        return iter(self.graph)

    def __contains__(self, path: object) -> bool:
        return path in self._canonical

    def canonical(self, path: str) -> str:
        """The canonical path of the module at ``path`` (``path`` itself unless it is an alias).

        Raises:
            ConfigurationError: no module lives at ``path``; the message lists close matches.
        """
        try:
            return self._canonical[path]
        except (KeyError, TypeError):
            raise self._missing(path, "module path") from None

    def module(self, path: str) -> nn.Module:
        """The module at ``path`` (canonical or alias)."""
        return self._modules[self.canonical(path)]

    def submodels(self) -> Iterator[tuple[str, nn.Module]]:
        """Every sub-model, ``(canonical path, module)``, depth first in ``named_modules()`` order."""
        for path, data in self.graph.nodes(data=True):
            if data["is_submodel"]:
                yield path, self._modules[path]

    def ancestors(self, path: str) -> list[str]:
        """The modules containing ``path``, nearest first, ending with the root ``""``.

        The ancestry follows ``path`` as written (an alias path has its own parents); each entry is
        a canonical path. The root has no ancestors.
        """
        self.canonical(path)
        out: list[str] = []
        while path:
            path = _parent(path)
            out.append(self._canonical[path])
        return out

    def subtree(self, path: str) -> list[str]:
        """``path`` (made canonical) and every module below it, in ``named_modules()`` order."""
        start = self.canonical(path)
        out: list[str] = []
        stack = [start]
        while stack:
            path = stack.pop()
            out.append(path)
            stack.extend(reversed(list(self.graph.successors(path))))
        return out

    def owner(self, param_key: str) -> str:
        """The nearest sub-model containing runtime key ``param_key`` (a parameter or buffer name).

        The root counts as the owner of last resort, sub-model or not. Ownership follows the key as
        written: a tied ``lm_head.weight`` belongs to whatever contains ``lm_head``.

        Raises:
            ConfigurationError: ``param_key`` names no parameter or buffer of the model.
        """
        module_path, _, leaf = param_key.rpartition(".") if isinstance(param_key, str) else ("", "", "")
        canonical = self._canonical.get(module_path)
        if (
            canonical is None
            or not leaf
            or not (
                leaf in self.graph.nodes[canonical]["parameters"]
                or leaf in self.graph.nodes[canonical]["buffers"]
            )
        ):
            raise self._missing(param_key, "parameter or buffer", self._all_tensor_keys())
        path = module_path
        while True:
            node = self._canonical[path]
            if self.graph.nodes[node]["is_submodel"] or not path:
                return node
            path = _parent(path)

    def tied_parameters(self) -> list[list[str]]:
        """Groups of runtime keys that share one parameter, canonical key first, in visiting order.

        Both tied parameters (``lm_head.weight is embed_tokens.weight``) and parameters of shared
        modules (every path of the module) appear. Keys with a tensor of their own are left out.
        """
        return [list(keys) for keys in self._tensor_keys.values() if len(keys) > 1]

    def _all_tensor_keys(self) -> list[str]:
        return [
            _join(path, name)
            for path, data in self.graph.nodes(data=True)
            for name in (*data["parameters"], *data["buffers"])
        ]

    def _missing(self, what: object, kind: str, candidates: list[str] | None = None) -> ConfigurationError:
        pool = candidates if candidates is not None else list(self._canonical)
        close = difflib.get_close_matches(str(what), pool, n=3) if isinstance(what, str) else []
        hint = f" Closest: {', '.join(map(repr, close))}." if close else ""
        return ConfigurationError(
            f"{type(self.model).__name__} has no {kind} {what!r}.{hint} "
            f"Paths are dotted names from named_modules(), with '' for the root."
        )

    # ------------------------------------------------------------------ rendering
    def subtree_numel(self, path: str) -> int:
        """Parameters (elements) in the subtree at ``path``, each tensor counted once."""
        if self._totals is None:
            totals: dict[str, int] = {}
            for p, data in reversed(list(self.graph.nodes(data=True))):
                own = sum(t.numel for t in data["parameters"].values() if t.tied_to is None)
                totals[p] = totals.get(p, 0) + own
                if p:
                    parent = _parent(p)
                    totals[parent] = totals.get(parent, 0) + totals[p]
            self._totals = totals
        return self._totals[self.canonical(path)]

    def render(self, path: str = "", *, max_depth: int | None = None, collapse_repeats: bool = True) -> str:
        """An indented tree: name, class, ``[model_type]``, sub-models starred, parameter counts.

        Args:
            path: the subtree to draw (default: the whole model).
            max_depth: draw at most this many levels below ``path``.
            collapse_repeats: draw a run of numbered siblings with the same class and size
                (``layers.0`` … ``layers.99``) once, as ``0..99: 100 x Block``.
        """
        start = self.canonical(path)
        lines = [self._label(start, f"{start}:" if start else "")]
        self._render_children(start, "", 1, max_depth, collapse_repeats, lines)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()

    def __repr__(self) -> str:
        n_sub = sum(1 for _ in self.submodels())
        return f"ModuleGraph({type(self.model).__name__}: {len(self)} modules, {n_sub} sub-model(s))"

    def _render_children(
        self, path: str, indent: str, depth: int, max_depth: int | None, collapse: bool, lines: list[str]
    ) -> None:
        if max_depth is not None and depth > max_depth:
            return
        children = list(self.graph.successors(path))
        groups = self._runs(children) if collapse else [[c] for c in children]
        for i, group in enumerate(groups):
            last = i == len(groups) - 1
            first = group[0]
            name = self.graph.nodes[first]["name"]
            if len(group) > 1:
                name = f"{name}..{self.graph.nodes[group[-1]]['name']}: {len(group)} x"
            else:
                name += ":"
            lines.append(
                indent + ("└── " if last else "├── ") + self._label(first, name, each=len(group) > 1)
            )
            self._render_children(
                first, indent + ("    " if last else "│   "), depth + 1, max_depth, collapse, lines
            )

    def _runs(self, children: list[str]) -> list[list[str]]:
        """Split children into runs of consecutively numbered siblings that look alike."""
        runs: list[list[str]] = []
        for child in children:
            data = self.graph.nodes[child]
            if runs and data["name"].isdigit():
                prev = runs[-1][-1]
                pdata = self.graph.nodes[prev]
                if (
                    pdata["name"].isdigit()
                    and int(data["name"]) == int(pdata["name"]) + 1
                    and self._signature(child) == self._signature(prev)
                ):
                    runs[-1].append(child)
                    continue
            runs.append([child])
        return runs

    def _signature(self, path: str) -> tuple[object, ...]:
        data = self.graph.nodes[path]
        return (
            data["class_name"],
            data["model_type"],
            self.subtree_numel(path),
            len(self.subtree(path)),
        )

    def _label(self, path: str, name: str, *, each: bool = False) -> str:
        data = self.graph.nodes[path]
        parts = [f"{name} {data['class_name']}" if name else data["class_name"]]
        if data["model_type"] or data["is_submodel"]:
            tag = data["model_type"] or "sub-model"
            parts.append(f"[{tag}]*" if data["is_submodel"] else f"[{tag}]")
        numel = self.subtree_numel(path)
        if numel:
            parts.append(f"{_human(numel)} params{' each' if each else ''}")
        tied = [f"{n} = {t.tied_to}" for n, t in data["parameters"].items() if t.tied_to is not None]
        if tied:
            parts.append(f"(tied: {', '.join(tied)})")
        if data["aliases"]:
            parts.append(f"(also at {', '.join(data['aliases'])})")
        return "  ".join(parts)


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)
