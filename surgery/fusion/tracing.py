"""Tracing one candidate module alone with :mod:`torch.fx`, so that real model code traces.

:func:`trace_module` traces only the candidate's own ``forward``: every child module is a leaf
(a ``call_module`` node), so the graph never reaches into the rest of the model. Real attention
code needs a few things plain symbolic tracing lacks; :class:`FusionTracer` adds them, each
failing the trace (never guessing) where its assumption does not hold:

* **Leaf functions.** A function registered with :func:`register_leaf_function` (and the
  built-in list: transformers' attention kernels, which branch on tensor shapes) becomes one
  ``call_function`` node instead of being traced through. It is swapped for a recording wrapper
  while the trace runs, where the forward can reach it: the forward's globals, and the attention
  registries of transformers when that library is loaded. Outside a trace the wrapper calls the
  original, so another thread running a model meanwhile is not affected.
* **Optional state arguments.** A forward parameter named in :data:`NONE_IN_INFERENCE` (caches:
  ``past_key_values``, ``cache``, ``cache_position`` ...) whose default is ``None`` is traced as
  ``None`` or as a value, as the ``variant`` asks (:mod:`surgery.fusion.variants` keeps one graph
  per case); traced as ``None``, torch.fx checks at run time that it still is. Add names with
  :func:`register_none_argument`.
* **Unpacking a shape.** ``(*x.shape[:-1], -1, d)`` and ``y.reshape(*shape, -1)`` become a node
  that builds the tuple at run time. Any other iteration of a traced value (a ``for`` loop,
  ``len``, ``tuple(...)``) fails as in torch.fx. Limit: ``len()`` or indexing of such a tuple in
  the forward counts the unpacked part as one element, and the tracer cannot see it.
* **Forwarding ``**kwargs``.** A forward that takes ``**kwargs`` and passes them on to a leaf
  (``attention(q, k, v, **kwargs)``) keeps doing so at run time. Passing them to anything the
  tracer steps into (which could read them) fails the trace.
* **Decorated forwards.** A ``functools.wraps`` decorator on ``forward`` (transformers renames
  deprecated keyword arguments this way) is traced through to the function it wraps.

The candidate is left exactly as it was: torch.fx parks tensor constants on the traced root, and
they are moved to the side.
"""

from __future__ import annotations

import dis
import functools
import inspect
import itertools
import operator
import re
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import fx, nn

from ..errors import FusionError
from .variants import TracedVariants, Variant

__all__ = [
    "NONE_IN_INFERENCE",
    "SELF_ATTRIBUTE",
    "TRACE_LOCK",
    "TRANSPARENT_DECORATOR_MODULES",
    "FusionTracer",
    "check_inference_state",
    "check_none",
    "leaf_functions",
    "optional_arguments",
    "reads_training",
    "register_leaf_function",
    "register_none_argument",
    "restore_tracing_state",
    "trace_module",
    "tracing_state",
]

NONE_IN_INFERENCE: set[str] = {"past_key_value", "past_key_values", "layer_past", "cache", "cache_position"}
"""Forward parameters that are optional state when their default is ``None``: traced once as ``None`` and
once as a value (extend with :func:`register_none_argument`)."""

SELF_ATTRIBUTE = "surgery_self"
"""The attribute a traced graph reads when the forward passes the module itself to a leaf function
(``attention(self, q, k, v)``); a :class:`~surgery.fusion.FusedModule` answers it with itself."""

_LOCK = threading.Lock()
TRACE_LOCK = threading.RLock()
_USER_LEAVES: list[Callable[..., Any]] = []


def register_leaf_function(fn: Callable[..., Any]) -> None:
    """Make ``fn`` a leaf of every fusion trace: one ``call_function`` node, never traced through.

    Use it for a function whose body symbolic tracing cannot follow (it branches on tensor shapes
    or values) that a candidate's forward calls by a global name. Registering twice is a no-op.

    Raises:
        FusionError: ``fn`` is not a plain Python function.
    """
    if not inspect.isfunction(fn):
        raise FusionError(
            f"register_leaf_function needs a Python function (def ...), got {type(fn).__name__}: {fn!r}."
        )
    with _LOCK:
        if fn not in _USER_LEAVES:
            _USER_LEAVES.append(fn)


