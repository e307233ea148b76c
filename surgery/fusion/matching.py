"""Small matchers over fx nodes, for specs whose patterns call modules.

``torch.fx.subgraph_rewriter`` cannot match patterns that contain ``call_module`` nodes (pytorch
issue #139163), so a spec walks the dataflow around a module call itself with these helpers:
recognise reshapes (``x.view(...)``, ``x.reshape(...)``, ``torch.reshape``), flattens, and the
shape-preserving casts a forward often puts in between (``.to(dtype)``, ``.contiguous()``), and
calls that apply a function element by element (:func:`is_elementwise`: an activation). For
the memory a rewrite may change, the dataflow analyses: which values may share a node's memory
(:func:`aliases_and_users`), which calls write in place (:func:`writes_in_place`) or depend on the
layout (:func:`depends_on_layout`), and everything downstream of a node (:func:`descendants`).
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
from torch import fx, nn
from torch.nn.utils import parametrize

__all__ = [
    "ALIASING_FUNCTIONS",
    "ALIASING_METHODS",
    "INPLACE_OPERATORS",
    "LAYOUT_METHODS",
    "PARAMETER_METADATA",
    "PASSTHROUGH_METHODS",
    "aliases_and_users",
    "child_problem",
    "child_reads",
    "depends_on_layout",
    "descendants",
    "flattens_to_width",
    "is_elementwise",
    "is_passthrough",
    "reads_only_metadata",
    "reshape_shape",
    "single_user",
    "skip_passthrough_back",
    "skip_passthrough_forward",
    "with_reshape_shape",
    "writes_in_place",
]

_RESHAPE_METHODS = frozenset({"view", "reshape"})
PASSTHROUGH_METHODS = frozenset({"to", "contiguous", "float", "half", "bfloat16", "double", "type"})
"""Tensor methods that keep the shape and work the same on any rank: casts and ``contiguous``
(:func:`is_passthrough`). Each may return its input itself, so each is also in :data:`ALIASING_METHODS`."""
ALIASING_METHODS = (
    _RESHAPE_METHODS
    | PASSTHROUGH_METHODS
    | frozenset(
        {"transpose", "permute", "unsqueeze", "squeeze", "expand", "flatten", "unflatten", "narrow"}
        | {"detach", "view_as", "t"}
    )
)
"""Tensor methods whose result may share memory with their input (views, and casts that can be no-ops)."""
ALIASING_FUNCTIONS = frozenset(
    {operator.getitem, torch.transpose, torch.reshape, torch.flatten, torch.narrow}
)
"""Functions whose result may share memory with their first argument (indexing and views)."""
LAYOUT_METHODS = frozenset(
    {
        "data_ptr",
        "stride",
        "storage",
        "untyped_storage",
        "storage_offset",
        "is_contiguous",
        "set_",
        "as_strided",
    }
)
"""Tensor methods whose result depends on (or changes) the memory layout, not only the values."""
INPLACE_OPERATORS = frozenset(
    {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv}
)
"""The augmented assignments fx records as calls (``x += 1``); they write their left operand."""


def reshape_shape(node: fx.Node) -> tuple[Any, ...] | None:
    """The target shape of a reshape node (ints and/or nodes), or ``None`` if it is no reshape."""
    if node.op == "call_method" and node.target in _RESHAPE_METHODS and not node.kwargs:
        rest = node.args[1:]
        if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
            return tuple(rest[0])
        return tuple(rest)
    if node.op == "call_function" and node.target is torch.reshape:
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("shape")
        return tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else None
    return None


def with_reshape_shape(graph: fx.Graph, node: fx.Node, shape: tuple[Any, ...]) -> fx.Node:
    """Insert a reshape of the same kind as ``node`` (same input) to ``shape``; return it."""
    src = node.args[0]
    with graph.inserting_before(node):
        if node.op == "call_method":
            return graph.call_method(str(node.target), (src, *shape))
        return graph.call_function(torch.reshape, (src, tuple(shape)))


def flattens_to_width(node: fx.Node, width: int) -> bool:
    """Whether ``node`` turns its input into ``(rows, width)``: a 2-D reshape or ``flatten(1)``."""
    shape = reshape_shape(node)
    if shape is not None:
        return len(shape) == 2 and shape[1] == width
    if node.op == "call_method" and node.target == "flatten":
        args = list(node.args[1:])
        start = args[0] if args else node.kwargs.get("start_dim", 0)
        end = args[1] if len(args) > 1 else node.kwargs.get("end_dim", -1)
        return bool(start == 1 and end == -1)
    if node.op == "call_function" and node.target is torch.flatten:
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        return bool(start == 1 and end == -1)
    return False


def is_passthrough(node: fx.Node) -> bool:
    """A cast or layout call that keeps the shape and works the same on any rank."""
    return (
        node.op == "call_method"
        and node.target in PASSTHROUGH_METHODS
        and "memory_format" not in node.kwargs
        and not any(isinstance(a, torch.memory_format) for a in node.args[1:])
    )


def single_user(node: fx.Node) -> fx.Node | None:
    """The only user of ``node``, or ``None`` when it has none or several."""
    return next(iter(node.users)) if len(node.users) == 1 else None


def skip_passthrough_back(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """Walk from ``node``'s first input back over single-use passthrough calls.

    Returns:
        ``(the first node that is not such a call, the passthrough calls walked over)``.
    """
    chain: list[fx.Node] = []
    current = node.args[0] if node.args else None
    while isinstance(current, fx.Node) and is_passthrough(current) and len(current.users) == 1:
        chain.append(current)
        current = current.args[0]
    return current, chain  # type: ignore[return-value]


def skip_passthrough_forward(node: fx.Node) -> fx.Node | None:
    """Walk from ``node`` forward over single-use passthrough calls to the next real use.

    Returns:
        The first user that is not a passthrough call, taking the walked value as its first
        argument; ``None`` when a node on the way has zero or several users, or the value is
        not the user's first argument.
    """
    current = node
    while True:
        user = single_user(current)
        if user is None or not user.args or user.args[0] is not current:
            return None
        if not is_passthrough(user):
            return user
        current = user


def writes_in_place(node: fx.Node, module: nn.Module) -> bool:
    """Whether ``node`` writes one of its inputs in place.

    ``x.add_(...)``, ``torch.relu_(x)``, ``x += 1``, ``F.relu(x, inplace=True)`` and a child
    module with ``inplace=True`` (``nn.ReLU(inplace=True)``) do; ``module`` is the traced module
    (for ``call_module`` nodes).
    """
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return node.target in INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))
    if node.op == "call_module":
        return getattr(module.get_submodule(str(node.target)), "inplace", False) is True
    return False


def depends_on_layout(node: fx.Node, module: nn.Module) -> bool:
    """Whether ``node`` reads or changes the memory of its input, not only its values.

    A call of a :data:`LAYOUT_METHODS` method (``stride``, ``data_ptr`` ...) or an in-place write
    (:func:`writes_in_place`): replacing its input by a slice of a larger tensor could change it.
    """
    return (node.op == "call_method" and node.target in LAYOUT_METHODS) or writes_in_place(node, module)


def aliases_and_users(node: fx.Node) -> list[fx.Node]:
    """Every user of ``node`` and of the values that may share its memory (views made from it).

    A value shares ``node``'s memory when it is made from it by a :data:`ALIASING_METHODS` method
    or a :data:`ALIASING_FUNCTIONS` function (``view``, ``transpose``, slicing ...): an in-place
    write through any of them reaches ``node``'s output.
    """
    out: list[fx.Node] = []
    stack, seen = [node], {node}
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            out.append(user)
            aliasing = (user.op == "call_method" and user.target in ALIASING_METHODS) or (
                user.op == "call_function" and user.target in ALIASING_FUNCTIONS
            )
            if aliasing and user.args and user.args[0] in seen:
                stack.append(user)
    return out


def descendants(node: fx.Node) -> set[fx.Node]:
    """Every node that uses ``node``'s value, directly or through other nodes."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


