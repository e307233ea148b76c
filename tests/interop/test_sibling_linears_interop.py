"""``qkv`` and ``gate_up`` on transformers' own Llama, Qwen2 and Mistral, eager and sdpa attention.

Each model is built tiny, saved by transformers in its own (original) layout, and loaded by
``surgery`` into a fused model: every tensor equals what transformers loads, the logits equal
the unfused model's, and saving in the original layout gives back transformers' file byte for
byte. The attention modules trace although their forwards are decorated, unpack shapes
(``(*input_shape, -1, d)``), take ``**kwargs`` and call an attention kernel through
``ALL_ATTENTION_FUNCTIONS`` (a leaf of the trace). Running with a cache and ``generate()`` is
tested in test_fused_generation_interop.py.
"""

from __future__ import annotations

import filecmp
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import surgery
from surgery.fusion import FusedModule

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("isolated_fusion_registry")]

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}
SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)
BOTH = {"qkv": True, "gate_up": True}
CONFIGS = {"presets": (BOTH, "qkv_proj"), "generic": ({"sibling_linears": True}, "q_k_v_proj")}
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def _build(family: str, attn: str, seed: int) -> Any:
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    torch.manual_seed(seed)
    return model_cls(config_cls(**SIZES, attn_implementation=attn)).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        _build(family, "eager", seed=1).save_pretrained(path)
        out[family] = path
    return out


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_model_loads_transformers_checkpoint_runs_the_same_and_saves_it_back(
    family: str, attn: str, config: str, saved: dict[str, Path], tmp_path: Path
) -> None:
    fusion_config, qkv_name = CONFIGS[config]
    theirs = (
        type(_build(family, attn, seed=0)).from_pretrained(saved[family], attn_implementation=attn).eval()
    )
    model = _build(family, attn, seed=2)
    plan = surgery.apply_fusions(model, fusion_config)
    fused = {c.path for c in plan.candidates if c.status == "fused"}
    assert fused == {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn", "mlp")}, str(plan)

    report = surgery.load_checkpoint(model, saved[family], strict=True)
    assert report.ok, str(report)
    attn_module = model.model.layers[0].self_attn
    assert isinstance(attn_module, FusedModule) and qkv_name in attn_module._modules
    want = {k: v for k, v in theirs.state_dict().items()}
    back = surgery.revert_state_dict(model)
    assert back.keys() == want.keys()
    assert all(torch.equal(back[k], want[k]) for k in want), [
        k for k in want if not torch.equal(back[k], want[k])
    ]

    with torch.no_grad():
        torch.testing.assert_close(
            model(IDS, use_cache=False).logits, theirs(IDS, use_cache=False).logits, rtol=0, atol=1e-5
        )

    surgery.save_checkpoint(model, tmp_path / "out")
    original = saved[family] / "model.safetensors"
    assert load_file(tmp_path / "out" / "model.safetensors").keys() == load_file(original).keys()
    assert filecmp.cmp(tmp_path / "out" / "model.safetensors", original, shallow=False)


def test_a_cache_under_a_name_the_fused_forward_does_not_take_is_refused_not_ignored() -> None:
    """transformers 5.25's ``deprecate_kwarg`` renames ``past_key_values`` to ``cache``; the fused
    forward takes the inner signature, so a cache under the other spelling lands in ``**kwargs``,
    where it is refused instead of being passed on to the attention kernel and ignored."""
    model = _build("llama", "sdpa", seed=0)
    surgery.apply_fusions(model, {"qkv": True})
    attn = model.model.layers[0].self_attn
    taken = attn.optional_arguments()
    other = "past_key_value" if "past_key_values" in taken else "past_key_values"
    hidden = torch.randn(1, 3, SIZES["hidden_size"])
    cos_sin = model.model.rotary_emb(hidden, torch.arange(3)[None])
    with pytest.raises(AssertionError, match="pass the cache under the parameter name of the forward"):
        attn(hidden, cos_sin, None, **{other: transformers.DynamicCache(config=model.config)})


def test_attention_dropout_follows_train_and_eval_after_fusing_in_train_mode() -> None:
    """``dropout=0.0 if not self.training else p`` is evaluated while tracing: one graph per mode."""
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES["llama"])
    torch.manual_seed(0)
    model = model_cls(config_cls(**SIZES, attn_implementation="sdpa", attention_dropout=0.1))
    reference = model_cls(config_cls(**SIZES, attn_implementation="sdpa", attention_dropout=0.1))
    reference.load_state_dict(model.state_dict())
    assert model.training
    surgery.apply_fusions(model, {"qkv": True})
    model.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(IDS, use_cache=False).logits, reference(IDS, use_cache=False).logits, rtol=0, atol=1e-5
        )
    model.train()
    assert "dropout = 0.1" in model.model.layers[0].self_attn.code


def test_a_fused_attention_traces_again_for_a_later_fusion() -> None:
    """Its graph calls the tracer's run-time helpers (the unpacked shape, the forwarded **kwargs);
    they are leaves of the second trace, so the module is examined, not reported untraceable."""
    model = _build("llama", "sdpa", seed=0)
    surgery.apply_fusions(model, {"qkv": True})
    plan = surgery.preview_fusions(model, {"sibling_linears": True})
    attn = next(c for c in plan.candidates if c.path == "model.layers.0.self_attn")
    assert "nothing to fuse" in attn.reason, attn.reason
