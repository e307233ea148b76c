"""``tp_plan="auto"`` on transformers models as they come, TP=2 on 2 gloo ranks.

:func:`scenarios` lists what each rank executes (in the session's one 2-rank spawn,
``tests/tp2_scenarios.py``, for ``tests/interop/test_hf_tp_plans_interop.py``). For each family it loads the model's own
checkpoint (written by ``save_pretrained``) once in a single process and once with
``device_mesh`` and ``tp_plan="auto"``, and records the parameters whose local tensors differ
from torch's own split of the single-process tensor by the same placements, the logits'
largest difference, the greedy ``generate()`` tokens of both, and the bytes this rank read.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn

import surgery

WORLD = 2
SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
FAMILIES = {  # family: (model class, config class, sizes beyond SIZES)
    "llama": ("LlamaForCausalLM", "LlamaConfig", {"num_key_value_heads": 2}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"num_key_value_heads": 2}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"num_key_value_heads": 2, "head_dim": 8}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_key_value_heads": 2, "num_local_experts": 4}),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {"num_key_value_heads": 2, "num_experts": 4, **MOE},
    ),
}
INPUT_IDS = torch.tensor([[1, 5, 9, 3, 7], [2, 4, 6, 8, 10]])


def build(family: str, *, device: str = "cpu") -> nn.Module:
    """A tiny transformers model of ``family`` (on meta under ``init_empty``)."""
    import transformers

    cls_name, config_name, sizes = FAMILIES[family]
    config = getattr(transformers, config_name)(**SIZES, **sizes, attn_implementation="sdpa")
    cls = getattr(transformers, cls_name)
    if device == "meta":
        with surgery.init_empty():
            return cls(config).eval()
    torch.manual_seed(1)
    return cls(config).eval()


def write_inputs(work: Path) -> None:
    """Each family's checkpoint, by transformers' own ``save_pretrained``."""
    for family in FAMILIES:
        build(family).save_pretrained(work / family)


def _greedy(model: nn.Module) -> list[list[int]]:
    out = model.generate(INPUT_IDS, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return out[:, INPUT_IDS.shape[1] :].tolist()


def _family(work: Path, mesh: Any, family: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, distribute_tensor

    ref = build(family, device="meta")
    assert surgery.load_checkpoint(ref, work / family).ok
    model = build(family, device="meta")
    report = surgery.load_checkpoint(model, work / family, device_mesh=mesh, tp_plan="auto")
    ref_state = ref.state_dict()
    unequal, sharded = [], 0
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            sharded += 1
            want = distribute_tensor(ref_state[key], value.device_mesh, value.placements, src_data_rank=None)
            value, want = value.to_local(), want.to_local()
        else:
            want = ref_state[key]
        if value.is_meta or not torch.equal(value, want):
            unequal.append(key)
    with torch.no_grad():
        out, expected = model(INPUT_IDS).logits, ref(INPUT_IDS).logits
        tokens, expected_tokens = _greedy(model), _greedy(ref)
    file_bytes = sum(p.stat().st_size for p in (work / family).glob("*.safetensors"))
    return {
        "ok": report.ok,
        "unequal": unequal,
        "sharded": sharded,
        "logits_max_diff": float((out - expected).abs().max()),
        "tokens": tokens,
        "expected_tokens": expected_tokens,
        "read_fraction": report.bytes_read / file_bytes,
    }


def _guarded(fn: Any, *args: Any) -> Any:
    import traceback

    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def scenarios(work: Path, mesh: Any) -> dict[str, Any]:
    return {f: functools.partial(_guarded, _family, work, mesh, f) for f in FAMILIES}
