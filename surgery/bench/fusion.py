"""Benchmark: the ``patch_embeddings`` fusion and the sibling-projection fusions (not a test).

Part 1 times the patch-embedding forward on ``--patches`` flattened patches (default 4096, the
Qwen2-VL geometry ``C=3, T=2, P=14`` and ``--embed-dim`` 1280) in float32 and bfloat16:
the original ``view -> Conv3d -> view`` module, the fused ``view -> Linear -> view`` module, and
a bare ``F.linear`` of the same shapes (the floor). Ratios are against the floor, measured in the
same run.

Part 2 times :func:`~surgery.preview_fusions` and :func:`~surgery.apply_fusions` on a
``--depth`` (default 32) block example tower.

Part 3 (``qkv`` + ``gate_up``) builds one Llama-style decoder layer (``--hidden`` 2048, GQA 16/4
heads, ``--intermediate`` 5632) and times, for batch x seq of 1x1 (decode), 1x128 and 4x512, in
float32 and bfloat16: the projections unfused (five ``nn.Linear`` calls), fused (two calls and
their splits) and the floor (two bare ``F.linear`` of the fused weights), and the whole layer
forward unfused and fused. Then preview and apply on a 32-layer decoder built on ``meta``.

Part 4 (``--part generate``, not part of ``all``; needs transformers) times ``generate()`` of a
tiny and a ~100M transformers Llama, unfused and fused, in float32 and bfloat16
(:mod:`surgery.bench.generation`).

Run it with ``python -m surgery.bench.fusion`` (``--device cuda`` on a GPU machine;
``--part patch|siblings|generate`` runs one part).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..examples.decoder import ExampleDecoderConfig, GatedMLP, build_decoder_model
from ..examples.layers import DecoderLayer
from ..examples.vision import build_vision_tower, example_pixel_values
from ..fusion import apply_fusions, preview_fusions
from .generation import run_generate
from .harness import median_per_call, parser, positive_int

__all__ = ["main", "run", "run_siblings"]

_CONFIG = {"patch_embeddings": True}
_SIBLINGS = {"qkv": True, "gate_up": True}
_SHAPES = ((1, 1), (1, 128), (4, 512))


def _forward(
    dtype: torch.dtype, *, patches: int, embed_dim: int, device: str, min_run_time: float, rounds: int
) -> dict[str, float]:
    tower = build_vision_tower(depth=0, embed_dim=embed_dim, num_heads=1, dtype=dtype, device=device)
    unfused = tower.patch_embed
    apply_fusions(tower, _CONFIG, strict=True)
    fused = tower.patch_embed
    x = example_pixel_values(tower.config, num_patches=patches, dtype=dtype, device=device)
    linear = fused.get_submodule("linear_proj")
    weight, bias = linear.weight, linear.bias
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), unfused(x), rtol=2e-2, atol=2e-2 * unfused(x).abs().max().item())
        return median_per_call(
            {
                "unfused": lambda: unfused(x),
                "fused": lambda: fused(x),
                "floor": lambda: F.linear(x, weight, bias),  # type: ignore[arg-type]
            },
            device=device,
            rounds=rounds,
            min_run_time=min_run_time,
        )


def _surgery_times(*, depth: int, embed_dim: int, repeat: int) -> dict[str, float]:
    base = build_vision_tower(depth=depth, embed_dim=embed_dim, num_heads=max(1, embed_dim // 64))
    preview, apply = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        preview_fusions(base, _CONFIG, strict=True)
        preview.append(time.perf_counter() - start)
        model = copy.deepcopy(base)
        start = time.perf_counter()
        apply_fusions(model, _CONFIG, strict=True)
        apply.append(time.perf_counter() - start)
    return {
        "preview": statistics.median(preview),
        "apply": statistics.median(apply),
        "modules": float(sum(1 for _ in base.modules())),
    }


def _siblings_forward(
    dtype: torch.dtype,
    cfg: ExampleDecoderConfig,
    *,
    shape: tuple[int, int],
    device: str,
    min_run_time: float,
    rounds: int,
) -> dict[str, float]:
    torch.manual_seed(0)
    with torch.device(device):
        layer = DecoderLayer(cfg, GatedMLP).to(dtype).eval()
    fused = copy.deepcopy(layer)
    apply_fusions(fused, _SIBLINGS, strict=True)
    a, m = layer.self_attn, cast(GatedMLP, layer.mlp)
    qkv = cast(nn.Linear, fused.get_submodule("self_attn.qkv_proj"))
    gate_up = cast(nn.Linear, fused.get_submodule("mlp.gate_up_proj"))
    qkv_w, gu_w = qkv.weight, gate_up.weight
    qkv_sizes = [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
    gu_sizes = [m.gate_proj.out_features, m.up_proj.out_features]
    x = torch.randn(*shape, cfg.hidden_size, dtype=dtype, device=device)

    def unfused_proj() -> Any:
        return a.q_proj(x), a.k_proj(x), a.v_proj(x), m.gate_proj(x), m.up_proj(x)

    def fused_proj() -> Any:
        return qkv(x).split(qkv_sizes, -1), gate_up(x).split(gu_sizes, -1)

    def floor() -> Any:
        return F.linear(x, qkv_w), F.linear(x, gu_w)

    with torch.inference_mode():
        want, got = layer(x), fused(x)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
        return median_per_call(
            {
                "unfused": unfused_proj,
                "fused": fused_proj,
                "floor": floor,
                "layer": lambda: layer(x),
                "fused layer": lambda: fused(x),
            },
            device=device,
            rounds=rounds,
            min_run_time=min_run_time,
        )


def _siblings_surgery_times(cfg: ExampleDecoderConfig, *, repeat: int) -> dict[str, float]:
    base = build_decoder_model(cfg, device="meta")
    preview, apply = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        preview_fusions(base, _SIBLINGS)
        preview.append(time.perf_counter() - start)
        model = copy.deepcopy(base)
        start = time.perf_counter()
        apply_fusions(model, _SIBLINGS, strict=True)
        apply.append(time.perf_counter() - start)
    return {"preview": statistics.median(preview), "apply": statistics.median(apply)}


def run_siblings(
    *,
    hidden: int = 2048,
    intermediate: int = 5632,
    layers: int = 32,
    device: str = "cpu",
    min_run_time: float = 3.0,
    repeat: int = 7,
) -> dict[str, Any]:
    """Part 3: the qkv and gate_up fusions on a Llama-style decoder layer; print a table, return seconds."""
    cfg = ExampleDecoderConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_hidden_layers=layers,
        vocab_size=32000,
    )
    print(
        f"qkv + gate_up fusions; decoder layer H={hidden}, 16/4 heads, I={intermediate}; device={device}, "
        f"threads={torch.get_num_threads()}; projections: 5 nn.Linear calls (unfused) vs 2 calls + split (fused) "
        "vs 2 bare F.linear of the fused weights (floor)"
    )
    print(
        f"{'dtype':>9} {'b x s':>7} {'unfused':>10} {'fused':>10} {'floor':>10} {'fused/fl':>8} "
        f"{'unf/fused':>9} {'layer':>10} {'fused layer':>11} {'layer gain':>10}"
    )
    results: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for shape in _SHAPES:
            t = _siblings_forward(
                dtype, cfg, shape=shape, device=device, min_run_time=min_run_time, rounds=max(3, repeat // 2)
            )
            results[f"{name} {shape[0]}x{shape[1]}"] = t
            print(
                f"{name:>9} {shape[0]:>3}x{shape[1]:<3} {t['unfused'] * 1e3:8.3f}ms {t['fused'] * 1e3:8.3f}ms "
                f"{t['floor'] * 1e3:8.3f}ms {t['fused'] / t['floor']:8.3f} {t['unfused'] / t['fused']:8.2f}x "
                f"{t['layer'] * 1e3:8.2f}ms {t['fused layer'] * 1e3:9.2f}ms {t['layer'] / t['fused layer']:9.2f}x"
            )
    s = _siblings_surgery_times(cfg, repeat=repeat)
    results["surgery"] = s
    print(
        f"{layers}-layer decoder on meta: preview_fusions {s['preview'] * 1e3:.1f} ms, "
        f"apply_fusions {s['apply'] * 1e3:.1f} ms (median of {repeat})"
    )
    return results


def run(
    *,
    patches: int = 4096,
    embed_dim: int = 1280,
    depth: int = 32,
    tower_dim: int = 256,
    device: str = "cpu",
    min_run_time: float = 3.0,
    repeat: int = 7,
) -> dict[str, Any]:
    """Run both parts and print a table; return the raw numbers (seconds)."""
    print(
        f"patch_embeddings fusion; device={device}, torch {torch.__version__}, threads={torch.get_num_threads()}"
    )
    print(
        f"forward: {patches} patches of 3x2x14x14 -> {embed_dim}; median per call over interleaved rounds; ratios vs the F.linear floor"
    )
    print(
        f"{'dtype':>9} {'unfused':>11} {'fused':>11} {'floor':>11} {'unfused/fl':>10} {'fused/fl':>9} {'speedup':>8}"
    )
    results: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        t = _forward(
            dtype,
            patches=patches,
            embed_dim=embed_dim,
            device=device,
            min_run_time=min_run_time,
            rounds=repeat,
        )
        name = str(dtype).removeprefix("torch.")
        results[name] = t
        print(
            f"{name:>9} {t['unfused'] * 1e3:9.3f}ms {t['fused'] * 1e3:9.3f}ms {t['floor'] * 1e3:9.3f}ms "
            f"{t['unfused'] / t['floor']:10.2f} {t['fused'] / t['floor']:9.2f} {t['unfused'] / t['fused']:7.2f}x"
        )
    s = _surgery_times(depth=depth, embed_dim=tower_dim, repeat=repeat)
    results["surgery"] = s
    print(
        f"{depth}-block tower (D={tower_dim}, {int(s['modules'])} modules, CPU): "
        f"preview_fusions {s['preview'] * 1e3:.2f} ms, apply_fusions {s['apply'] * 1e3:.2f} ms (median of {repeat})"
    )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    p = parser("fusion", __doc__)
    p.add_argument("--patches", type=positive_int, default=4096, help="patches per forward (default 4096)")
    p.add_argument("--embed-dim", type=positive_int, default=1280, help="output width of the patch embedding")
    p.add_argument(
        "--depth", type=positive_int, default=32, help="blocks of the tower for the preview/apply timing"
    )
    p.add_argument("--tower-dim", type=positive_int, default=256, help="embed_dim of that tower")
    p.add_argument("--device", default="cpu", help="where the forward runs (default cpu)")
    p.add_argument(
        "--min-run-time", type=float, default=3.0, help="seconds per forward measurement, over all rounds"
    )
    p.add_argument(
        "--repeat", type=positive_int, default=7, help="interleaved rounds / preview-apply repeats"
    )
    p.add_argument(
        "--part",
        choices=("all", "patch", "siblings", "generate"),
        default="all",
        help="which fusions to time (default all)",
    )
    p.add_argument("--hidden", type=positive_int, default=2048, help="decoder hidden size (siblings part)")
    p.add_argument(
        "--intermediate", type=positive_int, default=5632, help="decoder MLP width (siblings part)"
    )
    p.add_argument("--new-tokens", type=positive_int, default=32, help="tokens to generate (generate part)")
    args = p.parse_args(argv)
    if args.part == "generate":
        run_generate(new_tokens=args.new_tokens, rounds=args.repeat)
    if args.part in ("all", "patch"):
        run(
            patches=args.patches,
            embed_dim=args.embed_dim,
            depth=args.depth,
            tower_dim=args.tower_dim,
            device=args.device,
            min_run_time=args.min_run_time,
            repeat=args.repeat,
        )
    if args.part in ("all", "siblings"):
        run_siblings(
            hidden=args.hidden,
            intermediate=args.intermediate,
            layers=args.depth,
            device=args.device,
            min_run_time=args.min_run_time,
            repeat=args.repeat,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
