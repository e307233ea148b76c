r"""Benchmark: routing checkpoint keys through the Mixtral mapping (not a test).

Routes synthetic MoE keys (``model.layers.{L}.block_sparse_moe.experts.{E}.w{1,2,3}.weight``
plus attention, norm and router-gate keys) through :func:`surgery.routing.route_keys` and prints
keys per second next to the floor of a bare Python loop over the same keys (one dict insert per
key), measured in the same run, and the exact per-key path on a sample for scale.

Run it with ``python -m surgery.benchmarks.route`` (``--keys N``, ``--repeat R``).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

from .. import ops
from ..routing import _route_keys_exact, route_keys
from ..transforms import WeightConverter, WeightRenaming, WeightTransform, legacy_renamings

__all__ = ["main", "mixtral_keys", "mixtral_mapping", "run"]

_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


def mixtral_mapping() -> list[WeightTransform]:
    """The Mixtral conversion mapping (with the built-in legacy renames)."""
    return [
        WeightRenaming(r"\.block_sparse_moe\.", ".mlp."),
        *legacy_renamings(),
        WeightConverter(
            ["mlp.experts.*.w1.weight", "mlp.experts.*.w3.weight"],
            "mlp.experts.gate_up_proj",
            [ops.MergeModulelist(0), ops.Concatenate(1)],
        ),
        WeightConverter("mlp.experts.*.w2.weight", "mlp.experts.down_proj", [ops.MergeModulelist(0)]),
    ]


def mixtral_keys(n_keys: int, *, num_experts: int = 128) -> list[str]:
    """``n_keys`` synthetic checkpoint keys of a Mixtral-style MoE with as many layers as needed."""
    keys = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    layer = 0
    while len(keys) < n_keys:
        p = f"model.layers.{layer}."
        keys += [f"{p}{a}.weight" for a in _ATTENTION]
        keys += [f"{p}{n}.weight" for n in _NORMS]
        keys.append(f"{p}block_sparse_moe.gate.weight")
        keys += [f"{p}block_sparse_moe.experts.{e}.w{w}.weight" for e in range(num_experts) for w in (1, 2, 3)]
        layer += 1
    return keys[:n_keys]


def _best(fn: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _floor(keys: Sequence[str]) -> dict[str, None]:
    d: dict[str, None] = {}
    for k in keys:
        d[k] = None
    return d


def run(n_keys: int = 100_000, *, repeat: int = 5, exact_sample: int = 2_000) -> dict[str, Any]:
    """Time :func:`~surgery.routing.route_keys` on ``n_keys`` Mixtral keys (best of ``repeat``).

    Returns:
        ``keys``, ``groups``, seconds and keys/second for ``route_keys``, for ``route_keys`` plus
        reading every :class:`~surgery.routing.KeyRoute`, for the floor loop and for the exact
        path (on ``exact_sample`` keys), and the ratios to the floor.
    """
    keys = mixtral_keys(n_keys)
    transforms = mixtral_mapping()
    routing = route_keys(keys, transforms)
    if routing.conflicts:
        raise RuntimeError(f"benchmark keys conflict: {routing.conflicts[:3]}")

    def with_routes() -> None:
        r = route_keys(keys, transforms)
        for v in r.routes.values():
            del v

    t_route = _best(lambda: route_keys(keys, transforms), repeat)
    t_full = _best(with_routes, repeat)
    t_floor = _best(lambda: _floor(keys), repeat)
    sample = keys[:exact_sample]
    t_exact = _best(lambda: _route_keys_exact(sample, transforms), 1) * len(keys) / max(len(sample), 1)
    return {
        "keys": len(keys),
        "groups": len(routing.groups),
        "route_keys_s": t_route,
        "route_keys_per_s": len(keys) / t_route,
        "with_routes_s": t_full,
        "with_routes_per_s": len(keys) / t_full,
        "floor_s": t_floor,
        "floor_per_s": len(keys) / t_floor,
        "exact_per_s": len(keys) / t_exact,
        "ratio_to_floor": t_route / t_floor,
        "ratio_with_routes_to_floor": t_full / t_floor,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: print the numbers of :func:`run`."""
    parser = argparse.ArgumentParser(prog="python -m surgery.benchmarks.route", description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=100_000, help="number of checkpoint keys (default 100000)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs; the best counts (default 5)")
    args = parser.parse_args(argv)
    r = run(args.keys, repeat=args.repeat)
    print(f"Mixtral mapping, {r['keys']:,} keys -> {r['groups']:,} target groups (best of {args.repeat})")
    print(f"  route_keys                    {r['route_keys_per_s']:>13,.0f} keys/s  ({r['route_keys_s'] * 1e3:.1f} ms)")
    print(f"  route_keys + every KeyRoute   {r['with_routes_per_s']:>13,.0f} keys/s  ({r['with_routes_s'] * 1e3:.1f} ms)")
    print(f"  floor: bare loop, dict insert {r['floor_per_s']:>13,.0f} keys/s  ({r['floor_s'] * 1e3:.1f} ms)")
    print(f"  exact per-key path (sampled)  {r['exact_per_s']:>13,.0f} keys/s")
    print(f"  route_keys / floor            {r['ratio_to_floor']:>13.1f}x")
    print(f"  with KeyRoutes / floor        {r['ratio_with_routes_to_floor']:>13.1f}x")


if __name__ == "__main__":
    main()
