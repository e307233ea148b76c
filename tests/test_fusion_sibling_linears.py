"""The sibling-projection fusions (``sibling_linears``, ``qkv``, ``gate_up``), found by dataflow.

The example decoder (``surgery.examples.decoder``) stores q/k/v and gate/up as separate linears,
in the runtime and the checkpoint layout alike. Checkpoints are written with safetensors' own
writer, so "byte-identical" means identical to a file the library did not write itself.
"""

from __future__ import annotations

import copy
import filecmp
import math
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from safetensors.torch import load_file, save_file
from torch import nn

import surgery
from surgery import ConfigurationError, FusionError
from surgery.examples import build_decoder_model, build_dense_model, build_vision_tower, example_pixel_values
from surgery.examples.decoder import ExampleDecoderConfig
from surgery.fusion import FusedModule, fusion_config_of, preview_fusions

pytestmark = pytest.mark.usefixtures("isolated_fusion_registry")

BOTH = {"qkv": True, "gate_up": True}
IDS = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))


def _write(model: nn.Module, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _same_files(got: Path, want: Path) -> None:
    assert filecmp.cmp(got / "model.safetensors", want / "model.safetensors", shallow=False)


# ---------------------------------------------------------------------- outputs
@pytest.mark.parametrize("config", [BOTH, {"sibling_linears": True}, {"qkv": True}, {"gate_up": True}])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_decoder_computes_what_the_unfused_one_does_in_fp32(config: dict, bias: bool) -> None:
    model = build_decoder_model(ExampleDecoderConfig(bias=bias)).eval()
    want = model(IDS)
    plan = surgery.apply_fusions(model, config)
    assert plan.candidates and all(c.status in ("fused", "skipped") for c in plan.candidates)
    assert any(c.status == "fused" for c in plan.candidates)
    torch.testing.assert_close(model(IDS), want, rtol=0, atol=1e-5)


def test_fused_decoder_in_bf16_stays_within_bf16_rounding() -> None:
    model = build_decoder_model(dtype=torch.bfloat16).eval()
    want = model(IDS).float()
    surgery.apply_fusions(model, BOTH)
    got = model(IDS).float()
    # One bf16 rounding of the logits' scale (2^-8 relative); the products themselves are the same.
    assert (got - want).abs().max() <= want.abs().max() * 2**-7


def test_presets_name_the_fused_projections_and_keep_the_row_order() -> None:
    model = build_decoder_model()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, k, v = attn.q_proj.weight.detach().clone(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach()
    gate, up = mlp.gate_proj.weight.detach().clone(), mlp.up_proj.weight.detach().clone()
    surgery.apply_fusions(model, BOTH)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn, FusedModule) and set(attn._modules) == {"qkv_proj", "o_proj"}
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert list(mlp._modules) == ["gate_up_proj", "down_proj"]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate, up]))
    assert fusion_config_of(model) == BOTH


def test_the_generic_fusion_joins_the_siblings_names() -> None:
    model = build_decoder_model()
    surgery.apply_fusions(model, {"sibling_linears": True})
    assert set(model.model.layers[0].self_attn._modules) == {"q_k_v_proj", "o_proj"}
    assert set(model.model.layers[0].mlp._modules) == {"gate_up_proj", "down_proj"}


class _Llama2Style(nn.Module):
    """Meta's naming: ``wq/wk/wv/wo`` and ``w1/w2/w3``; ``up`` is called before ``gate`` here."""

    def __init__(self, dim: int = 16, hidden: int = 24) -> None:
        super().__init__()
        self.attention = _WqkvAttention(dim)
        self.feed_forward = _W13MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(self.attention(x))


class _WqkvAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        return self.wo(F.scaled_dot_product_attention(q, k, v))


class _W13MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.w3(x)
        return self.w2(F.silu(self.w1(x)) * up)


