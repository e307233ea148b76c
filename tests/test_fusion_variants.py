"""A fused module runs the graph of the case each call is: train or eval, a cache given or not."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from surgery.fusion import FusedModule, apply_fusions
from surgery.fusion.variants import Variant, every_variant

pytestmark = pytest.mark.usefixtures("isolated_fusion_registry")


class _CachedAttention(nn.Module):
    """Branches on the cache (``is not None``) and on the mode, like transformers' attention."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, past_key_values: Any = None) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if past_key_values is not None:
            k = past_key_values.update(k)
        scale = 2.0 if self.training else 1.0
        return (q * scale) @ k.transpose(-1, -2) @ v


class _Cache:
    """Appends keys along the sequence, as a KV cache does."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None

    def update(self, k: torch.Tensor) -> torch.Tensor:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=-2)
        return self.keys[..., -k.shape[-2] :, :]


def _fused() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(_CachedAttention()).eval()
    reference = copy.deepcopy(model)
    plan = apply_fusions(model, {"qkv": True})
    assert isinstance(model[0], FusedModule), str(plan)
    return model, reference


X = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_each_call_runs_the_graph_of_its_case(train: bool) -> None:
    model, reference = _fused()
    model.train(train)
    reference.train(train)
    assert torch.equal(model(X), reference(X))
    ours, theirs = _Cache(), _Cache()
    for _ in range(2):
        assert torch.equal(model[0](X, ours), reference[0](X, theirs))
        assert torch.equal(model[0](X, past_key_values=ours), reference[0](X, past_key_values=theirs))
    assert ours.keys is not None and theirs.keys is not None and torch.equal(ours.keys, theirs.keys)
    assert ours.keys.shape[-2] == 4 * X.shape[-2]


def test_every_case_has_a_forward_and_cases_with_the_same_code_share_it() -> None:
    model, _ = _fused()
    table = model[0].variants
    assert table is not None
    assert set(table.forwards) == set(
        every_variant(training=False, reads_training=True, optional=["past_key_values"])
    )
    assert len({id(f) for f in table.forwards.values()}) == 4
    assert table.slots == (("past_key_values", 1),)


def test_a_deep_copy_keeps_every_case() -> None:
    model, reference = _fused()
    clone = copy.deepcopy(model)
    assert torch.equal(clone[0](X, _Cache()), reference[0](X, _Cache()))


def test_a_pickled_fused_module_keeps_the_default_case_and_refuses_the_others() -> None:
    model, reference = _fused()
    clone = pickle.loads(pickle.dumps(model))
    assert torch.equal(clone(X), reference(X))
    with pytest.raises(AssertionError, match="past_key_values has been specialized"):
        clone[0](X, _Cache())
    _fused()  # and later traces in the process still work (torch.fx's own check broke them)


def test_variants_name_their_case() -> None:
    assert str(Variant(True, frozenset({"cache"}))) == "train, cache given"
    assert str(Variant(False)) == "eval, no state argument given"


def test_a_deep_copy_owns_its_graphs_and_follows_its_own_mode() -> None:
    model, reference = _fused()
    clone = copy.deepcopy(model)
    assert clone[0].variants is not None and model[0].variants is not None
    for variant, graph in clone[0].variants.graphs.items():
        assert graph is not model[0].variants.graphs[variant]
    clone.train()
    reference.train()
    assert model[0].training is False
    assert "2.0" in clone[0].code and "2.0" not in model[0].code
    assert torch.equal(clone(X), reference(X))
