"""A model fused with ``qkv`` and ``gate_up`` runs like the original: default forward, KV cache, generate().

For transformers' Llama, Mistral, Qwen2, Qwen3 (q/k norms), Gemma, Gemma2 and Gemma3 text (sliding
window layers), Phi3 (q/k/v and gate/up already fused: the fusions find nothing and say so) and
Olmo2 (q/k norms over all heads), with eager and sdpa attention. Each fused model is compared with
an unfused copy of itself.

Equal means ``torch.equal``: on CPU the fused projection computes each output element with the
same reduction over ``in_features`` as the separate ones (the fused weight only stacks rows), and
these tests show that it does. If a backend ever reorders that reduction for the wider matmul,
these tests are the ones to say so.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import surgery
from surgery.fusion.variants import Variant

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("isolated_fusion_registry")]

SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    pad_token_id=0,
    eos_token_id=None,
)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    # A window shorter than prompt + new tokens, so generation runs through the sliding layers.
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 8}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
}
ALREADY_FUSED = {"phi3"}
ATTENTION = ("eager", "sdpa")
CASES = [(f, a) for f in FAMILIES for a in ATTENTION]
IDS = [f"{f}-{a}" for f, a in CASES]
FUSIONS = {"qkv": True, "gate_up": True}

PROMPT = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(0))
MASK = torch.ones_like(PROMPT)
MASK[1, :2] = 0  # the second row is left-padded: masks and position ids that differ per row
NEXT = torch.randint(1, 128, (2, 3), generator=torch.Generator().manual_seed(1))


class Pair:
    """An unfused model and a fused deep copy of it, with the fusion plan."""

    def __init__(self, family: str, attn: str) -> None:
        config_name, model_name, extra = FAMILIES[family]
        config = getattr(transformers, config_name)(**SIZES, **extra, attn_implementation=attn)
        torch.manual_seed(0)
        try:
            self.reference = getattr(transformers, model_name)(config).eval()
        except ValueError as exc:  # e.g. Gemma2 has no sdpa in transformers 5.23
            pytest.skip(f"{model_name} with {attn} attention: {str(exc).splitlines()[0]}")
        self.fused = copy.deepcopy(self.reference)
        self.plan = surgery.apply_fusions(self.fused, FUSIONS)


@pytest.fixture(scope="module")
def pairs() -> Any:
    built: dict[tuple[str, str], Pair] = {}

    def get(family: str, attn: str) -> Pair:
        if (family, attn) not in built:
            built[family, attn] = Pair(family, attn)
        return built[family, attn]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_fusions_rewrite_every_attention_and_mlp_or_say_there_is_nothing_to_fuse(
    family: str, pairs: Any
) -> None:
    plan = pairs(family, "eager").plan
    fused = {c.path for c in plan.candidates if c.status == "fused"}
    if family in ALREADY_FUSED:
        assert fused == set(), str(plan)
        for name in FUSIONS:
            assert plan.messages[name].startswith("Nothing compatible found"), str(plan)
        assert "Nothing compatible found" in plan.render()
    else:
        assert fused == {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn", "mlp")}, str(plan)


@pytest.mark.parametrize(("family", "attn"), CASES, ids=IDS)
def test_the_default_forward_gives_the_logits_of_the_unfused_model(
    family: str, attn: str, pairs: Any
) -> None:
    pair = pairs(family, attn)
    with torch.no_grad():
        want, got = pair.reference(PROMPT), pair.fused(PROMPT)  # use_cache from the config: True
    assert got.past_key_values is not None
    assert torch.equal(got.logits, want.logits)


@pytest.mark.parametrize(("family", "attn"), CASES, ids=IDS)
def test_a_second_forward_reusing_the_returned_cache_equals_the_unfused_one(
    family: str, attn: str, pairs: Any
) -> None:
    pair = pairs(family, attn)
    both = torch.cat([MASK, torch.ones_like(NEXT)], dim=1)
    outs = []
    with torch.no_grad():
        for model in (pair.reference, pair.fused):
            first = model(PROMPT, attention_mask=MASK)
            outs.append(model(NEXT, attention_mask=both, past_key_values=first.past_key_values).logits)
    assert torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize(("family", "attn"), CASES, ids=IDS)
def test_generate_gives_the_tokens_of_the_unfused_model(
    family: str, attn: str, cache: str, pairs: Any
) -> None:
    pair = pairs(family, attn)
    options: dict[str, Any] = dict(max_new_tokens=16, do_sample=False, attention_mask=MASK)
    if cache == "static":
        options["cache_implementation"] = "static"
    want = pair.reference.generate(PROMPT, **options)
    got = pair.fused.generate(PROMPT, **options)
    assert want.shape == (2, 7 + 16)
    assert torch.equal(got, want)


@pytest.mark.parametrize("attn", ATTENTION)
def test_the_fused_forward_takes_every_argument_the_original_takes(attn: str, pairs: Any) -> None:
    """No cache (``use_cache=False``), a cache object passed in, explicit ``position_ids``, a mask,
    and keyword arguments transformers hands on to the attention kernel (``cache_position``, unused
    by these kernels, travels in ``**kwargs`` the same way)."""
    pair = pairs("llama", attn)
    positions = (MASK.cumsum(-1) - 1).clamp(min=0)
    calls: list[dict[str, Any]] = [
        dict(use_cache=False),
        dict(use_cache=True, past_key_values=None),
        dict(attention_mask=MASK, position_ids=positions),
        dict(attention_mask=MASK, cache_position=torch.arange(PROMPT.shape[1])),
    ]
    with torch.no_grad():
        for kwargs in calls:
            want = pair.reference(PROMPT, **kwargs)
            got = pair.fused(PROMPT, **kwargs)
            assert torch.equal(got.logits, want.logits), kwargs
            assert (got.past_key_values is None) == (want.past_key_values is None), kwargs
        cache = transformers.DynamicCache(config=pair.reference.config)
        ours = transformers.DynamicCache(config=pair.fused.config)
        pair.reference(PROMPT, past_key_values=cache)
        pair.fused(PROMPT, past_key_values=ours)
        assert cache.get_seq_length() == ours.get_seq_length() == PROMPT.shape[1]
        want = pair.reference(NEXT, past_key_values=cache).logits
        assert torch.equal(pair.fused(NEXT, past_key_values=ours).logits, want)


def test_the_fused_attention_keeps_one_graph_per_case_and_the_cache_update_is_a_call_it_makes(
    pairs: Any,
) -> None:
    attn = pairs("llama", "eager").fused.model.layers[0].self_attn
    table = attn.variants
    assert table is not None and set(attn.optional_arguments()) <= {"past_key_values", "cache"}
    (name,) = attn.optional_arguments()
    with_cache = table.forwards[Variant(False, frozenset({name}))]
    without = table.forwards[Variant(False)]
    assert with_cache is not without
    graph = table.graphs[Variant(False, frozenset({name}))]
    updates = [n for n in graph.nodes if n.op == "call_method" and n.target == "update"]
    assert len(updates) == 1 and updates[0].args[0].target == name
