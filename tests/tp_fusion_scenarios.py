"""Fusions under tensor parallelism, run by every rank of a real 2-process gloo group.

:data:`SCENARIOS` are what each rank executes (in the session's one 2-rank spawn,
``tests/tp2_scenarios.py``, for ``tests/test_parallel_fusion.py``, and for
``tests/interop/test_parallel_fusion_interop.py`` transformers' Llama); each returns the rank's
facts and the tests assert on them. The checkpoints are
written by the test process beforehand (:func:`write_checkpoints`), in the unfused layout.

A fused ``gate_up_proj`` (or ``qkv_proj``) splits its output by its parts' widths; under
``packed_colwise`` each rank's output holds only its share of every part, so the split must take
the local sizes (issue 25: it took the global ones and the first forward raised
``split_with_sizes ... got split_sizes=[48, 48]``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.examples import decoder
from surgery.examples.layers import ATTENTION_TP_PLAN

INPUT_IDS = torch.tensor([[1, 5, 9, 3, 7], [2, 4, 6, 8, 10]])
GQA = decoder.ExampleDecoderConfig()  # 4 query heads, 2 key/value heads: q/k/v stay unfused
MHA = decoder.ExampleDecoderConfig(num_key_value_heads=4)  # q, k, v of equal size: qkv can be packed
MLP_PLAN = {"model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise"}
LLAMA_SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=128,
)


def _qkv_plan() -> dict[str, Any]:
    from surgery.parallel import PackedColwiseParallel

    return {
        "model.embed_tokens": "rowwise",
        "model.layers.*.self_attn.qkv_proj": PackedColwiseParallel(split_factor=3),
        "model.layers.*.self_attn.o_proj": "rowwise",
        **MLP_PLAN,
        "lm_head": "colwise_gather",
    }


def _llama(seed: int) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**LLAMA_SIZES, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).eval()


def write_checkpoints(work: Path, scenarios: list[str]) -> None:
    """The unfused checkpoints the scenarios read (the llama one saved by transformers itself)."""
    if any(s.startswith("decoder") for s in scenarios):
        write_checkpoint(decoder.build_decoder_model(GQA, seed=1).state_dict(), work / "decoder-gqa")
        write_checkpoint(decoder.build_decoder_model(MHA, seed=2).state_dict(), work / "decoder-mha")
    if "llama" in scenarios:
        _llama(seed=3).save_pretrained(work / "llama")


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids, use_cache=False) if hasattr(model, "generation_config") else model(ids)
    return getattr(out, "logits", out)


def _scenario(
    work: Path,
    rank: int,
    mesh: Any,
    *,
    ckpt: Path,
    build: Callable[[], nn.Module],
    fusion_config: dict[str, Any],
    tp_plan: dict[str, Any],
    fused_paths: tuple[str, ...],
) -> dict[str, Any]:
    """Load fused and sharded, run, compare with one process, save back; record the facts."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    unfused = build()
    assert surgery.load_checkpoint(unfused, ckpt).ok
    single = build()  # fused on one process: the parameters the sharded model must hold
    assert surgery.load_checkpoint(single, ckpt, fusion_config=fusion_config).ok
    model = build()
    report = surgery.load_checkpoint(
        model, ckpt, fusion_config=fusion_config, tp_plan=tp_plan, device_mesh=mesh
    )
    facts: dict[str, Any] = {"ok": report.ok, "report": str(report)}
    want = single.state_dict()
    facts["unequal"] = [
        k
        for k, v in model.state_dict().items()
        if not torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, want[k])
    ]
    facts["fused"] = {}
    for path in fused_paths:
        weight = model.get_submodule(path).weight
        facts["fused"][path] = {
            "placements": [repr(p) for p in weight.placements] if isinstance(weight, DTensor) else None,
            "local_rows": weight.to_local().shape[0] if isinstance(weight, DTensor) else None,
        }
    with torch.no_grad():
        got, expected = _logits(model, INPUT_IDS), _logits(unfused, INPUT_IDS)
    facts["output_shape"] = list(got.shape)
    facts["max_abs_diff"] = float((got - expected).abs().max())
    out = work / f"{ckpt.name}-saved-{'-'.join(sorted(fusion_config))}"
    surgery.save_checkpoint(model, out)
    dist.barrier()
    if rank == 0:
        written, source = out / "model.safetensors", ckpt / "model.safetensors"
        facts["saved_identical"] = written.read_bytes() == source.read_bytes()
    return facts


def _decoder(config: decoder.ExampleDecoderConfig) -> Callable[[], nn.Module]:
    return lambda: decoder.build_decoder_model(config, seed=None, device="meta")


def decoder_gate_up(work: Path, rank: int, mesh: Any) -> dict[str, Any]:
    """The example decoder, ``gate_up`` fused and ``packed_colwise`` (q/k/v colwise, unfused: GQA)."""
    return _scenario(
        work,
        rank,
        mesh,
        ckpt=work / "decoder-gqa",
        build=_decoder(GQA),
        fusion_config={"gate_up": True},
        tp_plan={**ATTENTION_TP_PLAN, **MLP_PLAN},
        fused_paths=("model.layers.0.mlp.gate_up_proj", "model.layers.1.mlp.gate_up_proj"),
    )


def decoder_qkv_gate_up(work: Path, rank: int, mesh: Any) -> dict[str, Any]:
    """The example decoder with equal q/k/v: both fusions, ``qkv_proj`` packed in three parts."""
    return _scenario(
        work,
        rank,
        mesh,
        ckpt=work / "decoder-mha",
        build=_decoder(MHA),
        fusion_config={"qkv": True, "gate_up": True},
        tp_plan=_qkv_plan(),
        fused_paths=("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"),
    )


def llama(work: Path, rank: int, mesh: Any) -> dict[str, Any]:
    """transformers' Llama (sdpa), both fusions, from the file ``save_pretrained`` wrote."""
    return _scenario(
        work,
        rank,
        mesh,
        ckpt=work / "llama",
        build=lambda: _llama(seed=0),
        fusion_config={"qkv": True, "gate_up": True},
        tp_plan=_qkv_plan(),
        fused_paths=("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"),
    )


def split_sizes(work: Path, rank: int, mesh: Any) -> dict[str, Any]:
    """``local_split_sizes`` of a (96, 32) weight in parts [48, 48] under each placement."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from surgery.parallel import local_split_sizes, strided_shard

    placements = {"packed": strided_shard(0, 2), "rowwise": Shard(1), "replicate": Replicate()}
    out: dict[str, Any] = {}
    for name, placement in placements.items():
        weight = distribute_tensor(torch.zeros(96, 32), mesh, [placement])
        out[name] = local_split_sizes(weight, [48, 48])
    refused = {
        "colwise": (Shard(0), [48, 48]),  # rank 0 holds all of the gate rows and none of the up rows
        "packed_in_two_of_three": (strided_shard(0, 2), [32, 32, 32]),  # a qkv needs split_factor=3
        "wrong_sum": (Shard(0), [48, 40]),
    }
    for name, (placement, sizes) in refused.items():
        try:
            out[name] = local_split_sizes(distribute_tensor(torch.zeros(96, 32), mesh, [placement]), sizes)
        except surgery.ConfigurationError as exc:
            out[name] = str(exc)
    return out


SCENARIOS: dict[str, Callable[[Path, int, Any], dict[str, Any]]] = {
    "split_sizes": split_sizes,
    "decoder_gate_up": decoder_gate_up,
    "decoder_qkv_gate_up": decoder_qkv_gate_up,
    "llama": llama,
}
