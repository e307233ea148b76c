"""``gate_up`` takes any elementwise call on one sibling's output for the activation, whatever its name."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from surgery.fusion import apply_fusions

pytestmark = pytest.mark.usefixtures("isolated_fusion_registry")


class Squish(nn.Module):
    """An activation whose class name says nothing: x * sigmoid(1.7 x), with a learned offset."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.tensor(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.7 * x) + self.offset


class _Gated(nn.Module):
    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = (
            nn.Linear(16, 24, bias=False),
            nn.Linear(16, 24, bias=False),
            nn.Linear(24, 16),
        )
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w3(x)) * self.w1(x))  # the gate is called second


X = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "act",
    [Squish(), torch.special.expit, lambda x: F.gelu(x, approximate="tanh")],
    ids=["module-without-activation-in-its-name", "torch.special.expit", "gelu-tanh-function"],
)
def test_an_elementwise_call_on_one_sibling_makes_it_the_gate(
    act: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Gated(act))
    reference = copy.deepcopy(model)
    gate = model[0].w3.weight.detach().clone()
    plan = apply_fusions(model, {"gate_up": True})
    assert [c.status for c in plan.candidates] == ["fused"], str(plan)
    assert torch.equal(model[0].gate_up_proj.weight[:24], gate)  # the activated sibling's rows first
    # The activation now runs on a strided slice of the fused output; torch's CPU kernels for some
    # functions take another path there than on a contiguous tensor, differing in the last bits.
    torch.testing.assert_close(model(X), reference(X), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "act",
    [
        lambda x: F.softmax(x, dim=-1),
        lambda x: torch.cumsum(x, dim=-1),
        lambda x: x - x.mean(-1, keepdim=True),
    ],
    ids=["softmax", "cumsum", "centering"],
)
def test_a_call_that_mixes_elements_is_not_an_activation(act: Callable[[torch.Tensor], torch.Tensor]) -> None:
    model = nn.Sequential(_Gated(act))
    plan = apply_fusions(model, {"gate_up": True})
    assert not any(c.status == "fused" for c in plan.candidates)
    assert "do not meet in act(gate) * up" in plan.render()
