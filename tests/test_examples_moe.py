"""The example Mixtral-style MoE: its two layouts, checked against each other and against the engine."""

from __future__ import annotations

import pytest
import torch

import surgery
from surgery.examples.moe import ExampleMoEConfig, ExampleMoEForCausalLM, build_moe_model, original_state_dict

CFG = ExampleMoEConfig()


def test_runtime_layout_has_fused_experts() -> None:
    sd = build_moe_model(CFG).state_dict()
    e, i, h = CFG.num_local_experts, CFG.intermediate_size, CFG.hidden_size
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (e, 2 * i, h)
    assert sd["model.layers.0.mlp.experts.down_proj"].shape == (e, h, i)
    assert len(sd) == 1 + 2 * 9 + 1 + 1


def test_original_layout_has_one_tensor_per_expert_and_projection() -> None:
    model = build_moe_model(CFG)
    sd = original_state_dict(model)
    experts = [k for k in sd if ".experts." in k]
    assert len(experts) == CFG.num_hidden_layers * CFG.num_local_experts * 3
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in sd
    assert "model.layers.1.block_sparse_moe.gate.weight" in sd
    assert not any(".mlp." in k for k in sd)
    fused = model.model.layers[1].mlp.experts
    assert torch.equal(
        sd["model.layers.1.block_sparse_moe.experts.2.w1.weight"],
        fused.gate_up_proj[2, : CFG.intermediate_size],
    )
    assert torch.equal(
        sd["model.layers.1.block_sparse_moe.experts.2.w3.weight"],
        fused.gate_up_proj[2, CFG.intermediate_size :],
    )
    assert torch.equal(sd["model.layers.1.block_sparse_moe.experts.2.w2.weight"], fused.down_proj[2])


def test_original_state_dict_owns_its_memory() -> None:
    model = build_moe_model(CFG)
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not any(t.untyped_storage().data_ptr() in ptrs for t in original_state_dict(model).values())


def test_the_engine_reverts_to_exactly_the_hand_written_original_layout() -> None:
    model = build_moe_model(CFG, seed=4)
    reverted = surgery.revert_state_dict(model)
    truth = original_state_dict(model)
    assert sorted(reverted) == sorted(truth)
    assert all(torch.equal(reverted[k], truth[k]) for k in truth)


def test_the_same_seed_builds_the_same_weights() -> None:
    a, b, c = build_moe_model(CFG, seed=1), build_moe_model(CFG, seed=1), build_moe_model(CFG, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_building_on_meta_allocates_nothing() -> None:
    model = build_moe_model(CFG, device="meta", dtype=torch.bfloat16)
    assert {(t.device.type, t.dtype) for t in model.state_dict().values()} == {("meta", torch.bfloat16)}


def test_forward_gives_logits_and_routes_to_the_top_k_experts() -> None:
    model = build_moe_model(CFG)
    ids = torch.randint(0, CFG.vocab_size, (2, 6))
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (2, 6, CFG.vocab_size) and torch.isfinite(logits).all()


def test_fused_experts_compute_the_classic_per_expert_mlp() -> None:
    model = build_moe_model(CFG)
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(3, CFG.hidden_size)
    top_idx = torch.tensor([[0, 1], [2, 3], [1, 3]])
    top_w = torch.full((3, 2), 0.5)
    sd = original_state_dict(model)

    def expert(e: int, v: torch.Tensor) -> torch.Tensor:
        w = {n: sd[f"model.layers.0.block_sparse_moe.experts.{e}.{n}.weight"] for n in ("w1", "w2", "w3")}
        return (torch.nn.functional.silu(v @ w["w1"].T) * (v @ w["w3"].T)) @ w["w2"].T

    want = torch.stack([sum(0.5 * expert(int(e), x[r]) for e in top_idx[r]) for r in range(3)])
    with torch.no_grad():
        assert torch.allclose(experts(x, top_idx, top_w), want, atol=1e-6)


@pytest.mark.parametrize(
    "bad",
    [
        {"hidden_size": 15, "num_attention_heads": 2},
        {"num_attention_heads": 4, "num_key_value_heads": 3},
        {"num_experts_per_tok": 5},
        {"num_experts_per_tok": 0},
    ],
    ids=["heads", "kv-heads", "too-many-active-experts", "no-active-expert"],
)
def test_inconsistent_config_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        ExampleMoEConfig(**bad)


def test_model_declares_its_base_model_prefix() -> None:
    assert ExampleMoEForCausalLM.base_model_prefix == "model"
    assert build_moe_model(CFG).config.model_type == "mixtral"
