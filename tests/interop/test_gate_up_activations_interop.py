"""``gate_up`` recognises the activation by what it does: every activation of transformers' ``ACT2FN``.

transformers' own ``LlamaMLP`` (``down(act(gate(x)) * up(x))``) is built with each
``hidden_act`` that ``ACT2FN`` knows; each fuses and gives exactly the unfused output. A module
that is not elementwise in the activation's place (a softmax, a norm) is not taken for one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import surgery

transformers = pytest.importorskip("transformers")
from transformers.activations import ACT2CLS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("isolated_fusion_registry")]

X = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))


def _strided_kernel_differs(act: nn.Module) -> bool:
    """Whether torch's CPU kernel of ``act`` gives other last bits on a strided input (the gate, a
    slice of the fused output) than on a contiguous one. Which do depends on the CPU's vector
    units (erf GELU everywhere; SiLU, sigmoid, Mish, tanh GELU too on some AMD EPYC), so it is
    measured here rather than listed."""
    fused = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(1))
    gate = fused[..., :48]
    with torch.no_grad():
        return not torch.equal(act(gate), act(gate.contiguous()))


def _model(hidden_act: str, *, device: str | None = None) -> nn.Module:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act=hidden_act)
    torch.manual_seed(0)
    model = nn.Sequential()
    with torch.device(device or "cpu"):
        model.append(LlamaMLP(config))
    return model.eval()


@pytest.mark.parametrize("hidden_act", sorted(ACT2CLS))
def test_every_transformers_activation_is_recognised_and_the_output_is_unchanged(hidden_act: str) -> None:
    model = _model(hidden_act)
    reference = copy.deepcopy(model)
    plan = surgery.apply_fusions(model, {"gate_up": True})
    (entry,) = plan.candidates
    assert entry.status == "fused", str(plan)
    assert list(model[0]._modules) == ["gate_up_proj", "down_proj", "act_fn"]
    with torch.no_grad():
        got, want = model(X), reference(X)
    if _strided_kernel_differs(reference[0].act_fn):
        # The gate is a strided slice of the fused output; torch's CPU kernel of this activation
        # takes another path for it than for a contiguous tensor, which differs in the last bits.
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    else:
        assert torch.equal(got, want)


def test_the_gate_rows_come_first_whatever_the_activation_is_called() -> None:
    """Gemma's ``GELUTanh`` (no ``Activation`` in its name) is the gate side: its rows come first."""
    model = _model("gelu_pytorch_tanh")
    assert type(model[0].act_fn).__name__ == "GELUTanh"
    gate, up = model[0].gate_proj.weight.clone(), model[0].up_proj.weight.clone()
    surgery.apply_fusions(model, {"gate_up": True})
    assert torch.equal(model[0].gate_up_proj.weight, torch.cat([gate, up]))


def test_an_activation_with_meta_parameters_is_recognised_in_a_preview() -> None:
    """On ``meta`` there are no values to probe: a copy of the activation gets some (PReLU's weight)."""
    model = _model("prelu", device="meta")
    plan = surgery.preview_fusions(model, {"gate_up": True})
    (entry,) = plan.candidates
    assert entry.status == "would fuse", str(plan)


@pytest.mark.parametrize(
    "not_elementwise",
    [nn.Softmax(dim=-1), nn.LayerNorm(48), nn.Linear(48, 48), nn.Dropout(0.5).train()],
    ids=["softmax", "layernorm", "linear", "dropout-in-train-mode"],
)
def test_a_module_that_is_not_elementwise_is_not_taken_for_an_activation(not_elementwise: nn.Module) -> None:
    model = _model("silu")
    model[0].act_fn = not_elementwise
    rng = torch.get_rng_state()
    plan = surgery.preview_fusions(model, {"gate_up": True})
    assert torch.equal(torch.get_rng_state(), rng)  # the probe leaves the random state alone
    assert not any(c.status == "would fuse" for c in plan.candidates), str(plan)
    assert "do not meet in act(gate) * up" in plan.render()