def test_presets_find_projections_by_dataflow_not_by_name() -> None:
    torch.manual_seed(0)
    model, x = _Llama2Style(), torch.randn(3, 5, 16)
    want = model(x)
    w1 = model.feed_forward.w1.weight.detach().clone()
    surgery.apply_fusions(model, BOTH, strict=True)
    assert set(model.attention._modules) == {"qkv_proj", "wo"}
    assert set(model.feed_forward._modules) == {"gate_up_proj", "w2"}
    # The activated projection (w1) comes first although w3 is called first.
    assert torch.equal(model.feed_forward.gate_up_proj.weight[:24], w1)
    torch.testing.assert_close(model(x), want, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- checkpoints
def test_original_checkpoint_loads_into_the_fused_model_exactly_and_saves_back_byte_identical(
    tmp_path: Path,
) -> None:
    source = build_decoder_model(ExampleDecoderConfig(bias=True), seed=1)
    original = _write(source, tmp_path / "original")
    model = build_decoder_model(ExampleDecoderConfig(bias=True), device="meta")
    surgery.apply_fusions(model, BOTH)
    report = surgery.load_checkpoint(model, original, strict=True)
    assert report.ok, str(report)
    sd = load_file(original / "model.safetensors")
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    prefix = "model.layers.1."
    assert torch.equal(
        attn.qkv_proj.weight, torch.cat([sd[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"])
    )
    assert torch.equal(
        mlp.gate_up_proj.weight, torch.cat([sd[prefix + f"mlp.{p}_proj.weight"] for p in ("gate", "up")])
    )
    assert torch.equal(
        mlp.gate_up_proj.bias, torch.cat([sd[prefix + f"mlp.{p}_proj.bias"] for p in ("gate", "up")])
    )
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in sd.items() if k in state)  # every unfused tensor too
    torch.testing.assert_close(model(IDS), source(IDS), rtol=0, atol=1e-5)

    surgery.save_checkpoint(model, tmp_path / "back")
    _same_files(tmp_path / "back", original)


def test_fused_layout_save_reloads_into_a_fresh_model_and_exports_the_original(tmp_path: Path) -> None:
    original = _write(build_decoder_model(seed=1), tmp_path / "original")
    model = build_decoder_model(device="meta")
    surgery.apply_fusions(model, BOTH)
    surgery.load_checkpoint(model, original, strict=True)
    surgery.save_checkpoint(model, tmp_path / "fused", original_format=False)
    assert "model.layers.0.self_attn.qkv_proj.weight" in load_file(tmp_path / "fused" / "model.safetensors")

    fresh = build_decoder_model(seed=5, device="meta")
    report = surgery.load_checkpoint(fresh, tmp_path / "fused", strict=True)
    assert report.ok, str(report)
    assert isinstance(fresh.model.layers[0].mlp, FusedModule)  # the persisted config was applied
    surgery.save_checkpoint(fresh, tmp_path / "back")
    _same_files(tmp_path / "back", original)


def test_a_fused_model_never_loaded_still_exports_the_original_layout(tmp_path: Path) -> None:
    """The split sizes travel with the transform, so no recorded checkpoint shapes are needed (GQA)."""
    source = build_decoder_model(seed=1)
    original = _write(source, tmp_path / "original")
    surgery.apply_fusions(source, BOTH)
    surgery.save_checkpoint(source, tmp_path / "back")
    _same_files(tmp_path / "back", original)


def test_a_fusion_whose_keys_the_family_mapping_converts_is_refused_before_reading(tmp_path: Path) -> None:
    """The dense example stores q/k RoPE-permuted; its mapping claims ``q_proj.weight`` too."""
    model = build_dense_model()
    surgery.save_checkpoint(model, tmp_path / "dense")
    fused = build_dense_model(seed=3)
    surgery.apply_fusions(fused, {"qkv": True})
    before = fused.model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    with pytest.raises(ConfigurationError, match=r"'qkv'.*q_proj\.weight.*also claims it"):
        surgery.load_checkpoint(fused, tmp_path / "dense")
    assert torch.equal(fused.model.layers[0].self_attn.qkv_proj.weight, before)


# ---------------------------------------------------------------------- preview and composition
def test_preview_shows_groups_shapes_split_sizes_and_transforms_and_changes_nothing() -> None:
    model = build_decoder_model()
    plan = preview_fusions(model, {"qkv": True})
    entry = plan.candidates[0]
    assert entry.status == "would fuse" and entry.path == "model.layers.0.self_attn"
    assert "q_proj, k_proj, v_proj read 'x'" in entry.reason and "split into [32, 16, 16]" in entry.reason
    assert entry.params_after["qkv_proj.weight"].shape == (64, 32)
    assert "Concatenate(dim=0, sizes=(32, 16, 16))" in repr(entry.transforms)
    assert "qkv_proj" in plan.to_mermaid() and "qkv_proj" in plan.to_dot()
    assert not isinstance(model.model.layers[0].self_attn, FusedModule)


class _VisionAndText(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.visual = build_vision_tower(depth=1)
        self.language = build_decoder_model()


def test_patch_embeddings_qkv_and_gate_up_compose_in_order_on_one_model() -> None:
    model = _VisionAndText().eval()
    pixels = example_pixel_values(model.visual.config, num_patches=8)
    want = model.visual(pixels), model.language(IDS)
    config = {"patch_embeddings": True, "qkv": True, "gate_up": True}
    plan = surgery.apply_fusions(model, config)
    assert plan.fusions == ("patch_embeddings", "qkv", "gate_up")
    assert type(model.visual.patch_embed).__name__ == "FusedExamplePatchEmbed"
    assert isinstance(model.language.model.layers[0].self_attn, FusedModule)
    assert fusion_config_of(model) == config
    torch.testing.assert_close(model.visual(pixels), want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(model.language(IDS), want[1], rtol=0, atol=1e-5)


def test_fusing_twice_is_a_no_op_with_a_message() -> None:
    model = build_decoder_model()
    surgery.apply_fusions(model, BOTH)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = surgery.apply_fusions(model, {"qkv": True}, strict=True)
    assert "Already applied to 2 module(s)" in plan.messages["qkv"]
    assert model.model.layers[0].self_attn.fusion_names == ("qkv",)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_torch_compile_of_a_fused_model_runs_and_gives_the_same_output() -> None:
    model = build_decoder_model().eval()
    surgery.apply_fusions(model, BOTH)
    want = model(IDS)
    compiled = torch.compile(model, fullgraph=True)  # dynamo + inductor: one graph through the fused modules
    with torch.no_grad():
        torch.testing.assert_close(compiled(IDS), want, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- negative cases
class _Two(nn.Module):
    def __init__(self, **linear: object) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8, **linear)  # type: ignore[arg-type]


class _DifferentInputs(_Two):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(y)


class _LayoutDependent(_Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(x)
        out.add_(1)
        return self.a(x) + out


class _CalledTwice(_Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) + self.b(x * 2)


class _AliasWritten(_Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(x)
        out.view(-1).mul_(2)  # through a view: the write must reach ``out``
        return self.a(x) + out


class _InputWrittenBetween(_Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1
        a = self.a(h)
        h.mul_(2)
        return a + self.b(h)


class _InplaceActivationBetween(_Two):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1
        a = self.a(h)
        self.act(h)
        return a + self.b(h)


class _WrittenThroughContiguous(_Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.b(x)
        torch.relu_(b.contiguous())
        return self.a(x) + b


class _Frozen(_Two):
    def __init__(self) -> None:
        super().__init__()
        self.b.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(x)


class _Tied(_Two):
    def __init__(self) -> None:
        super().__init__()
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(x)


class _Plain(_Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(x)


class _Branchy(_Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.a(x) + self.b(x)
        return self.a(x)


class _ReadsWeight(_Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) + self.b.weight.sum()


class _Holder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


@pytest.mark.parametrize(
    ("inner", "reason"),
    [
        (_DifferentInputs(), "no two of the nn.Linear children ['a', 'b'] are called on the same input"),
        (_LayoutDependent(), "the output of 'b' goes to %add_"),
        (_CalledTwice(), "'b' is called 2 times"),
        (_Plain(dtype=torch.float64), "differ in in_features, dtype, device, bias presence or requires_grad"),
        (_Plain(bias=False), "(no bias, torch.float32, cpu, in_features 8)"),
        (_Branchy(), "untraceable: torch.fx could not trace _Branchy.forward: TraceError"),
        (_ReadsWeight(), "forward reads 'b.weight'"),
        (_AliasWritten(), "the output of 'b' goes to %mul_"),
        (_InputWrittenBetween(), "writes in place between the calls of ['a', 'b']"),
        (_InplaceActivationBetween(), "writes in place between the calls of ['a', 'b']"),
        (_WrittenThroughContiguous(), "the output of 'b' goes to %relu_"),
        (_Frozen(), "frozen"),
        (_Tied(), "share a parameter (tied weights)"),
    ],
    ids=[
        "different-inputs",
        "in-place-on-output",
        "called-twice",
        "dtypes",
        "bias-on-one",
        "untraceable",
        "reads-weight",
        "in-place-through-a-view",
        "input-written-between",
        "inplace-module-between",
        "written-through-contiguous",
        "frozen",
        "tied",
    ],
)
def test_a_module_that_cannot_be_fused_is_skipped_with_its_reason_and_left_alone(
    inner: nn.Module, reason: str
) -> None:
    model = _Holder(inner)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = surgery.apply_fusions(model, {"sibling_linears": True})
    (entry,) = plan.candidates
    assert entry.status == "skipped" and reason in entry.reason, entry.reason
    assert model.inner is inner and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(FusionError, match=r"could not fuse 'inner'|Nothing compatible found"):
        surgery.apply_fusions(model, {"sibling_linears": True}, strict=True)


def test_gate_up_leaves_two_siblings_that_are_not_a_gated_product() -> None:
    model = _Holder(_Plain())
    plan = surgery.preview_fusions(model, {"gate_up": True})
    assert "do not meet in act(gate) * up" in plan.candidates[0].reason
    assert "Nothing compatible found" in plan.messages["gate_up"]


# ---------------------------------------------------------------------- properties
class _Siblings(nn.Module):
    def __init__(self, in_features: int, outs: list[int], bias: bool) -> None:
        super().__init__()
        self.projs = len(outs)
        for i, out in enumerate(outs):
            self.add_module(f"p{i}", nn.Linear(in_features, out, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [self._modules[f"p{i}"](x) for i in range(self.projs)]  # type: ignore[misc]
        return torch.cat([p * (i + 1) for i, p in enumerate(parts)], dim=-1)


@settings(max_examples=25, deadline=None)
@given(
    in_features=st.integers(1, 12),
    outs=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    bias=st.booleans(),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
)
def test_any_sibling_group_fuses_to_the_same_function_and_back_to_the_same_weights(
    in_features: int, outs: list[int], bias: bool, lead: list[int]
) -> None:
    torch.manual_seed(math.prod(outs) + in_features)
    model = _Holder(_Siblings(in_features, outs, bias))
    x = torch.randn(*lead, in_features)
    want = model.inner(x)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    surgery.apply_fusions(model, {"sibling_linears": True}, strict=True)
    torch.testing.assert_close(model.inner(x), want, rtol=0, atol=1e-5)
    back = surgery.revert_state_dict(model)
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], v) for k, v in original.items())


# ---------------------------------------------------------------------- every built-in example
def _moe() -> nn.Module:
    from surgery.examples import build_moe_model

    return build_moe_model()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("build", "fused"),
    [(build_decoder_model, 4), (build_dense_model, 2), (_moe, 2)],
    ids=["decoder", "dense", "moe"],
)
def test_every_built_in_example_with_siblings_fuses_and_computes_the_same(build, fused: int, dtype) -> None:
    """q/k/v everywhere; gate/up where the runtime layout keeps them apart (the dense example fuses
    its MLP already; the MoE experts are not linears)."""
    model = build().to(dtype).eval()
    with torch.no_grad():
        want = model(IDS).float()
        plan = surgery.apply_fusions(model, BOTH)
        got = model(IDS).float()
    assert sum(c.status == "fused" for c in plan.candidates) == fused, str(plan)
    bound = 1e-5 if dtype == torch.float32 else want.abs().max().item() * 2**-7
    assert (got - want).abs().max() <= bound


def test_the_vision_example_has_nothing_to_fuse_and_says_so() -> None:
    """Its attention stores one fused ``qkv`` already and its MLP's two linears are in series."""
    plan = surgery.preview_fusions(build_vision_tower(depth=1), {"sibling_linears": True})
    assert not plan.matched and "Nothing compatible found" in plan.messages["sibling_linears"]


class _FlattensAfterACast(_Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a(x).float().view(-1)  # a no-op cast, then a view that needs the whole output
        bits = self.b(x).view(torch.int32)  # a dtype view: kept a view
        return a + bits.view(torch.float32).reshape(-1)


def test_views_after_no_op_casts_become_reshapes_and_dtype_views_stay() -> None:
    model, x = _Holder(_FlattensAfterACast()), torch.randn(3, 8)
    want = model.inner(x)
    surgery.apply_fusions(model, {"sibling_linears": True}, strict=True)
    assert ".reshape(-1)" in model.inner.code and "view(torch.int32)" in model.inner.code
    torch.testing.assert_close(model.inner(x), want, rtol=0, atol=1e-6)


def test_strict_raises_for_a_group_that_is_there_and_refused_not_for_modules_without_one() -> None:
    with pytest.raises(FusionError, match=r"could not fuse 'inner' \(_Frozen\).*frozen"):
        surgery.apply_fusions(_Holder(_Frozen()), {"sibling_linears": True}, strict=True)
    model = build_decoder_model()  # gate_up also looks at the attentions: no gated product there
    plan = surgery.apply_fusions(model, {"gate_up": True}, strict=True)
    attn = next(c for c in plan.candidates if c.path.endswith("self_attn"))
    assert attn.status == "skipped" and "nothing to fuse" in attn.reason


class _CausalFlag(nn.Module):
    is_causal = False  # a class attribute, read by the kernel from the module

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _flagged_kernel(self, self.q(x), self.k(x))


def _flagged_kernel(module: nn.Module, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q * k if getattr(module, "is_causal", True) else q + k


def test_the_fused_module_answers_class_level_attributes_of_the_original() -> None:
    from surgery.fusion import register_leaf_function

    register_leaf_function(_flagged_kernel)
    model, x = _Holder(_CausalFlag()), torch.randn(2, 8)
    want = model.inner(x)
    surgery.apply_fusions(model, {"sibling_linears": True}, strict=True)
    assert model.inner.is_causal is False
    torch.testing.assert_close(model.inner(x), want)


class _SharesALinear(nn.Module):
    """ALBERT-style sharing: the second block reuses the first block's ``q``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = _Plain()
        self.second = _Plain()
        self.second.a = self.first.a


def test_a_candidate_whose_child_or_parameter_is_shared_with_another_module_is_left_alone() -> None:
    model = _SharesALinear()
    plan = surgery.apply_fusions(model, {"sibling_linears": True})
    reasons = {c.path: c.reason for c in plan.candidates}
    assert "also registered at 'second.a' (shared)" in reasons["first"]
    assert not isinstance(model.first, FusedModule) and model.second.a is model.first.a
    tied = _Holder(_Plain())
    tied.inner.b.weight = nn.Parameter(torch.randn(8, 8))
    tied.head = nn.Linear(8, 8)
    tied.head.weight = tied.inner.b.weight
    plan = surgery.apply_fusions(tied, {"sibling_linears": True})
    assert "its parameter 'inner.b.weight' is tied to 'head.weight'" in plan.candidates[0].reason


class _DropsOut(_Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = 0.5 if self.training else 0.0  # evaluated while tracing
        return torch.nn.functional.dropout(self.a(x), p, self.training) * self.b(x)


def test_a_forward_that_reads_self_training_keeps_one_graph_per_mode() -> None:
    model, x = _Holder(_DropsOut()), torch.randn(4, 8)
    assert model.training
    surgery.apply_fusions(model, {"sibling_linears": True}, strict=True)
    fused = model.inner
    assert "0.5" in fused.code
    model.eval()
    assert "0.5" not in fused.code
    reference = _DropsOut().eval()
    original = surgery.revert_state_dict(model)
    reference.load_state_dict({k.removeprefix("inner."): v for k, v in original.items()})
    torch.testing.assert_close(fused(x), reference(x), rtol=0, atol=1e-6)
    copied = copy.deepcopy(model)
    copied.train()
    assert "0.5" in copied.inner.code and "0.5" not in fused.code