PARAMETER_METADATA = frozenset({"dtype", "device", "is_cuda", "is_meta", "requires_grad"})
"""Attributes of a parameter that a fused layout keeps (its values and shape it does not)."""


def child_problem(child: nn.Module, base: type[nn.Module]) -> str | None:
    """Why ``child`` cannot be replaced by a rewrite that assumes ``base``'s forward, or ``None``:
    its class overrides ``forward``, it is parametrized, or it has hooks the rewrite would drop."""
    if type(child).forward is not base.forward:
        return f"its class {type(child).__name__} overrides forward"
    if parametrize.is_parametrized(child):
        return "it has parametrizations (torch.nn.utils.parametrize)"
    if child._forward_hooks or child._forward_pre_hooks or child._backward_hooks or child._backward_pre_hooks:
        return "it has hooks registered, which the replacement would drop"
    return None


def child_reads(graph: fx.Graph, child: str) -> list[tuple[fx.Node, str]]:
    """The ``get_attr`` nodes of ``graph`` under child ``child``, with the attribute each reads
    (``"weight"`` for ``proj.weight``, ``""`` for the child itself)."""
    prefix = child + "."
    return [
        (node, str(node.target)[len(prefix) :])
        for node in graph.nodes
        if node.op == "get_attr" and (node.target == child or str(node.target).startswith(prefix))
    ]


