r"""Benchmark: an expert-parallel MoE layer, all-reduce (what ``expert_parallel`` runs) against an
all-to-all token dispatch, on gloo CPU ranks (not a test).

Both compute one MoE layer of ``E`` experts over ``--ranks`` ranks (``E / ranks`` experts each)
for the same ``ranks * T`` tokens and top-``k`` routing:

* ``all-reduce`` (:class:`~surgery.parallel.styles.ExpertParallel`): every rank holds all the
  tokens (as tensor-parallel ranks do), runs its experts on the tokens routed to them, and the
  partial outputs are summed: one all-reduce of ``ranks * T x H`` per layer.
* ``all-to-all``: every rank holds its own ``T`` tokens (the batch is split over the ranks, as
  DeepSpeed-MoE and torchtitan dispatch); each token's ``k`` copies go to the ranks that own
  their experts (``all_to_all_single``, sizes first), are computed there and come back the same
  way: two exchanges of ``T * k x H`` per rank per layer, plus the size exchange.

It prints the best wall time per layer of each, the floats each rank sends, and the largest
difference between the two outputs (they compute the same function). Run it with
``python -m surgery bench moe_dispatch``.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .harness import end_rank, positive_int
from .harness import parser as bench_parser

__all__ = ["main", "run"]


def _experts(spec: dict[str, Any]) -> Any:
    from ..examples.moe import ExampleMoEConfig, ExampleMoEExperts

    torch.manual_seed(0)
    cfg = ExampleMoEConfig(
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_local_experts=spec["experts"],
        num_experts_per_tok=spec["top_k"],
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    return ExampleMoEExperts(cfg)


def _routing(spec: dict[str, Any], tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, spec["hidden"], generator=g)
    logits = torch.randn(tokens, spec["experts"], generator=g)
    w, idx = logits.softmax(-1).topk(spec["top_k"], dim=-1)
    return x, idx, w / w.sum(-1, keepdim=True)


def _dispatched(module: Any, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, group: Any) -> torch.Tensor:
    """One MoE layer by all-to-all: this rank's tokens out to the experts' owners and back."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    per = module.num_experts // n
    flat = idx.reshape(-1)  # (T * k,) token copies
    owner = flat // per
    order = torch.argsort(owner, stable=True)
    send_counts = torch.bincount(owner, minlength=n)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    rows = x.repeat_interleave(idx.shape[1], dim=0)[order]
    expert = (flat[order] % per).to(torch.float32)  # sent beside the rows, as one extra column
    payload = torch.cat([rows, expert[:, None]], dim=1)
    received = payload.new_empty(int(recv_counts.sum()), payload.shape[1])
    dist.all_to_all_single(received, payload, recv_counts.tolist(), send_counts.tolist(), group=group)
    local = module.gate_up_proj.to_local(), module.down_proj.to_local()
    out = torch.zeros(received.shape[0], x.shape[1])
    ids = received[:, -1].long()
    for e in range(per):
        sel = torch.nonzero(ids == e).flatten()
        if sel.numel():
            gate, up = torch.nn.functional.linear(received[sel, :-1], local[0][e]).chunk(2, dim=-1)
            out[sel] = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, local[1][e])
    back = out.new_empty(rows.shape[0], x.shape[1])
    dist.all_to_all_single(back, out, send_counts.tolist(), recv_counts.tolist(), group=group)
    copies = torch.empty_like(back)
    copies[order] = back
    return (copies.view(x.shape[0], idx.shape[1], -1) * w[..., None]).sum(1)


def _rank(rank: int, world: int, spec: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from ..parallel.styles import ExpertParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    module = parallelize_module(_experts(spec), mesh, ExpertParallel())
    x, idx, w = _routing(spec, world * spec["tokens"])
    mine = slice(rank * spec["tokens"], (rank + 1) * spec["tokens"])
    times: dict[str, list[float]] = {"all_reduce": [], "all_to_all": []}
    with torch.no_grad():
        for _ in range(spec["repeat"]):
            for name in times:
                dist.barrier()
                start = time.perf_counter()
                if name == "all_reduce":
                    reduced = module(x, idx, w)
                else:
                    dispatched = _dispatched(module, x[mine], idx[mine], w[mine], mesh.get_group())
                dist.barrier()
                times[name].append(time.perf_counter() - start)
    facts = {
        "best": {k: min(v) for k, v in times.items()},
        "max_diff": float((reduced[mine] - dispatched).abs().max()),
    }
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(facts))
    dist.barrier()
    dist.destroy_process_group()
    end_rank()


def run(
    *, ranks: int, tokens: int, experts: int, hidden: int, intermediate: int, top_k: int, repeat: int
) -> dict:
    """Spawn ``ranks`` gloo processes; return each variant's slowest-rank best time and the difference."""
    import torch.multiprocessing as mp

    spec = dict(
        tokens=tokens, experts=experts, hidden=hidden, intermediate=intermediate, top_k=top_k, repeat=repeat
    )
    with tempfile.TemporaryDirectory(prefix="surgery-bench-moe-") as tmp:
        run_spec = {**spec, "store": f"{tmp}/store", "out": tmp}
        mp.spawn(_rank, args=(ranks, run_spec), nprocs=ranks, join=True)
        facts = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)]
    return {
        "best": {k: max(f["best"][k] for f in facts) for k in facts[0]["best"]},
        "max_diff": max(f["max_diff"] for f in facts),
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: print the two variants side by side."""
    parser = bench_parser("moe_dispatch", __doc__)
    parser.add_argument("--ranks", type=positive_int, default=4, help="expert-parallel ranks (4)")
    parser.add_argument("--tokens", type=positive_int, default=512, help="tokens per rank (512)")
    parser.add_argument("--experts", type=positive_int, default=16, help="experts (16)")
    parser.add_argument("--hidden", type=positive_int, default=512, help="hidden size (512)")
    parser.add_argument(
        "--intermediate", type=positive_int, default=1024, help="expert intermediate size (1024)"
    )
    parser.add_argument("--top-k", type=positive_int, default=2, help="experts per token (2)")
    parser.add_argument("--repeat", type=positive_int, default=5, help="timed runs; the best counts (5)")
    a = parser.parse_args(argv)
    r = run(
        ranks=a.ranks,
        tokens=a.tokens,
        experts=a.experts,
        hidden=a.hidden,
        intermediate=a.intermediate,
        top_k=a.top_k,
        repeat=a.repeat,
    )
    n, t, h, k = a.ranks, a.tokens, a.hidden, a.top_k
    reduce_floats = 2 * (n - 1) / n * n * t * h  # a ring all-reduce of (n*T, H): what each rank sends
    a2a_floats = 2 * (n - 1) / n * t * k * (h + 1)  # out and back, the rows that leave the rank
    print(
        f"One MoE layer: {a.experts} experts over {n} gloo ranks, {t} tokens per rank, top-{k}, "
        f"hidden {h}, intermediate {a.intermediate}; best of {a.repeat}, slowest rank"
    )
    print(f"{'variant':<52}{'ms / layer':>12}{'floats sent / rank':>20}")
    print(
        f"{'all-reduce (expert_parallel; tokens on every rank)':<52}{1e3 * r['best']['all_reduce']:>12.2f}"
        f"{reduce_floats:>20,.0f}"
    )
    print(
        f"{'all-to-all dispatch (tokens split over ranks)':<52}{1e3 * r['best']['all_to_all']:>12.2f}"
        f"{a2a_floats:>20,.0f}"
    )
    print(f"[info] largest difference between the two outputs: {r['max_diff']:.2e}")


if __name__ == "__main__":
    main()
