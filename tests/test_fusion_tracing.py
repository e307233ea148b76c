"""What the fusion tracer adds to torch.fx so that real model code traces, and where it refuses.

Each module below is traced alone with ``trace_module``, rebuilt as a ``FusedModule`` with no
rewrite, and run against the original on the same inputs.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

import surgery
from surgery import FusionError
from surgery.fusion import FusedModule, register_leaf_function, register_none_argument, trace_module
from surgery.fusion.rewrite import build_fused_module
from surgery.fusion.spec import GraphRewrite
from surgery.fusion.tracing import TRANSPARENT_DECORATOR_MODULES

pytestmark = pytest.mark.usefixtures("isolated_fusion_registry")


def _retraced(module: nn.Module) -> FusedModule:
    graph, constants = trace_module(module)
    return build_fused_module(
        module, graph, GraphRewrite({}, {}), constants, class_name="Traced", fusion="test"
    )


def _renaming(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "old_scale" in kwargs:
            kwargs["scale"] = kwargs.pop("old_scale")
        return fn(*args, **kwargs)

    return wrapper


class _Decorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    @_renaming
    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return self.proj(x) * scale


def test_a_forward_decorated_by_unknown_code_is_refused_and_a_transparent_one_traced_through() -> None:
    """A decorator may change dtypes or grad mode (``torch.autocast``, ``no_grad``): refused, unless
    its module is declared to only rename arguments (as transformers' ``deprecate_kwarg``)."""
    module, x = _Decorated(), torch.randn(3, 8)
    with pytest.raises(FusionError, match=r"wrapped by a decorator defined in .*test_fusion_tracing\.py"):
        trace_module(module)
    TRANSPARENT_DECORATOR_MODULES.add(__name__)
    traced = _retraced(module)
    torch.testing.assert_close(traced(x), module(x))
    assert "proj" in traced.code


class _Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        heads = self.proj(x).view((*lead, -1, 2)).transpose(-1, -2)
        return heads.reshape(*lead, -1)


def test_unpacking_a_shape_into_a_tuple_or_a_call_is_built_at_run_time() -> None:
    module = _Heads()
    traced = _retraced(module)
    for shape in [(3, 8), (2, 5, 8), (1, 2, 3, 8)]:  # the rank is not baked in
        x = torch.randn(*shape)
        torch.testing.assert_close(traced(x), module(x))


class _Loops(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = 1
        for d in x.shape:
            total = total * d
        return self.proj(x) / total


def test_other_iteration_of_a_traced_value_still_fails_the_trace_with_where() -> None:
    with pytest.raises(
        FusionError,
        match=r"could not trace _Loops.forward: TraceError: Proxy object cannot be iterated.*test_fusion_tracing.py",
    ):
        trace_module(_Loops())


class _Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, past_key_values: Any = None) -> torch.Tensor:
        out = self.proj(x)
        if past_key_values is not None:
            out = out + past_key_values.pop()
        return out


def test_an_argument_that_is_none_in_inference_is_traced_as_none_and_checked_at_run_time() -> None:
    module, x = _Cached(), torch.randn(2, 8)
    traced = _retraced(module)
    torch.testing.assert_close(traced(x), module(x))
    torch.testing.assert_close(traced(x, past_key_values=None), module(x))
    with pytest.raises(AssertionError, match="past_key_values has been specialized to have value None"):
        traced(x, past_key_values=[torch.ones(8)])


class _Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, memory: Any = None) -> torch.Tensor:
        return self.proj(x) if memory is None else self.proj(x) + memory


def test_register_none_argument_adds_a_name() -> None:
    with pytest.raises(FusionError, match="TraceError"):
        _retraced(_StatefulBranchy())
    register_none_argument("memory")
    module, x = _StatefulBranchy(), torch.randn(2, 8)
    torch.testing.assert_close(_retraced(module)(x), module(x))


class _StatefulBranchy(_Stateful):
    def forward(self, x: torch.Tensor, memory: Any = None) -> torch.Tensor:
        if memory is not None and memory.sum() > 0:
            return self.proj(x) + memory
        return self.proj(x)


