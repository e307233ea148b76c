"""FP4 checkpoints loaded expert- and tensor-parallel, run by every rank of a 2-process gloo group.

:func:`write_mxfp4` writes the gpt-oss fixture (a tiny ``GptOssForCausalLM`` whose experts are
stored as gpt-oss ships them: ``*_blocks``/``*_scales``), shared with
``tests/test_quantization_mxfp4.py``; :func:`write_inputs` writes it and the compressed-tensors
NVFP4 and MXFP4 checkpoints (``tests/ct_fp4_reference.py``). :func:`scenarios` lists what each rank
executes (in the session's one 2-rank spawn, ``tests/tp2_scenarios.py``): the gpt-oss scenarios parallelize the experts of a fresh model with ``distribute_tensor``
(expert parallel: ``Shard(0)``; tensor parallel: the model's last dims), the compressed-tensors
ones load with a ``tp_plan`` (``colwise``: rows; ``rowwise``: columns, in whole groups); each
records what the rank read, what its local shards hold and whether the parallel save wrote the
files back unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from ct_fp4_reference import SHAPES, reference_weights, write_fp4
from ct_reference import Net
from torch import nn
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import surgery
from surgery.checkpoint import open_checkpoint, write_checkpoint
from surgery.quantization import quantizer_by_name

QCONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    "quant_method": "mxfp4",
}
PROJS = ("gate_up_proj", "down_proj")
EXPERTS = "model.layers.{}.mlp.experts"


def tiny_config() -> GptOssConfig:
    return GptOssConfig(
        vocab_size=64,
        hidden_size=64,  # H: two 32-value blocks per gate_up row
        intermediate_size=96,  # I: three blocks per down_proj row; 2I = 192 gate_up rows
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    )


def tiny_model(dtype: torch.dtype = torch.float32) -> GptOssForCausalLM:
    torch.manual_seed(0)
    return GptOssForCausalLM(tiny_config()).to(dtype).eval()


def write_mxfp4(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A gpt-oss MXFP4 checkpoint of :func:`tiny_model`: experts as random blocks and scales."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, v in tiny_model().state_dict().items():
        if k.rpartition(".")[2] in PROJS:
            e, a, b = v.shape  # [E, K, R] in the model: stored [E, R, K/32, 16]
            state[k + "_blocks"] = torch.randint(0, 256, (e, b, a // 32, 16), dtype=torch.uint8, generator=g)
            state[k + "_scales"] = torch.randint(118, 132, (e, b, a // 32), dtype=torch.uint8, generator=g)
        else:  # bf16 as gpt-oss ships them; random, so a bias loaded as zeros or misplaced shows
            state[k] = (torch.randn(v.shape, generator=g) * 0.1).to(torch.bfloat16)
    write_checkpoint(state, path)
    config = {
        **tiny_config().to_dict(),
        "architectures": ["GptOssForCausalLM"],
        "quantization_config": QCONFIG,
    }
    (path / "config.json").write_text(json.dumps(config))
    return state


def oracle(path: Path) -> dict[str, torch.Tensor]:
    """Every expert weight of ``path`` decoded by transformers, float32, by model key."""
    with open_checkpoint(path) as r:
        return {
            k.removesuffix("_blocks"): convert_moe_packed_tensors(
                r.get_tensor(k), r.get_tensor(k.replace("_blocks", "_scales")), dtype=torch.float32
            )
            for k in r.keys()  # noqa: SIM118 (the reader is not a dict)
            if k.endswith("_blocks")
        }


# placements per expert parameter, by scenario (dims of the model's [E, H, 2I] / [E, I, H])
LAYOUTS = {
    "ep": {"gate_up_proj": 0, "gate_up_proj_bias": 0, "down_proj": 0, "down_proj_bias": 0},
    "tp": {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 2},  # rows of the stored blocks
    "misaligned": {"down_proj": 1},  # I = 96: halves of 48 cut a 32-value block
}


def _parallel_model(mesh: Any, layout: dict[str, int]) -> nn.Module:
    from torch.distributed.tensor import Shard, distribute_tensor

    model = tiny_model()
    for i in range(tiny_config().num_hidden_layers):
        experts = model.get_submodule(EXPERTS.format(i))
        for name, dim in layout.items():
            param = experts.get_parameter(name)
            experts.register_parameter(
                name, nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(dim)]), requires_grad=False)
            )
    return model


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.suffix in (".safetensors", ".json")}


def _scenario(work: Path, rank: int, mesh: Any, name: str) -> dict[str, Any]:
    import torch.distributed as dist

    ckpt = work / "gptoss-mxfp4"
    layout = LAYOUTS[name]
    model = _parallel_model(mesh, layout)
    report = surgery.load_checkpoint(model, ckpt, quantizer=quantizer_by_name("auto", ckpt))
    facts: dict[str, Any] = {"ok": report.ok, "errors": [f.message for f in report.conversion_errors]}
    if not report.ok:
        return facts
    single = surgery.load_checkpoint(tiny_model(), ckpt, quantizer=quantizer_by_name("auto", ckpt))
    full = oracle(ckpt)
    with open_checkpoint(ckpt) as r:
        infos = {k: r.info(k) for k in r.keys()}  # noqa: SIM118
    facts["bytes_read"], facts["single_bytes"] = report.bytes_read, single.bytes_read
    facts["sharded_blocks_bytes"] = sum(
        infos[f"{EXPERTS.format(i)}.{p}_blocks"].nbytes
        for i in range(tiny_config().num_hidden_layers)
        for p in PROJS
        if p in layout
    )
    facts["sharded_scales_bytes"] = sum(
        infos[f"{EXPERTS.format(i)}.{p}_scales"].nbytes
        for i in range(tiny_config().num_hidden_layers)
        for p in PROJS
        if p in layout
    )
    facts["sharded_bias_bytes"] = sum(
        infos[f"{EXPERTS.format(i)}.{p}"].nbytes
        for i in range(tiny_config().num_hidden_layers)
        for p in layout
        if p.endswith("_bias")
    )
    equal = {}
    for key, whole in full.items():
        local = model.get_parameter(key).to_local()
        dim = layout.get(key.rpartition(".")[2])
        want = whole if dim is None else whole.chunk(2, dim)[rank]
        equal[key] = torch.equal(local.view(torch.int32), want.contiguous().view(torch.int32))
    facts["local_equals_slice_of_full_decode"] = equal
    facts["decoded_keys"] = sorted(report.decoded_keys)
    out = work / f"saved-{name}"
    files = surgery.save_checkpoint(model, out)
    facts["requantized"] = list(files.requantized)
    dist.barrier()
    if rank == 0:
        facts["saved_identical"] = _files(out)["model.safetensors"] == _files(ckpt)["model.safetensors"]
        saved_config = json.loads((out / "config.json").read_text())
        facts["saved_quantization_config"] = saved_config.get("quantization_config")
    return facts


def write_inputs(work: Path) -> None:
    write_mxfp4(work / "gptoss-mxfp4")
    for preset in SHAPES:
        write_fp4(work / f"ct-{preset}", preset)


CT_PLANS = {  # a: [32, 64]; b: 48 (NVFP4) or 96 (MXFP4) columns, halves of 24 or 48 cut a group
    "rows": {"a": "colwise"},
    "columns": {"a": "rowwise"},
    "misaligned": {"b": "rowwise"},
}


def _ct_scenario(work: Path, rank: int, mesh: Any, preset: str, plan_name: str) -> dict[str, Any]:
    import torch.distributed as dist

    ckpt = work / f"ct-{preset}"
    plan = CT_PLANS[plan_name]
    model = Net(SHAPES[preset], dtype=torch.float32)
    report = surgery.load_checkpoint(
        model, ckpt, tp_plan=plan, device_mesh=mesh, quantizer=quantizer_by_name("auto", ckpt)
    )
    facts: dict[str, Any] = {"ok": report.ok, "errors": [f.message for f in report.conversion_errors]}
    if not report.ok:
        return facts
    single = surgery.load_checkpoint(
        Net(SHAPES[preset], dtype=torch.float32), ckpt, quantizer=quantizer_by_name("auto", ckpt)
    )
    with open_checkpoint(ckpt) as r:
        state = {k: r.get_tensor(k) for k in r.keys()}  # noqa: SIM118
    full = reference_weights(ckpt, state)["a.weight"]
    dim = 0 if plan["a"] == "colwise" else 1
    local = model.a.weight.to_local()
    want = full.chunk(2, dim)[rank].contiguous()
    facts["local_equals_slice_of_full_decode"] = torch.equal(local.view(torch.int32), want.view(torch.int32))
    facts["bytes_read"], facts["single_bytes"] = report.bytes_read, single.bytes_read
    facts["half_packed_bytes"] = state["a.weight_packed"].numel() // 2
    facts["half_scale_bytes"] = state["a.weight_scale"].nbytes // 2  # its rows, or its whole groups
    out = work / f"saved-ct-{preset}-{plan_name}"
    files = surgery.save_checkpoint(model, out)
    facts["requantized"] = list(files.requantized)
    dist.barrier()
    if rank == 0:
        facts["saved_identical"] = _files(out)["model.safetensors"] == _files(ckpt)["model.safetensors"]
        facts["saved_config_equal"] = (
            json.loads((out / "config.json").read_text())["quantization_config"]
            == json.loads((ckpt / "config.json").read_text())["quantization_config"]
        )
    return facts


def scenarios(work: Path, rank: int, mesh: Any) -> dict[str, Any]:
    out: dict[str, Any] = {name: (lambda n=name: _scenario(work, rank, mesh, n)) for name in LAYOUTS}
    for preset in SHAPES:
        for plan_name in CT_PLANS:
            out[f"ct-{preset}-{plan_name}"] = lambda p=preset, n=plan_name: _ct_scenario(
                work, rank, mesh, p, n
            )
    return out
