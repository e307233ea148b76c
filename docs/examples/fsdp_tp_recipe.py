"""The torchtitan-style recipe: meta model -> TP + FSDP2 -> load -> one train step -> save.

Run on 4 CPU processes (gloo):

    torchrun --nproc-per-node 4 docs/examples/fsdp_tp_recipe.py CKPT_DIR OUT_DIR

where CKPT_DIR holds the dense example's original-layout checkpoint (rank 0 writes one there from
seeded weights when the directory does not exist); ``tests/test_fsdp_loading.py`` runs
:func:`recipe` on 4 spawned ranks.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import surgery
from surgery.examples.dense import ExampleDenseConfig, build_dense_model

__all__ = ["CONFIG", "recipe"]

CONFIG = ExampleDenseConfig(num_attention_heads=4, num_key_value_heads=4)


def recipe(ckpt: str, out: str) -> dict[str, object]:
    """Every rank runs this with the process group initialized; returns what it saw."""
    # 1. The mesh: FSDP2 over dp_shard, tensor parallelism over tp (torchtitan's dim names).
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp_shard", "tp"))
    # 2. The model on meta: no memory for weights yet.
    model = build_dense_model(CONFIG, device="meta")
    # 3. TP on mesh["tp"], fully_shard per decoder layer and at the root on mesh["dp_shard"],
    #    then each rank reads only its shards of the checkpoint. By hand this is
    #    surgery.parallel.parallelize(model, model.tp_plan, mesh["tp"]); fully_shard(layer,
    #    mesh=mesh["dp_shard"]) for each layer; fully_shard(model, mesh=mesh["dp_shard"]);
    #    surgery.load_checkpoint(model, ckpt).
    report = surgery.load_checkpoint(model, ckpt, device_mesh=mesh, tp_plan="auto", fsdp=True, strict=True)
    # 4. One training step: FSDP2 all-gathers each layer in the forward, reduce-scatters grads.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    input_ids = torch.randint(0, CONFIG.vocab_size, (2, 6))
    logits = model(input_ids)
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    loss = logits.float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    # 5. Save in the checkpoint's original layout: every rank calls it, each writes its files.
    saved = surgery.save_checkpoint(model, out)
    return {"bytes_read": report.bytes_read, "loss": loss.item(), "files": len(saved), "model": model}


def _example_checkpoint(path: str) -> None:
    """The dense example's original layout, from seeded weights (what a hub checkpoint would be)."""
    from pathlib import Path

    from surgery.checkpoint import write_checkpoint
    from surgery.examples.dense import original_state_dict

    if dist.get_rank() == 0 and not Path(path).exists():
        torch.manual_seed(0)
        write_checkpoint(original_state_dict(build_dense_model(CONFIG)), path)
    dist.barrier()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    _example_checkpoint(sys.argv[1])
    facts = recipe(sys.argv[1], sys.argv[2])
    print(f"rank {dist.get_rank()}: loss {facts['loss']:.4f}, read {facts['bytes_read']} bytes")
    dist.destroy_process_group()