def _kernel(
    module: nn.Module, q: torch.Tensor, k: torch.Tensor, *, scale: float, **kwargs: Any
) -> torch.Tensor:
    if q.shape[0] > 1:  # branches on a shape: cannot be traced through
        q = q * kwargs.get("boost", 1.0)
    return (q * k).sum(-1, keepdim=True) * scale * module.factor


class _UsesKernel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.factor = 3.0

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return _kernel(self, self.q(x), self.k(x), scale=0.5, **kwargs)


class _Holder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def test_a_registered_leaf_function_is_one_node_and_receives_the_forwarded_kwargs() -> None:
    module = _UsesKernel()
    with pytest.raises(FusionError, match=r"could not trace _UsesKernel\.forward"):
        trace_module(module)
    register_leaf_function(_kernel)
    traced = _retraced(module)
    assert "_kernel" in traced.code and "forwarded_kwargs" in traced.code
    x = torch.randn(4, 8)
    torch.testing.assert_close(traced(x), module(x))
    torch.testing.assert_close(traced(x, boost=5.0), module(x, boost=5.0))  # kwargs reach the kernel
    # And the sibling fusion on top of it: the kernel gets the module itself (``self.factor``).
    model = _Holder(module)
    want = model.inner(x, boost=2.0)
    surgery.apply_fusions(model, {"sibling_linears": True}, strict=True)
    assert set(model.inner._modules) == {"q_k"}
    torch.testing.assert_close(model.inner(x, boost=2.0), want)


def _helper(q: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return q * kwargs.get("boost", 1.0)


class _KwargsIntoPython(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return _helper(self.q(x), **kwargs)


def test_kwargs_passed_into_a_function_the_tracer_steps_into_are_refused() -> None:
    with pytest.raises(FusionError, match="passes \\*\\*kwargs to a function the tracer steps into"):
        trace_module(_KwargsIntoPython())


def test_register_leaf_function_needs_a_function() -> None:
    with pytest.raises(FusionError, match="needs a Python function"):
        register_leaf_function(torch.relu)


def test_tracing_leaves_the_module_and_the_leaf_functions_as_they_were() -> None:
    register_leaf_function(_kernel)
    module = _UsesKernel()
    before = dict(module.__dict__)
    trace_module(module)
    assert module.__dict__ == before
    assert globals()["_kernel"] is _kernel  # the recording wrapper is gone after the trace


class _Remembers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.last_len = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_len = x.shape[0]
        return self.proj(x)


def test_a_forward_that_assigns_attributes_is_refused_and_the_module_keeps_its_values() -> None:
    module = _Remembers()
    with pytest.raises(FusionError, match=r"forward assigns self\.last_len"):
        trace_module(module)
    assert module.last_len == 0


class _CopiesKwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.factor = 1.0

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        kwargs = dict(kwargs)
        bias = kwargs.pop("bias", 0.0)
        return _kernel(self, self.q(x), self.k(x), scale=0.5, **kwargs) + bias


def _reads_then_forwards(module: nn.Module, q: torch.Tensor, k: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return _kernel(module, q, k, scale=kwargs.get("scale", 1.0), **kwargs)


class _HelperReadsKwargs(_CopiesKwargs):
    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return _reads_then_forwards(self, self.q(x), self.k(x), **kwargs)


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (_CopiesKwargs(), "forward copies or inspects \\*\\*kwargs"),
        (_HelperReadsKwargs(), "reach '_kernel' through a function the tracer steps into"),
    ],
    ids=["copied", "read-by-a-helper"],
)
def test_kwargs_that_are_read_on_the_way_to_a_leaf_are_refused(module: nn.Module, reason: str) -> None:
    register_leaf_function(_kernel)
    with pytest.raises(FusionError, match=reason):
        trace_module(module)


class _Rotate(nn.Module):
    """A function wrapped in a module object that is not a child (transformers does this to
    ``apply_rotary_pos_emb`` when the ``kernels`` package is installed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[..., 4:], x[..., :4]], dim=-1)


_ROTATE = _Rotate()


class _UsesAModuleObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ROTATE(self.q(x)) * self.k(x)


def test_a_module_object_that_is_not_a_child_is_traced_through_like_a_function() -> None:
    module, x = _UsesAModuleObject(), torch.randn(3, 8)
    traced = _retraced(module)
    assert "torch.cat" in traced.code and "_ROTATE" not in traced.code
    torch.testing.assert_close(traced(x), module(x))
