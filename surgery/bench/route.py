r"""Benchmark: routing checkpoint keys through the Mixtral mapping (not a test).

Routes synthetic MoE keys (``model.layers.{L}.block_sparse_moe.experts.{E}.w{1,2,3}.weight``
with 128 experts, plus attention, norm and router-gate keys) through
:func:`surgery.routing.route_keys` and prints keys per second next to, measured in the same run:
the floor of a bare Python loop over the same keys (one dict insert per key), one precompiled
alternation regex search per key, and the exact per-key path (``cache=False``) on a sample.
Routing is timed with the cycle collector paused, as :func:`surgery.load_checkpoint` runs it, and
once more with the collector running.

Run it with ``python -m surgery bench route`` (``--keys N``, ``--repeat R``).
"""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..routing import route_keys
from ..transforms import WeightTransform, legacy_renamings
from .harness import parser as bench_parser
from .harness import positive_int

__all__ = ["main", "mixtral_keys", "mixtral_mapping", "run"]

_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


def mixtral_mapping() -> list[WeightTransform]:
    """The built-in catalog's Mixtral mapping, after the legacy renames (as resolution orders them)."""
    from surgery.registry import get_checkpoint_conversion_mapping

    return [*legacy_renamings(), *get_checkpoint_conversion_mapping("mixtral")]


def mixtral_keys(n_keys: int, *, num_experts: int = 128) -> list[str]:
    """``n_keys`` synthetic checkpoint keys of a Mixtral-style MoE with as many layers as needed."""
    keys = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    layer = 0
    while len(keys) < n_keys:
        p = f"model.layers.{layer}."
        keys += [f"{p}{a}.weight" for a in _ATTENTION]
        keys += [f"{p}{n}.weight" for n in _NORMS]
        keys.append(f"{p}block_sparse_moe.gate.weight")
        keys += [
            f"{p}block_sparse_moe.experts.{e}.w{w}.weight" for e in range(num_experts) for w in (1, 2, 3)
        ]
        layer += 1
    return keys[:n_keys]


def _best_interleaved(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, tuple[float, float]]:
    """Best wall-clock and best CPU seconds of each function over ``repeat`` rounds.

    Every round runs every function once (garbage collected before each), so a slow spell on
    the shared machine hits all of them alike instead of one.
    """
    best = {name: (float("inf"), float("inf")) for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            gc.collect()
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            cpu = time.process_time() - c0
            wall = time.perf_counter() - w0
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def _floor(keys: Sequence[str]) -> dict[str, None]:
    d: dict[str, None] = {}
    for k in keys:
        d[k] = None
    return d


# One precompiled alternation of the mapping's source patterns, one named group per pattern (the
# least a router needs to know which pattern matched), searched once per key: the "compile each
# list once" baseline of the issue (about 1 microsecond per key when the issue was written).
_ALTERNATION = re.compile(
    r"(?P<t0>\.block_sparse_moe\.)|(?P<t1>LayerNorm\.gamma)|(?P<t2>LayerNorm\.beta)"
    r"|(?P<t3>mlp\.experts\.(\d+)\.w1\.weight)|(?P<t4>mlp\.experts\.(\d+)\.w3\.weight)"
    r"|(?P<t5>mlp\.experts\.(\d+)\.w2\.weight)"
)


def _alternation(keys: Sequence[str]) -> None:
    search = _ALTERNATION.search
    for k in keys:
        search(k)


def run(n_keys: int = 100_000, *, repeat: int = 5, exact_sample: int = 2_000) -> dict[str, Any]:
    """Time :func:`~surgery.routing.route_keys` on ``n_keys`` Mixtral keys (best of ``repeat``).

    Every figure is measured twice: wall clock, and CPU time of this process (steadier on a
    shared machine). Per-second figures are keys per second.

    Returns:
        ``keys`` and ``groups``; for each measured thing (``route_keys`` = routing and reading
        every :class:`~surgery.routing.KeyRoute` with the cycle collector paused, as the loader
        does, ``collector_on`` = the same with the collector running, ``floor`` = a bare loop
        inserting each key in a dict, ``alternation`` = one regex search per key, ``exact`` = the
        exact per-key path on ``exact_sample`` keys) the entries ``<name>_s``,
        ``<name>_cpu_s``, ``<name>_per_s`` and ``<name>_cpu_per_s``; and ``ratio_to_floor`` /
        ``cpu_ratio_to_floor`` for ``route_keys``.
    """
    keys = mixtral_keys(n_keys)
    transforms = mixtral_mapping()
    routing = route_keys(keys, transforms)
    if routing.conflicts:
        raise RuntimeError(f"benchmark keys conflict: {routing.conflicts[:3]}")

    def route_and_read() -> None:
        routes = route_keys(keys, transforms).routes
        for k in keys:
            routes[k]

    def paused(fn: Callable[[], Any]) -> Callable[[], None]:
        def run_paused() -> None:
            gc.disable()
            try:
                fn()
            finally:
                gc.enable()

        return run_paused

    sample = keys[:exact_sample]
    best = _best_interleaved(
        {
            "route_keys": paused(route_and_read),
            "collector_on": route_and_read,
            "floor": paused(lambda: _floor(keys)),
            "alternation": paused(lambda: _alternation(keys)),
        },
        repeat,
    )
    exact = paused(lambda: route_keys(sample, transforms, cache=False))
    best["exact"] = _best_interleaved({"exact": exact}, 1)["exact"]
    timed = {name: (times, len(sample) if name == "exact" else len(keys)) for name, times in best.items()}
    out: dict[str, Any] = {"keys": len(keys), "groups": len(routing.groups)}
    for name, ((wall, cpu), n) in timed.items():
        out[f"{name}_s"], out[f"{name}_cpu_s"] = wall, cpu
        out[f"{name}_per_s"], out[f"{name}_cpu_per_s"] = n / wall, n / cpu
    out["ratio_to_floor"] = out["route_keys_s"] / out["floor_s"]
    out["cpu_ratio_to_floor"] = out["route_keys_cpu_s"] / out["floor_cpu_s"]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: print the numbers of :func:`run`."""
    parser = bench_parser("route", __doc__)
    parser.add_argument(
        "--keys", type=positive_int, default=100_000, help="number of checkpoint keys (default 100000)"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=5, help="timed runs; the best counts (default 5)"
    )
    args = parser.parse_args(argv)
    r = run(args.keys, repeat=args.repeat)
    print(f"Mixtral mapping: {r['keys']:,} keys -> {r['groups']:,} target groups, best of {args.repeat}")
    print(f"{'':32}{'keys/s (wall)':>16}{'keys/s (CPU)':>16}{'ns/key (CPU)':>14}")
    rows = [
        ("route_keys + read every route", "route_keys"),
        ("  the same, collector running", "collector_on"),
        ("floor: loop + dict insert", "floor"),
        ("one alternation search per key", "alternation"),
        ("exact per-key path (sample)", "exact"),
    ]
    for label, name in rows:
        ns = 1e9 / r[f"{name}_cpu_per_s"]
        print(f"{label:32}{r[f'{name}_per_s']:>16,.0f}{r[f'{name}_cpu_per_s']:>16,.0f}{ns:>14,.0f}")
    print(f"route_keys / floor: {r['ratio_to_floor']:.1f}x wall, {r['cpu_ratio_to_floor']:.1f}x CPU")


if __name__ == "__main__":
    main()