def register_none_argument(name: str) -> None:
    """Treat forward parameters called ``name`` that default to ``None`` as optional state: a fusion
    traces the forward with it ``None`` and with a value, and runs the graph of the case each call is."""
    if not isinstance(name, str) or not name.isidentifier():
        raise FusionError(f"register_none_argument needs a parameter name, got {name!r}.")
    with _LOCK:
        NONE_IN_INFERENCE.add(name)


TRANSPARENT_DECORATOR_MODULES: set[str] = {"transformers.utils.deprecation", "kernels._internals.layer.layer"}
"""Modules whose ``functools.wraps`` decorators on ``forward`` leave what it computes alone: the
tracer traces through them. transformers' ``deprecate_kwarg`` only renames keyword arguments;
``kernels``' ``use_kernelized_func`` only routes functions to hub kernels that ``kernels.kernelize``
installs (a fused module runs the plain functions). A forward wrapped by anything else
(``torch.autocast``, ``torch.no_grad`` ...) does not trace."""


def _transparent_files() -> set[str]:
    with _LOCK:
        names = set(TRANSPARENT_DECORATOR_MODULES)
    files = (getattr(sys.modules.get(n), "__file__", None) for n in names)
    return {f for f in files if f}


def _recording(fn: Callable[..., Any], *, record: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """``fn``, recorded as one ``call_function`` node of ``record`` (default: the wrapper itself)
    when it is called with traced values; called as it is otherwise."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        proxy = _find_proxy((args, kwargs))
        if proxy is None:
            return fn(*args, **kwargs)
        return proxy.tracer.create_proxy("call_function", record or wrapper, args, kwargs)

    return wrapper


# The run-time helpers below record themselves when a fused module is traced again (a second
# fusion on it), so they are leaves of that trace too.
@_recording
def check_inference_state(kwargs: Mapping[str, Any], names: tuple[str, ...]) -> None:
    """Fail when ``**kwargs`` hold a cache under a name the forward does not take (a deprecated
    spelling its decorator renamed): passed on to the attention kernel, it would be ignored."""
    given = [n for n in names if kwargs.get(n) is not None]
    if given:
        raise AssertionError(
            f"{given} reached this fused module in **kwargs, where nothing reads them (the forward's "
            "decorator that renamed a deprecated spelling is not part of a fused module); pass the cache "
            "under the parameter name of the forward"
        )


def tracing_state() -> tuple[list[Callable[..., Any]], set[str], set[str]]:
    """A copy of the leaf functions, None-in-inference names and transparent decorator modules."""
    with _LOCK:
        return list(_USER_LEAVES), set(NONE_IN_INFERENCE), set(TRANSPARENT_DECORATOR_MODULES)


def restore_tracing_state(state: tuple[list[Callable[..., Any]], set[str], set[str]]) -> None:
    """Put back what :func:`tracing_state` returned."""
    with _LOCK:
        _USER_LEAVES[:] = state[0]
        for target, saved in ((NONE_IN_INFERENCE, state[1]), (TRANSPARENT_DECORATOR_MODULES, state[2])):
            target.clear()
            target.update(saved)


def _leaf_registries() -> list[dict[Any, Any]]:
    """Dicts of attention kernels a forward looks up by name (transformers' ``AttentionInterface``)."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:
        return []
    out: list[dict[Any, Any]] = []
    interface = getattr(modeling_utils, "AttentionInterface", None)
    mapping = getattr(interface, "_global_mapping", None)
    if isinstance(mapping, dict):
        out.append(mapping)
    local = getattr(getattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", None), "_local_mapping", None)
    if isinstance(local, dict):
        out.append(local)
    return out


def leaf_functions(fn_globals: Mapping[str, Any] | None = None) -> list[Callable[..., Any]]:
    """Every leaf function of a trace: the registered ones, transformers' attention kernels, and
    an ``eager_attention_forward`` among ``fn_globals`` (transformers' convention)."""
    with _LOCK:
        leaves = list(_USER_LEAVES)
    for registry in _leaf_registries():
        leaves += [v for v in registry.values() if inspect.isfunction(v)]
    eager = (fn_globals or {}).get("eager_attention_forward")
    if inspect.isfunction(eager):
        leaves.append(eager)
    unique: dict[int, Callable[..., Any]] = {id(f): f for f in leaves}
    return list(unique.values())


# ---------------------------------------------------------------------- run-time helpers
@_recording
def check_none(value: Any, message: str) -> None:
    """torch.fx's check that an argument traced as ``None`` still is, as a function of this module:
    torch.fx's own is registered with ``torch.fx.wrap`` when a pickled graph is loaded, under a
    dotted name no namespace has, which breaks every later trace in the process."""
    if value is not None:
        raise AssertionError(message)


@_recording
def splice(*pieces: tuple[Any, ...]) -> tuple[Any, ...]:
    """``(*a, -1, d)`` at run time: the concatenation of ``pieces`` (each a tuple)."""
    return tuple(itertools.chain.from_iterable(pieces))


@_recording
def call_method_spread(obj: Any, method: str, args: tuple[Any, ...], **kwargs: Any) -> Any:
    """``obj.method(*args, **kwargs)``: a method call whose arguments were built by unpacking."""
    return getattr(obj, method)(*args, **kwargs)


class ForwardingCall:
    """A leaf function call that passes the forward's ``**kwargs`` on: ``fn(*args, **kw, **forwarded)``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = f"{fn.__name__}_forwarding_kwargs"
        self.__qualname__ = self.__name__
        self.__module__ = __name__

    def __call__(self, *args: Any, forwarded_kwargs: Mapping[str, Any], **kwargs: Any) -> Any:
        kwargs["forwarded_kwargs"] = forwarded_kwargs
        proxy = _find_proxy((args, kwargs))
        if proxy is not None:
            return proxy.tracer.create_proxy("call_function", self, args, kwargs)
        del kwargs["forwarded_kwargs"]
        return self.fn(*args, **kwargs, **forwarded_kwargs)

    def __repr__(self) -> str:
        return f"ForwardingCall({self.fn.__module__}.{self.fn.__qualname__})"


class _Spread:
    """Stands for ``*proxy`` inside a list or an argument tuple while the trace builds it."""

    __slots__ = ("proxy",)

    def __init__(self, proxy: fx.Proxy) -> None:
        self.proxy = proxy

    def __repr__(self) -> str:
        return f"*{self.proxy.node.name}"


class _KwargsKey(str):
    """The one key a traced ``**kwargs`` shows when it is unpacked into a call."""

    __slots__ = ()


_KWARGS_KEY = _KwargsKey("surgery_forwarded_kwargs")
_SPREAD_OPCODES = frozenset({"LIST_EXTEND", "CALL_FUNCTION_EX"})
_KWARGS_SPLAT_OPCODES = frozenset({"CALL_FUNCTION_EX", "DICT_MERGE"})
_CONSTANT = re.compile(r"_tensor_constant\d+")


def _find_proxy(values: Any) -> fx.Proxy | None:
    found: list[fx.Proxy] = []

    def visit(x: Any) -> Any:
        if isinstance(x, fx.Proxy) and not found:
            found.append(x)
        return x

    torch.fx.node.map_aggregate(values, visit)
    return found[0] if found else None


@contextmanager
def _leaves_patched(fn_globals: dict[str, Any]) -> Iterator[None]:
    """Swap every leaf function the forward can reach for a recording wrapper; restore exactly."""
    leaves = {id(f): f for f in leaf_functions(fn_globals)}
    wrappers = {i: _recording(f, record=f) for i, f in leaves.items()}
    saved: list[tuple[dict[Any, Any], Any, Any]] = []
    try:
        for d in (fn_globals, *_leaf_registries()):
            for key, value in list(d.items()):
                if id(value) in wrappers and value is leaves[id(value)]:
                    saved.append((d, key, value))
                    d[key] = wrappers[id(value)]
        yield
    finally:
        for d, key, value in reversed(saved):
            d[key] = value


class _FusionProxy(fx.Proxy):
    """A proxy that lets ``list.extend`` (``[*x, ...]``) ask for its length and carry on to iteration."""

    def __len__(self) -> int:
        frame = inspect.currentframe()
        if _current_opname(frame.f_back if frame is not None else None) == "LIST_EXTEND":
            raise TypeError("a traced value has no length; list.extend falls back to iterating it")
        return super().__len__()


class FusionTracer(fx.Tracer):
    """A tracer for one module's own ``forward``: children are leaves, real model code traces
    (see the module docstring for what it adds to :class:`torch.fx.Tracer`)."""

    def __init__(self) -> None:
        super().__init__()
        self._kwargs_node: fx.Node | None = None
        self.root_code: types.CodeType | None = None
        self.kwargs_unpacked = 0
        self.kwargs_forwarded = 0

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _FusionProxy(node, self)

    def call_module(
        self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Children are leaves; a module that is not part of the candidate (transformers wraps
        functions such as ``apply_rotary_pos_emb`` into module objects when ``kernels`` is
        installed) is traced through like a function: it holds no parameter of the candidate."""
        try:
            self.path_of_module(m)
        except NameError:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    # -- unpacking traced values
    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        frame = inspect.currentframe()
        caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        opname = _current_opname(caller)
        node = obj.node
        if (
            self._kwargs_node is not None
            and node.op == "call_method"
            and node.target == "keys"
            and node.args == (self._kwargs_node,)
        ):
            if opname not in _KWARGS_SPLAT_OPCODES:
                raise fx.proxy.TraceError(
                    "forward copies or inspects **kwargs (dict(kwargs), a loop over it ...); only passing "
                    "them on unchanged to a leaf function traces"
                )
            self.kwargs_unpacked += 1
            return iter([_KWARGS_KEY])
        if opname in _SPREAD_OPCODES:
            return iter([_Spread(obj)])
        return super().iter(obj)

    def create_arg(self, a: Any) -> Any:
        if a is self.root:
            return self.create_node("get_attr", SELF_ATTRIBUTE, (), {})
        if (
            isinstance(a, (list, tuple))
            and not hasattr(a, "_fields")
            and any(isinstance(x, _Spread) for x in a)
        ):
            return self.create_node(
                "call_function", splice, tuple(self.create_arg(p) for p in _pieces(a)), {}
            )
        if isinstance(a, _Spread):
            raise fx.proxy.TraceError(
                f"the unpacked value {a!r} is used on its own, not inside a tuple or call"
            )
        return super().create_arg(a)

    def create_proxy(
        self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *rest: Any, **kw: Any
    ) -> fx.Proxy:  # type: ignore[override]
        if (
            kind == "call_function"
            and target is operator.getitem
            and len(args) == 2
            and isinstance(args[1], _KwargsKey)
            and isinstance(args[0], fx.Proxy)
        ):
            return args[0]  # ``kwargs[key]`` while unpacking ``**kwargs``: the whole mapping
        if _KWARGS_KEY in kwargs:
            if kind != "call_function":
                raise fx.proxy.TraceError(
                    f"forward passes **kwargs on to {kind} {target!r}; only leaf functions can take them"
                )
            if not _called_from(self.root_code):
                raise fx.proxy.TraceError(
                    f"**kwargs reach {getattr(target, '__name__', target)!r} through a function the tracer "
                    "steps into, which may read them; register that function with register_leaf_function"
                )
            kwargs = dict(kwargs)
            kwargs["forwarded_kwargs"] = kwargs.pop(_KWARGS_KEY)
            target = ForwardingCall(target)
            self.kwargs_forwarded += 1
        if any(isinstance(a, _Spread) for a in args[1:]) and kind == "call_method":
            spread = self.create_proxy("call_function", splice, tuple(_pieces(args[1:])), {})
            return self.create_proxy("call_function", call_method_spread, (args[0], target, spread), kwargs)
        if any(isinstance(a, _Spread) for a in args):
            raise fx.proxy.TraceError(f"unpacked arguments (*x) in a call of {kind} {target!r}")
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **kw)
        if kind == "placeholder" and str(target).startswith("**"):
            self._kwargs_node = proxy.node
        return proxy


def _called_from(code: types.CodeType | None) -> bool:
    """Whether the leaf call being recorded was made by ``code`` (the traced forward itself; torch.fx
    runs a patched copy of it, so it is recognised by name, file and first line)."""
    frame = inspect.currentframe()
    while frame is not None:
        c = frame.f_code
        if code is not None and (c.co_name, c.co_filename, c.co_firstlineno) == (
            code.co_name,
            code.co_filename,
            code.co_firstlineno,
        ):
            return True
        if not _is_tracer_file(c.co_filename):
            return False  # the first frame outside the tracer (this module, its leaf wrappers, torch.fx)
        frame = frame.f_back
    return False


def _is_tracer_file(filename: str) -> bool:
    return filename == __file__ or "torch/fx" in filename.replace("\\", "/")


def _pieces(items: Any) -> list[Any]:
    return [x.proxy if isinstance(x, _Spread) else (x,) for x in items]


def _current_opname(frame: Any) -> str | None:
    """The name of the bytecode instruction ``frame`` is executing."""
    return None if frame is None else _opnames(frame.f_code).get(frame.f_lasti)


@functools.lru_cache(maxsize=512)
def _opnames(code: types.CodeType) -> dict[int, str]:
    return {inst.offset: inst.opname for inst in dis.get_instructions(code)}


def _twin(module: nn.Module, variant: Variant) -> nn.Module:
    """``module`` itself, or, when its ``forward`` is decorated, a twin sharing its state whose
    class has the undecorated ``forward`` (the decorator's ``*args, **kwargs`` cannot be traced);
    for a module that runs one forward per case (a fused module), the forward of ``variant``."""
    cls = type(module)
    inner = module.forward_for(variant) if isinstance(module, TracedVariants) else cls.forward
    while hasattr(inner, "__wrapped__"):
        # functools.wraps copies the wrapped function's names: where the wrapper's code lives says who wrote it.
        code = getattr(inner, "__code__", None)
        where = code.co_filename if code is not None else "?"
        if where not in _transparent_files():
            raise fx.proxy.TraceError(
                f"forward is wrapped by a decorator defined in {where}, which a fused module would drop (it "
                "may change dtypes, grad mode or arguments)"
            )
        inner = inner.__wrapped__
    if inner is cls.forward:
        return module
    twin_cls = type(cls.__name__, (cls,), {"forward": inner, "__module__": cls.__module__})
    twin = cast(nn.Module, object.__new__(twin_cls))
    twin.__dict__ = module.__dict__  # the same attributes, children and parameters
    return twin


def _none_arguments(fn: Callable[..., Any]) -> list[str]:
    with _LOCK:
        names = set(NONE_IN_INFERENCE)
    params = inspect.signature(fn).parameters
    return [
        name
        for name, p in params.items()
        if name in names
        and p.default is None
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]


def _undecorated_forward(module: nn.Module) -> Callable[..., Any]:
    forward = type(module).forward
    while hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    return forward


def optional_arguments(module: nn.Module) -> tuple[str, ...]:
    """The forward parameters of ``module`` that are optional state (a name in
    :data:`NONE_IN_INFERENCE` defaulting to ``None``): the cases its forward may branch on."""
    if isinstance(module, TracedVariants):
        return module.optional_arguments()
    return tuple(_none_arguments(_undecorated_forward(module)))


def reads_training(module: nn.Module) -> bool:
    """Whether the forward of ``module`` reads ``self.training`` (so train and eval may trace differently)."""
    if isinstance(module, TracedVariants):
        return module.reads_training()
    code = getattr(_undecorated_forward(module), "__code__", None)
    return code is not None and "training" in code.co_names


def trace_module(module: nn.Module, *, variant: Variant | None = None) -> tuple[fx.Graph, dict[str, Any]]:
    """Trace ``module`` alone with :class:`FusionTracer`, leaving it exactly as it was.

    ``variant`` (default: the module's current mode, no optional state argument given) says which
    case to trace: the mode set while tracing, and which optional state arguments
    (:func:`optional_arguments`) are traced as values instead of ``None``.

    Returns:
        ``(graph, constants)``: ``constants`` are the tensor constants the graph reads through
        ``get_attr`` nodes that are not attributes of ``module``.

    Raises:
        FusionError: torch.fx could not trace the module (data-dependent control flow, ...); the
            message gives the tracer's reason and where in the forward it stopped.
    """
    before = dict(module.__dict__)
    added: dict[str, Any] = {}
    try:
        variant = variant or Variant(module.training)
        root = _twin(module, variant)
        forward = type(root).forward
        tracer = FusionTracer()
        tracer.root_code = forward.__code__
        none_args = {n: None for n in _none_arguments(forward) if n not in variant.given}
        mode = module.training
        try:
            # One trace at a time: torch.fx patches nn.Module.__call__ process-wide while it traces,
            # and two traces patching the same registries would restore each other's wrappers.
            with TRACE_LOCK, _leaves_patched(forward.__globals__):
                object.__setattr__(module, "training", variant.training)
                try:
                    graph = tracer.trace(root, concrete_args=none_args or None)
                finally:
                    object.__setattr__(module, "training", mode)
        finally:
            # torch.fx parks tensor constants on the traced root; a forward may also assign
            # attributes (``self.last_len = x.shape[1]``). Put the module back exactly as it was.
            changed = [k for k, v in module.__dict__.items() if k in before and before[k] is not v]
            added = {k: module.__dict__.pop(k) for k in list(module.__dict__) if k not in before}
            for k in changed:
                module.__dict__[k] = before[k]
        written = changed + [k for k in added if not _CONSTANT.fullmatch(k)]
        if written:
            raise fx.proxy.TraceError(
                f"forward assigns self.{written[0]}; a fused module would keep the value of the trace"
            )
        if tracer.kwargs_unpacked > tracer.kwargs_forwarded:
            raise fx.proxy.TraceError(
                "forward passes **kwargs to a function the tracer steps into, which may read them; "
                "register that function with surgery.fusion.register_leaf_function"
            )
    except Exception as exc:
        raise FusionError(
            f"torch.fx could not trace {type(module).__name__}.forward: {_reason(exc)}"
        ) from exc
    for node in list(graph.nodes):
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_is_none":
            node.target = check_none
        if (
            node.op == "placeholder"
            and str(node.target).endswith("_1")
            and str(node.target)[:-2] in none_args
        ):
            node.target = str(node.target)[
                :-2
            ]  # fx names a specialized argument ``cache_1``; callers pass ``cache=``
        if isinstance(node.type, str):
            # A string annotation (``from __future__ import annotations``) is not a type: fx would
            # print it mangled and fail to pickle the generated module.
            node.type = None
        if node.op == "call_method" and node.target == "keys" and not node.users:
            graph.erase_node(node)  # left over from unpacking **kwargs
    _guard_forwarded_kwargs(graph)
    return graph, added


def _guard_forwarded_kwargs(graph: fx.Graph) -> None:
    """After the placeholders, check that ``**kwargs`` carry no cache under a name the forward does not
    take. ``cache_position`` is not checked: it holds positions, and transformers passes it on to
    attention kernels in ``**kwargs``, as a fused module does."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    star = next((n for n in placeholders if str(n.target).startswith("**")), None)
    already = any(n.op == "call_function" and n.target is check_inference_state for n in graph.nodes)
    if star is None or already:
        return
    with _LOCK:
        names = tuple(sorted(NONE_IN_INFERENCE - {"cache_position"}))
    with graph.inserting_after(placeholders[-1]):
        graph.call_function(check_inference_state, (star, names))


def _reason(exc: BaseException) -> str:
    """``Type: first line`` of the tracer's error, plus the innermost frame of the traced code."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    where = ""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        if not _is_tracer_file(tb.tb_frame.f_code.co_filename):
            last = tb
        tb = tb.tb_next
    if last is not None:
        code = last.tb_frame.f_code
        where = f" (at {code.co_name}, {code.co_filename.rsplit('/', 1)[-1]}:{last.tb_lineno})"
    return f"{type(exc).__name__}: {first}{where}"
