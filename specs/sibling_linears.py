r"""Sibling projections become one matmul: ``sibling_linears``, and its presets ``qkv`` and ``gate_up``.

In the traced graph of a module, two or more ``nn.Linear`` children called on **the same input
value** with the same ``in_features``, dtype, device and bias presence are *siblings*::

    q = self.q_proj(x); k = self.k_proj(x); v = self.v_proj(x)

become one ``nn.Linear`` whose weight is theirs concatenated along the output dim, and a split
of its output (sizes may differ: grouped-query attention has ``q`` wider than ``k`` and ``v``)::

    q, k, v = torch.split(self.qkv_proj(x), local_split_sizes(self.qkv_proj.weight, [Q, K, V]), dim=-1)

Each original user reads its slice (a view of the fused output, so the split costs nothing).
The sizes are ``[Q, K, V]`` on one process; under tensor parallelism (``packed_colwise``) the
fused weight is a DTensor and the output holds only this rank's share of each part, so the split
takes the local sizes (:func:`surgery.parallel.local_split_sizes`).
A ``.view`` of a slice becomes a ``.reshape``: the same view wherever the original view was
possible on the slice's strides, a copy where it was not.

Nothing here looks at names: the presets filter the generic detection by what the group's
outputs feed, so ``wq/wk/wv`` and ``w1/w3`` are found as well as ``q_proj`` and ``gate_proj``:

* ``qkv``: three siblings whose outputs all reach one node (the attention), fused as
  ``qkv_proj`` in call order;
* ``gate_up``: two siblings of equal width whose outputs meet in one product with an
  activation on one side (``act(gate(x)) * up(x)``), fused as ``gate_up_proj`` with the
  activated one first (transformers' and vLLM's ``gate_up_proj`` row order). The activation is
  recognised by what it does, not by its name: any module, function or method applied element
  by element to that one output (:func:`surgery.fusion.matching.is_elementwise`);
* ``sibling_linears``: every group, fused in call order under the siblings' names joined
  (``q_k_v_proj`` for ``q_proj``/``k_proj``/``v_proj``, ``w1_w3`` otherwise).

A sibling is left out, with the reason in the plan, when it is called more than once, when the
forward reads its weight or bias for more than dtype/device, or when its output feeds an op that
depends on its memory (``data_ptr``, ``stride``, in-place ops, ``resize_``...).

Weights move with ``Concatenate(dim=0, sizes=...)`` from the siblings' keys to the fused key
(weights and biases), scoped to the module's path; its exact inverse, ``Split`` with the same
sizes, saves the original layout.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import fx, nn

from surgery import WeightConverter, meta, ops
from surgery.fusion import (
    NOTHING_HERE,
    FusionMatch,
    FusionSpec,
    GraphRewrite,
    register_fusion,
    register_leaf_function,
    trace_module,
)
from surgery.fusion.matching import (
    aliases_and_users,
    child_problem,
    child_reads,
    depends_on_layout,
    descendants,
    is_elementwise,
    is_passthrough,
    reads_only_metadata,
    writes_in_place,
)
from surgery.parallel import local_split_sizes
from surgery.transforms import WeightTransform

__all__ = ["FUSIONS", "GateUpFusion", "QkvFusion", "SiblingGroup", "SiblingLinearsFusion", "register"]

_MUL = frozenset({operator.mul, torch.mul})


@dataclass(frozen=True)
class SiblingGroup(FusionMatch):
    """Linear children called on one input value, fused into one.

    Attributes:
        children: the sibling child names, in the order of the fused rows.
        fused: the new child's name.
        in_features / out_features: shared input width; each sibling's output width.
        bias: whether they have biases.
        reads: ``get_attr`` nodes reading a sibling's weight or bias metadata (``.dtype``).
    """

    children: tuple[str, ...]
    fused: str
    in_features: int
    out_features: tuple[int, ...]
    bias: bool
    reads: tuple[str, ...]


class _Quiet(str):
    """A reason that only says the pattern is not there (not a refusal of something that is)."""


def _linear_problem(linear: nn.Linear) -> str | None:
    return child_problem(linear, nn.Linear)


def _linears(module: nn.Module) -> dict[str, nn.Linear]:
    return {n: c for n, c in module.named_children() if isinstance(c, nn.Linear)}


def _joined_name(names: Sequence[str]) -> str:
    """``q_proj, k_proj, v_proj`` -> ``q_k_v_proj``; names without a shared ``_suffix`` are joined as they are."""
    first = names[0]
    for cut in range(len(first) - 1, 0, -1):
        suffix = first[cut:]
        if suffix.startswith("_") and all(n.endswith(suffix) and len(n) > len(suffix) for n in names):
            return "_".join(n[: -len(suffix)] for n in names) + suffix
    return "_".join(names)


class SiblingLinearsFusion(FusionSpec):
    """Linear children called on the same input become one ``nn.Linear`` and a split (every group)."""

    target_modules_patterns = (r".",)
    searches_everywhere = True
    no_match_message = (
        "This fusion looks for a module whose forward calls two or more nn.Linear children on the same "
        "input value, with equal in_features, dtype, device and bias presence."
    )
    role: ClassVar[str | None] = None
    fused_name: ClassVar[str | None] = None
    group_size: ClassVar[int] = 2

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ------------------------------------------------------------------ structure
    def is_candidate(self, module: nn.Module) -> bool:
        """At least ``group_size`` linear children of one input width (and, for gate_up, one output width)."""
        counts: dict[tuple[int, ...], int] = {}
        for linear in _linears(module).values():
            key = (
                (linear.in_features, linear.out_features) if self.role == "gate_up" else (linear.in_features,)
            )
            counts[key] = counts.get(key, 0) + 1
        return max(counts.values(), default=0) >= self.group_size

    def is_fusable(self, module: nn.Module) -> tuple[bool, str]:
        linears = _linears(module)
        problems = {n: _linear_problem(c) for n, c in linears.items()}
        good = [n for n, p in problems.items() if p is None]
        if len(good) < 2:
            why = (
                "; ".join(f"{n!r}: {p}" for n, p in problems.items() if p)
                or "fewer than two nn.Linear children"
            )
            return False, why
        return True, f"nn.Linear children {good}"

    # ------------------------------------------------------------------ graph
    def find_matches(self, module: nn.Module, graph: fx.Graph) -> tuple[list[FusionMatch], str]:
        linears = {n: c for n, c in _linears(module).items() if _linear_problem(c) is None}
        calls: dict[str, list[fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "call_module" and node.target in linears:
                calls.setdefault(str(node.target), []).append(node)
        reasons: list[str] = []
        by_input: dict[fx.Node, list[str]] = {}
        for name, nodes in calls.items():
            for call in nodes:
                source = call.args[0] if call.args else None
                if isinstance(source, fx.Node) and name not in by_input.setdefault(source, []):
                    by_input[source].append(name)
        matches: list[FusionMatch] = []
        taken = set(module._modules) | set(module._parameters) | set(module._buffers) | set(module.__dict__)
        for source, readers in by_input.items():
            if len(readers) < 2:
                continue
            names = []
            for name in readers:
                problem = self._sibling_problem(module, graph, name, calls[name])
                if problem is None:
                    names.append(name)
                else:
                    reasons.append(problem)
            for group in self._compatible(linears, names, source, reasons):
                found = self._match_group(module, graph, linears, group, calls, taken)
                if isinstance(found, str):
                    reasons.append(found)
                else:
                    matches.append(found)
                    taken.add(found.fused)
        if not matches and not reasons:
            reasons.append(
                _Quiet(f"no two of the nn.Linear children {sorted(calls)} are called on the same input")
            )
        if matches or not all(isinstance(r, _Quiet) for r in reasons):
            return matches, "; ".join(reasons)
        return matches, NOTHING_HERE + "; ".join(reasons)

    def _sibling_problem(
        self, module: nn.Module, graph: fx.Graph, name: str, nodes: list[fx.Node]
    ) -> str | None:
        if len(nodes) > 1:
            return f"{name!r} is called {len(nodes)} times; its weight cannot live in two places"
        (call,) = nodes
        if len(call.args) != 1 or call.kwargs or not isinstance(call.args[0], fx.Node):
            return f"{name!r} is called with extra arguments: {call.format_node()}"
        for node, attr in child_reads(graph, name):
            if not (attr in ("weight", "bias") and reads_only_metadata(node)):
                users = ", ".join(u.format_node() or u.name for u in node.users) or "nothing"
                return f"forward reads {node.target!r} in {users}; it does not exist in the fused layout"
        for user in aliases_and_users(call):
            if depends_on_layout(user, module):
                return (
                    f"the output of {name!r} goes to {user.format_node()}, which depends on its memory or writes "
                    "it in place; a slice of the fused output would behave differently"
                )
        return None

    def _compatible(
        self, linears: dict[str, nn.Linear], names: list[str], source: fx.Node, reasons: list[str]
    ) -> list[list[str]]:
        """Split the children called on ``source`` into groups that can share one weight."""
        if len(names) < 2:
            return []
        groups: dict[tuple[Any, ...], list[str]] = {}
        for n in names:
            w = linears[n].weight
            groups.setdefault(
                (linears[n].in_features, w.dtype, w.device, linears[n].bias is not None, w.requires_grad), []
            ).append(n)
        if len(groups) > 1:
            described = "; ".join(
                f"{g} ({'bias' if k[3] else 'no bias'}, {k[1]}, {k[2]}, in_features {k[0]}"
                f"{'' if k[4] else ', frozen'})"
                for k, g in groups.items()
            )
            reasons.append(
                f"{names} all read {source.name!r} but differ in in_features, dtype, device, bias presence or "
                f"requires_grad: {described}"
            )
        return [g for g in groups.values() if len(g) >= 2]

    def _match_group(
        self,
        module: nn.Module,
        graph: fx.Graph,
        linears: dict[str, nn.Linear],
        names: list[str],
        calls: dict[str, list[fx.Node]],
        taken: set[str],
    ) -> SiblingGroup | str:
        nodes = {n: calls[n][0] for n in names}
        order = [n.target for n in graph.nodes if n.op == "call_module" and n.target in nodes]
        names = [str(n) for n in order]
        if self.role == "qkv":
            names_or_why = self._as_qkv(names, nodes)
        elif self.role == "gate_up":
            names_or_why = self._as_gate_up(module, linears, names, nodes)
        else:
            names_or_why = names
        if isinstance(names_or_why, str):
            return names_or_why
        names = names_or_why
        order = list(graph.nodes)
        start, stop = (order.index(nodes[n]) for n in (names[0], names[-1]))
        between = [n for n in order[start + 1 : stop] if writes_in_place(n, module)]
        if between:
            return (
                f"{between[0].format_node()} writes in place between the calls of {names}; the fused call "
                "would read the input before it"
            )
        params = [p for n in names for p in linears[n].parameters(recurse=False)]
        if len({id(p) for p in params}) != len(params):
            return f"{names} share a parameter (tied weights); one fused weight would untie them"
        fused = self.fused_name or _joined_name(names)
        if fused in taken:
            return f"the name {fused!r} for the fused projection of {names} is already taken"
        first = linears[names[0]]
        reads = tuple(
            node.name
            for node in graph.nodes
            if node.op == "get_attr" and str(node.target).split(".")[0] in names
        )
        outs = tuple(linears[n].out_features for n in names)
        source = nodes[names[0]].args[0]
        description = (
            f"{', '.join(names)} read {cast(fx.Node, source).name!r}: one Linear {first.in_features} -> "
            f"{sum(outs)} as {fused!r} ({'with' if first.bias is not None else 'no'} bias), split into {list(outs)}"
        )
        return SiblingGroup(
            description,
            tuple(nodes[n].name for n in names),
            children=tuple(names),
            fused=fused,
            in_features=first.in_features,
            out_features=outs,
            bias=first.bias is not None,
            reads=reads,
        )

    @staticmethod
    def _as_qkv(names: list[str], nodes: dict[str, fx.Node]) -> list[str] | str:
        if len(names) != 3:
            return _Quiet(f"qkv needs three siblings; {names} are {len(names)}")
        reach = [descendants(nodes[n]) for n in names]
        common = reach[0] & reach[1] & reach[2]
        if not common:
            return _Quiet(f"the outputs of {names} never meet in one node, so they do not feed one attention")
        return names

    @staticmethod
    def _as_gate_up(
        module: nn.Module, linears: dict[str, nn.Linear], names: list[str], nodes: dict[str, fx.Node]
    ) -> list[str] | str:
        if len(names) != 2:
            return _Quiet(f"gate_up needs two siblings; {names} are {len(names)}")
        a, b = names
        if linears[a].out_features != linears[b].out_features:
            return _Quiet(
                f"gate_up needs equal widths; {a!r} has {linears[a].out_features}, {b!r} {linears[b].out_features}"
            )
        for gate, up in ((a, b), (b, a)):
            for act in nodes[gate].users:
                if not is_elementwise(act, nodes[gate], module, like=linears[gate].weight):
                    continue
                for product in act.users:
                    if (
                        product.op in ("call_function", "call_method")
                        and (product.target in _MUL or product.target == "mul")
                        and set(product.args[:2]) == {act, nodes[up]}
                    ):
                        return [gate, up]
        return _Quiet(f"the outputs of {names} do not meet in act(gate) * up")

    def rewrite(
        self,
        module: nn.Module,
        graph: fx.Graph,
        matches: Sequence[FusionMatch],
        *,
        materialize: bool,
    ) -> GraphRewrite:
        by_name = {n.name: n for n in graph.nodes}
        new_modules: dict[str, nn.Module] = {}
        replaced: dict[str, str] = {}
        removed: list[str] = []
        for m in matches:
            m = cast(SiblingGroup, m)  # produced by find_matches above
            siblings = [cast(nn.Linear, module._modules[c]) for c in m.children]
            new_modules[m.fused] = _fused_linear(siblings, m, materialize=materialize)
            replaced[m.children[0]] = m.fused
            removed += m.children[1:]
            call_nodes = [by_name[c] for c in m.nodes]  # the siblings' calls, in ``children`` order
            first = next(n for n in graph.nodes if n in call_nodes)
            with graph.inserting_before(first):
                fused_call = graph.call_module(m.fused, (first.args[0],))
                # The sizes the output holds on this rank: the global ones, or each part's local
                # share once tensor parallelism has made the fused weight a DTensor.
                weight = graph.get_attr(f"{m.fused}.weight")
                sizes = graph.call_function(local_split_sizes, (weight, list(m.out_features)))
                parts = graph.call_function(torch.split, (fused_call, sizes), {"dim": -1})
                pieces = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(call_nodes))]
            for call, piece in zip(call_nodes, pieces):
                call.replace_all_uses_with(piece)
                graph.erase_node(call)
                _views_become_reshapes(piece)
            for read_name in m.reads:
                read = by_name[read_name]
                attr = str(read.target).split(".", 1)[1]
                with graph.inserting_before(read):
                    new_read = graph.get_attr(f"{m.fused}.{attr}")
                read.replace_all_uses_with(new_read)
                graph.erase_node(read)
        return GraphRewrite(new_modules, replaced, tuple(removed))

    # ------------------------------------------------------------------ weights
    def make_transforms(
        self,
        path: str,
        module: nn.Module,
        matches: Sequence[FusionMatch] | None = None,
    ) -> list[WeightTransform]:
        """``a.weight, b.weight, ... -> fused.weight`` (and biases) by ``Concatenate(dim=0, sizes=...)``,
        scoped to ``path``; sizes come from the siblings themselves."""
        if matches is None:
            graph, _ = trace_module(module)
            matches, _ = self.find_matches(module, graph)
        out: list[WeightTransform] = []
        for m in matches:
            if not isinstance(m, SiblingGroup):
                continue
            for param in ("weight", "bias") if m.bias else ("weight",):
                out.append(
                    WeightConverter(
                        [rf"^{re.escape(c)}\.{param}$" for c in m.children],
                        f"{m.fused}.{param}",
                        [ops.Concatenate(dim=0, sizes=m.out_features)],
                        scope_prefix=path,
                    )
                )
        return out


def _views_become_reshapes(piece: fx.Node) -> None:
    """``.view(shape)`` of a slice (directly or after a no-op cast) becomes ``.reshape(shape)``:
    the same view where the slice's strides allow one, a copy where the original view needed the
    whole contiguous output. A dtype view (``.view(torch.int32)``) is left alone."""
    stack = [piece]
    while stack:
        node = stack.pop()
        for user in list(node.users):
            if not user.args or user.args[0] is not node:
                continue
            if user.op == "call_method" and user.target == "view":
                if not any(isinstance(a, torch.dtype) for a in (*user.args[1:], *user.kwargs.values())):
                    user.target = "reshape"
            elif is_passthrough(user):
                stack.append(user)


def _fused_linear(siblings: list[nn.Linear], m: SiblingGroup, *, materialize: bool) -> nn.Linear:
    """One Linear holding the siblings' rows in order, on their device and dtype (``meta`` in a preview)."""
    weight = siblings[0].weight
    linear = nn.Linear(m.in_features, sum(m.out_features), bias=m.bias, device="meta", dtype=weight.dtype)
    # A preview copies nothing; on meta, the shapes come from surgery.meta (no torch._dynamo).
    if materialize and not meta.is_meta(weight):
        new_w = torch.cat([s.weight.detach() for s in siblings], dim=0)
        new_b = torch.cat([s.bias.detach() for s in siblings if s.bias is not None]) if m.bias else None
    else:
        new_w = meta.empty((sum(m.out_features), m.in_features), weight.dtype)
        new_b = meta.empty((sum(m.out_features),), weight.dtype) if m.bias else None
    linear.weight = nn.Parameter(new_w, requires_grad=weight.requires_grad)
    if new_b is not None:
        linear.bias = nn.Parameter(new_b, requires_grad=cast(torch.Tensor, siblings[0].bias).requires_grad)
    linear.train(siblings[0].training)
    return linear


