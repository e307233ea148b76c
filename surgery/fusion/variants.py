"""One traced graph per case a forward branches on, and the choice among them at run time.

Symbolic tracing evaluates Python control flow once. Two kinds of branch are common in the
modules a fusion rewrites, and both are known before the call, from the call itself:

* ``self.training`` (``dropout=p if self.training else 0.0``);
* whether an optional state argument holds a value: ``if past_key_values is not None:
  k, v = past_key_values.update(k, v, self.layer_idx)``. Such an argument (a name in
  :data:`~surgery.fusion.tracing.NONE_IN_INFERENCE` whose default is ``None``) is traced once as
  ``None`` and once as a value; as a value, what the forward does with it (``.update(...)``)
  becomes a call the graph makes on the real object at run time, so the cache keeps its own
  code (dynamic, static, sliding window ...) and is never traced into.

A :class:`Variant` names one such case. A fused module keeps a :class:`VariantTable`: the
rewritten graph of every case and its compiled forward; its ``forward`` looks at the mode and at
which of those arguments are ``None``, and runs that case's code. Cases whose traced code is the
same share one graph.
"""

from __future__ import annotations

import itertools
import linecache
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import fx
from torch.fx.graph import PythonCode

from ..errors import FusionError

__all__ = ["TracedVariants", "Variant", "VariantTable", "compile_forward", "every_variant"]


@dataclass(frozen=True)
class Variant:
    """One case of a forward: the train/eval mode, and which optional state arguments hold a value.

    Attributes:
        training: ``self.training`` during the call.
        given: the names of the optional state arguments (``past_key_values`` ...) that are not ``None``.
    """

    training: bool
    given: frozenset[str] = frozenset()

    def __str__(self) -> str:
        mode = "train" if self.training else "eval"
        given = ", ".join(sorted(self.given))
        return f"{mode}, {given} given" if given else f"{mode}, no state argument given"


def every_variant(*, training: bool, reads_training: bool, optional: Sequence[str]) -> list[Variant]:
    """Every case to trace: both modes when the forward reads ``self.training`` (else the current
    one), times every subset of ``optional``; the current mode with nothing given comes first."""
    modes = (training, not training) if reads_training else (training,)
    subsets = [
        frozenset(c) for r in range(len(optional) + 1) for c in itertools.combinations(sorted(optional), r)
    ]
    return [Variant(mode, given) for mode in modes for given in subsets]


@runtime_checkable
class TracedVariants(Protocol):
    """A module that already runs one forward per case (a fused module): tracing it again traces
    the forward of the case asked for."""

    def forward_for(self, variant: Variant) -> Callable[..., Any]:
        """The (unbound) forward that runs in ``variant``."""
        ...

    def optional_arguments(self) -> tuple[str, ...]:
        """The optional state arguments its forward branches on."""
        ...

    def reads_training(self) -> bool:
        """Whether its train and eval graphs differ."""
        ...


_compiled = itertools.count()


def compile_forward(code: PythonCode, *, name: str) -> Callable[..., Any]:
    """The ``forward(self, ...)`` function of a graph's generated ``code``
    (``graph.python_code(root_module="self")``), as :class:`torch.fx.GraphModule` makes it, with its
    source registered in :mod:`linecache` so tracebacks show the generated lines."""
    filename = f"<surgery fused forward {next(_compiled)}: {name}>"
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(keepends=True), filename)
    namespace = dict(code.globals)
    exec(compile(code.src, filename, "exec", dont_inherit=True), namespace)
    forward: Callable[..., Any] = namespace["forward"]
    return forward


@dataclass(frozen=True)
class VariantTable:
    """The graph and compiled forward of every case of one fused module.

    Attributes:
        graphs: the rewritten graph of each case (cases with the same code share one).
        forwards: the compiled forward of each case, one entry for each of both modes and every
            subset of ``slots`` (a mode the forward does not read maps to the same code).
        slots: each optional state argument with its position among the forward's parameters
            (after ``self``), so a call is classified without binding its signature.
        reads_training: whether the train and eval graphs differ.
    """

    graphs: Mapping[Variant, fx.Graph]
    forwards: Mapping[Variant, Callable[..., Any]]
    slots: tuple[tuple[str, int], ...]
    reads_training: bool

    @classmethod
    def build(
        cls, graphs: Mapping[Variant, fx.Graph], *, class_name: str, reads_training: bool
    ) -> VariantTable:
        """Compile ``graphs`` (the first is the default case; a case missing from ``graphs`` has its
        code) and fill in the other mode when the forward does not read it."""
        first = next(iter(graphs))
        optional = sorted(set().union(*(v.given for v in graphs)))
        slots = _slots(graphs[first], optional)
        by_code: dict[str, Callable[..., Any]] = {}
        compiled: dict[Variant, Callable[..., Any]] = {}
        for variant, graph in graphs.items():
            code = graph.python_code(root_module="self")
            if code.src not in by_code:
                by_code[code.src] = compile_forward(code, name=f"{class_name} ({variant})")
            compiled[variant] = by_code[code.src]
        forwards: dict[Variant, Callable[..., Any]] = {}
        for variant in every_variant(training=first.training, reads_training=True, optional=optional):
            traced = variant if reads_training else Variant(first.training, variant.given)
            forwards[variant] = compiled.get(traced, compiled[first])
        return cls(dict(graphs), forwards, slots, reads_training)

    def select(self, training: bool, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Callable[..., Any]:
        """The forward of the case a call with ``args``/``kwargs`` in mode ``training`` is."""
        given = frozenset(
            name
            for name, index in self.slots
            if (kwargs[name] if name in kwargs else args[index] if index < len(args) else None) is not None
        )
        return self.forwards[Variant(training, given)]

    def graph_for(self, variant: Variant) -> fx.Graph | None:
        """The graph of ``variant`` when it was traced separately."""
        return self.graphs.get(variant)

    def __iter__(self) -> Iterator[Variant]:
        return iter(self.graphs)


def _slots(graph: fx.Graph, optional: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """Each name of ``optional`` with its position among the graph's positional placeholders."""
    names = [
        str(n.target) for n in graph.nodes if n.op == "placeholder" and not str(n.target).startswith("*")
    ]
    missing = [o for o in optional if o not in names]
    if missing:
        raise FusionError(f"the traced forward has no parameter {missing[0]!r} (parameters: {names})")
    return tuple((o, names.index(o)) for o in optional)