def reads_only_metadata(node: fx.Node) -> bool:
    """Whether every use of ``node`` is ``getattr(node, m)`` with ``m`` in :data:`PARAMETER_METADATA`."""
    return all(
        u.op == "call_function"
        and u.target is getattr
        and len(u.args) == 2
        and u.args[1] in PARAMETER_METADATA
        for u in node.users
    )


_PROBE_WIDTH = 8


def is_elementwise(node: fx.Node, source: fx.Node, module: nn.Module, *, like: torch.Tensor) -> bool:
    """Whether ``node`` applies a function to ``source`` alone, element by element (an activation).

    Decided by what the call does, not by its name: ``node`` must take ``source`` as its only
    traced input (other arguments constant), and, run on a probe tensor, give an output of the
    probe's shape in which each element depends only on the probe's element at the same place
    (changing half of the probe leaves the other half of the output as it was). A softmax, a norm
    or a projection fails that; any activation in transformers' ``ACT2FN`` passes. The probe has
    ``like``'s dtype and device (CPU for ``meta``, with meta parameters of a child module given
    values on a copy); the random state of the process is left as it was.
    """
    inputs = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    if inputs != [source] or node.args[:1] != (source,):
        return False
    fn = _probe_callable(node, module)
    if fn is None:
        return False
    device = torch.device("cpu") if like.device.type == "meta" else like.device
    dtype = like.dtype if like.dtype.is_floating_point else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    probe = torch.randn(2, _PROBE_WIDTH, generator=gen, device=device).to(dtype)
    changed = probe.clone()
    half = torch.arange(_PROBE_WIDTH, device=device) % 2 == 0
    changed[:, half] = torch.randn(2, int(half.sum()), generator=gen, device=device).to(dtype)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            out, again, out_changed = fn(probe), fn(probe.clone()), fn(changed)
    except Exception:
        return False  # it does not run on one tensor alone: not an elementwise function of it
    tensors = (out, again, out_changed)
    if not all(isinstance(t, torch.Tensor) and t.shape == probe.shape for t in tensors):
        return False
    return torch.equal(out, again) and torch.equal(out[:, ~half], out_changed[:, ~half])


def _probe_callable(node: fx.Node, module: nn.Module) -> Any:
    """``node``'s call as a function of its first argument, or ``None`` when it is no call."""
    rest, kwargs = node.args[1:], dict(node.kwargs)
    if node.op == "call_function":
        target = node.target
        return lambda t: target(t, *rest, **kwargs)  # type: ignore[operator]
    if node.op == "call_method":
        return lambda t: getattr(t, str(node.target))(*rest, **kwargs)
    if node.op == "call_module":
        child = module.get_submodule(str(node.target))
        if any(t.is_meta for t in (*child.parameters(), *child.buffers())):
            child = copy.deepcopy(child).to_empty(device="cpu")
            for t in (*child.parameters(), *child.buffers()):
                if t.is_floating_point():
                    with torch.no_grad():
                        t.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
        # ``forward`` itself: a probe must not run the hooks a user registered on the child.
        return lambda t: child.forward(t, *rest, **kwargs)
    return None