class QkvFusion(SiblingLinearsFusion):
    """Three siblings whose outputs all reach one node (the attention) become ``qkv_proj``."""

    no_match_message = (
        "The qkv fusion looks for three nn.Linear children called on the same input value whose outputs "
        "all reach one node (the attention)."
    )
    role = "qkv"
    fused_name = "qkv_proj"
    group_size = 3


class GateUpFusion(SiblingLinearsFusion):
    """Two siblings of equal width meeting in ``act(gate) * up`` become ``gate_up_proj`` (gate rows first)."""

    no_match_message = (
        "The gate_up fusion looks for two nn.Linear children of equal width called on the same input "
        "value whose outputs meet in one product, one side through an activation (act(gate(x)) * up(x))."
    )
    role = "gate_up"
    fused_name = "gate_up_proj"
    group_size = 2


FUSIONS: dict[str, type[SiblingLinearsFusion]] = {
    "sibling_linears": SiblingLinearsFusion,
    "qkv": QkvFusion,
    "gate_up": GateUpFusion,
}
"""Fusion name -> spec, registered by :func:`register`."""


def register(*, overwrite: bool = False) -> None:
    """Register the three fusions through the public API (called by ``specs.register_catalog``)."""
    for name, spec_cls in FUSIONS.items():
        register_fusion(name, spec_cls(), overwrite=overwrite)
    register_leaf_function(local_split_sizes)  # a fused module traced again keeps the call
