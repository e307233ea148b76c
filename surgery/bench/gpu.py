"""Benchmark and checks on a GPU: loads straight into device memory, the FP8 runtime, fusions (not a test).

One prepared run for a short window on a GPU machine (no network there: it builds its own
checkpoints). ``--scale full`` (default on CUDA) writes a ~9 GB Llama-style and a ~10 GB
Qwen3-MoE-style bf16 checkpoint (transformers' own classes and hub layout, random weights) and
a block-FP8 copy of the Llama one, then:

1. **bandwidth**: host-to-device copies from a pinned 1 GiB buffer (``cudaMemcpyAsync``), the floor
   of a load from the page cache;
2. **loads**, each in a fresh process (and a sweep of our reading threads and ring sizes): ``surgery.load_checkpoint(meta model, device=...)`` (through
   the staging ring), ``safetensors.torch.load_file(device=...)`` per shard, and transformers'
   ``from_pretrained(device_map=...)``; wall time, GB/s against the pinned floor and peak host RSS
   growth, page cache warm and dropped (``posix_fadvise``);
3. **exactness**: every tensor of a GPU load bit-equal to a CPU load of the same checkpoint; a
   save from the device byte-identical to the checkpoint (bf16 and the kept FP8 one);
4. **FP8 runtime**: the FP8 checkpoint kept as stored (``KeepPacked(..., kernel=True)``), its logits
   against the dequantized bf16 model, which kernel each linear runs; the FP8 block-scaled matmul
   against bf16 ``F.linear`` per shape (time, relative error);
5. **fusions**: a Llama decoder layer with ``qkv`` + ``gate_up`` fused against unfused (batch 1
   decode, a 512-token prefill) and the Conv3d→Linear patch embedding, eager and compiled.

``--device cpu --scale tiny`` runs every part on small checkpoints with the staging ring forced
(``staging_bytes``), which is how CI checks the script itself. Run it with
``python -m surgery bench gpu --workdir /tmp/gpu --json results.json``; each part has a time
budget and reports what it skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .harness import drop_page_cache, median_per_call, peak_rss, reset_peak_rss, warm
from .harness import parser as bench_parser

__all__ = ["PARTS", "main", "ring_cost", "run"]

GB = 1e9
_SCALES: dict[str, dict[str, dict[str, Any]]] = {
    "full": {
        "llama": {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
        },
        "moe": {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 14,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
        },
    },
    "tiny": {
        "llama": {
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
        },
        "moe": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "moe_intermediate_size": 128,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 512,
        },
    },
}
_FP8_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "fmt": "e4m3",
}
PARTS = ("loads", "ring_sweep", "exactness", "fp8_runtime", "fp8_matmul", "fusions")
"""What ``--parts`` selects (after the checkpoints and the pinned bandwidth, which always run)."""
_FP8_LOGITS_BOUND = 0.05
"""The stated bound: relative L2 error of the kept-FP8 model's logits against the dequantized bf16 model's."""


# --------------------------------------------------------------------------- checkpoints


def _config(family: str, scale: str) -> Any:
    from transformers import LlamaConfig, Qwen3MoeConfig

    cls = LlamaConfig if family == "llama" else Qwen3MoeConfig
    return cls(**_SCALES[scale][family], tie_word_embeddings=False, dtype="bfloat16")


def _meta_model(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from ..empty import init_empty

    with init_empty():
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _hub_shapes(config: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The hub checkpoint's keys: transformers' runtime keys, experts split per expert (hub layout)."""
    model = _meta_model(config)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key, t in model.state_dict().items():
        if key.endswith("mlp.experts.gate_up_proj"):  # (E, 2I, H) -> per expert gate (I, H), up (I, H)
            e, two_i, h = t.shape
            for j in range(e):
                for name in ("gate_proj", "up_proj"):
                    out[f"{key.rsplit('.', 1)[0]}.{j}.{name}.weight"] = ((two_i // 2, h), t.dtype)
        elif key.endswith("mlp.experts.down_proj"):  # (E, H, I) -> per expert (H, I)
            e, h, i = t.shape
            for j in range(e):
                out[f"{key.rsplit('.', 1)[0]}.{j}.down_proj.weight"] = ((h, i), t.dtype)
        else:
            out[key] = (tuple(t.shape), t.dtype)
    return out


def _build_checkpoints(work: Path, scale: str, device: str) -> dict[str, Any]:
    from ..checkpoint import write_checkpoint
    from ..quantization import blockwise_quantize

    made: dict[str, Any] = {}
    gen_device = device if device.startswith("cuda") else "cpu"
    for family in ("llama", "moe"):
        config = _config(family, scale)
        path = work / family
        if not (path / "config.json").exists():
            g = torch.Generator(device=gen_device).manual_seed(0)
            state = {
                k: (torch.randn(shape, generator=g, device=gen_device, dtype=torch.float32) * 0.02)
                .to(dtype)
                .cpu()
                for k, (shape, dtype) in _hub_shapes(config).items()
            }
            write_checkpoint(state, path, max_shard_size="5GB")
            config.save_pretrained(path)
            if family == "llama":
                fp8: dict[str, torch.Tensor] = {}
                for k, t in state.items():
                    if k.endswith("_proj.weight"):
                        q, s = blockwise_quantize(t.to(gen_device).float(), (128, 128))
                        fp8[k], fp8[k + "_scale_inv"] = q.cpu(), s.cpu()
                    else:
                        fp8[k] = t
                write_checkpoint(fp8, work / "llama-fp8", max_shard_size="5GB")
                config.quantization_config = dict(_FP8_CONFIG)
                config.save_pretrained(work / "llama-fp8")
                del fp8
            del state
        made[family] = _bytes(path)
    made["llama-fp8"] = _bytes(work / "llama-fp8")
    return made


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


# --------------------------------------------------------------------------- a fresh process per load


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measured load in this (fresh) process: wall time, peak host RSS growth, what it holds."""
    device = spec["device"]
    if device.startswith("cuda"):
        torch.zeros(1, device=device)  # the CUDA context is not the load's memory
    path = Path(spec["path"])
    how = spec["how"]
    if how == "sweep":
        return _sweep(path, device, spec["variants"])
    if how == "surgery":
        from transformers import AutoConfig

        import surgery

        model = _meta_model(AutoConfig.from_pretrained(path))
        surgery.get_model_conversion_mapping(model)  # the catalog's first import is not the load
    base = reset_peak_rss()
    start = time.perf_counter()
    extra: dict[str, Any] = {}
    if how == "surgery":
        report = surgery.load_checkpoint(model, path, device=device, staging_bytes=spec.get("staging_bytes"))
        extra = {"ok": report.ok, "staged_bytes": report.staged_bytes, "bytes_read": report.bytes_read}
    elif how == "safetensors":
        from safetensors.torch import load_file

        held = [load_file(f, device=device) for f in sorted(path.glob("*.safetensors"))]
        extra = {"tensors": sum(len(h) for h in held)}
    else:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(path, device_map=device, dtype=torch.bfloat16)
        except ValueError as exc:  # device_map needs accelerate, which may not be installed
            if "accelerate" not in str(exc):
                raise
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
            extra = {"variant": "from_pretrained().to(device): device_map needs accelerate"}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "rss_growth": peak_rss() - base, **extra}


def _sweep(path: Path, device: str, variants: list[tuple[int, str]]) -> dict[str, Any]:
    """Best of 2 warm loads per ``(num_workers, staging_bytes)``: which the ring's defaults should be."""
    from transformers import AutoConfig

    import surgery

    config = AutoConfig.from_pretrained(path)
    surgery.get_model_conversion_mapping(_meta_model(config))
    out: dict[str, Any] = {}
    for workers, ring in variants:
        times = []
        for _ in range(2):
            model = _meta_model(config)
            start = time.perf_counter()
            surgery.load_checkpoint(model, path, device=device, staging_bytes=ring, num_workers=workers)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            del model
        out[f"{workers} workers, {ring}"] = min(times)
    return out


def _ring_sweep(work: Path, sizes: dict[str, int], device: str, floor: float, scale: str) -> dict[str, Any]:
    variants = (
        [(w, r) for w in (4, 8, 16) for r in ("256MiB", "1GiB")]
        if scale == "full"
        else [(2, "1MiB"), (4, "4MiB")]
    )
    warm([work / "llama"])
    found = _in_fresh_process(
        {"how": "sweep", "path": str(work / "llama"), "device": device, "variants": variants}, timeout=240
    )
    if "error" in found:
        return found
    return {
        k: {"seconds": t, "GB/s": sizes["llama"] / t / GB, "of pinned": sizes["llama"] / t / floor}
        for k, t in found.items()
    }


def _in_fresh_process(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "surgery.bench.gpu", "--child", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr or done.stdout)[-2000:]}
    return json.loads(lines[-1])


def _pinned_bandwidth(device: str) -> float:
    """Host-to-device bytes per second from a pinned buffer (host to host off CUDA), best of 5."""
    n = (1 << 30) if device.startswith("cuda") else (64 << 20)
    cuda = device.startswith("cuda")
    src = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    src.fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return n / best


def _loads(work: Path, sizes: dict[str, int], device: str, floor: float, staging: Any) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    hows = ["surgery", "safetensors", "transformers"]
    for family in ("llama", "moe"):
        path = work / family
        for cache in ("warm", "cold"):
            for how in hows if cache == "warm" else ["surgery", "safetensors"]:
                if cache == "cold":
                    note = drop_page_cache([str(path)])
                else:
                    warm([path])
                    note = "warm"
                spec = {"how": how, "path": str(path), "device": device, "staging_bytes": staging}
                r = _in_fresh_process(spec, timeout=240)
                if "seconds" in r:
                    r["GB/s"] = sizes[family] / r["seconds"] / GB
                    r["of pinned"] = sizes[family] / r["seconds"] / floor
                r["cache"] = note
                rows[f"{family} {cache} {how}"] = r
    return rows


# --------------------------------------------------------------------------- exactness and FP8


def _same_tensors(saved: Path, original: Path) -> bool:
    """Whether two checkpoints hold the same keys with the same dtypes, shapes and bytes."""
    from ..checkpoint import open_checkpoint

    with open_checkpoint(saved) as x, open_checkpoint(original) as y:
        if sorted(x.keys()) != sorted(y.keys()):
            return False
        for k in x:
            a, b = x.get_tensor(k, copy=False), y.get_tensor(k, copy=False)
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                return False
    return True


def _exactness(work: Path, device: str, staging: Any) -> dict[str, Any]:
    from transformers import AutoConfig

    import surgery

    out: dict[str, Any] = {}
    for family in ("llama", "moe"):
        path = work / family
        config = AutoConfig.from_pretrained(path)
        on_device = _meta_model(config)
        surgery.load_checkpoint(on_device, path, device=device, staging_bytes=staging, strict=True)
        on_cpu = _meta_model(config)
        surgery.load_checkpoint(on_cpu, path, device="cpu", strict=True)
        cpu_state = on_cpu.state_dict()
        unequal = [
            k
            for k, v in on_device.state_dict().items()
            if v.device.type != torch.device(device).type or not torch.equal(v.cpu(), cpu_state[k])
        ]
        del on_cpu, cpu_state
        saved = work / f"{family}-saved"
        surgery.save_checkpoint(on_device, saved)
        out[family] = {
            "tensors": len(on_device.state_dict()),
            "unequal_to_cpu_load": unequal,
            "save_from_device_identical": _same_tensors(saved, path),
        }
        shutil.rmtree(saved)  # the disk holds ~25 GB of checkpoints already
        del on_device
    return out


def _fp8_runtime(work: Path, device: str, staging: Any) -> dict[str, Any]:
    from transformers import AutoConfig

    import surgery

    from ..quantization import FP8BlockQuantizer, KeepPacked

    path = work / "llama-fp8"
    config = AutoConfig.from_pretrained(path)
    config.quantization_config = None
    quantizer = FP8BlockQuantizer.from_config(_FP8_CONFIG)
    kept = _meta_model(config)
    report = surgery.load_checkpoint(
        kept,
        path,
        device=device,
        staging_bytes=staging,
        quantizer=KeepPacked(quantizer, checkpoint=path, kernel=True),
    )
    kept.to(device)  # buffers computed at init (rotary frequencies)
    decoded = _meta_model(config)
    surgery.load_checkpoint(
        decoded, path, device=device, staging_bytes=staging, quantizer=quantizer, strict=True
    )
    decoded.to(device)
    ids = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        got = kept(ids).logits.float()
        want = decoded(ids).logits.float()
    rel = float((got - want).norm() / want.norm())
    saved = work / "llama-fp8-saved"
    surgery.save_checkpoint(kept, saved)
    facts = {
        "load_ok": report.ok,
        "kernels": report.kernels,
        "logits_rel_l2": rel,
        "logits_max_abs_over_max": float((got - want).abs().max() / want.abs().max()),
        "bound": _FP8_LOGITS_BOUND,
        "within_bound": rel <= _FP8_LOGITS_BOUND,
        "save_from_device_identical": _same_tensors(saved, path),
    }
    shutil.rmtree(saved)
    return facts


def _fp8_matmul(device: str, scale: str) -> dict[str, Any]:
    from ..quantization import blockwise_dequantize, blockwise_quantize
    from ..quantization.kernels import fp8_block_kernel_usable, fp8_block_linear, weight_scale_operand

    shapes = [(1, 4096, 4096), (16, 4096, 14336), (4096, 4096, 14336)] if scale == "full" else [(4, 256, 512)]
    out: dict[str, Any] = {}
    for m, k, n in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(n, k, generator=g, device=device) * 0.02
        w_q, w_s = blockwise_quantize(w, (128, 128))
        x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
        w_dq = blockwise_dequantize(w_q, w_s, (128, 128))
        exact = x.float() @ w_dq.T
        usable = fp8_block_kernel_usable(
            device, in_features=k, out_features=n, block=(128, 128), dtype=w_q.dtype
        )
        fns = {"bf16": partial(F.linear, x, w_dq.to(torch.bfloat16))}
        if usable:
            fns["fp8"] = partial(fp8_block_linear, x, w_q, weight_scale_operand(w_s))
        t = median_per_call(fns, device=device, rounds=5, min_run_time=1.0)
        row: dict[str, Any] = {"kernel": usable}
        for name, fn in fns.items():
            row[f"{name}_s"] = t[name]
            row[f"{name}_rel_err"] = float((fn().float() - exact).norm() / exact.norm())
        if usable:
            row["speedup"] = row["bf16_s"] / row["fp8_s"]
        out[f"{m}x{k}x{n}"] = row
    return out


# --------------------------------------------------------------------------- fusions


def _measure_pair(out: dict[str, Any], name: str, a: Any, b: Any, arg: torch.Tensor, device: str) -> None:
    """``out[name]``: unfused ``a`` and fused ``b`` timed on ``arg``, or the error (a failed compile
    costs only its own row)."""
    try:
        with torch.inference_mode():
            t = median_per_call(
                {"u": partial(a, arg), "f": partial(b, arg)}, device=device, rounds=5, min_run_time=1.0
            )
        out[name] = {"unfused_s": t["u"], "fused_s": t["f"], "speedup": t["u"] / t["f"]}
    except Exception as exc:
        out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}


def _fusions(device: str, compile_too: bool, scale: str) -> dict[str, Any]:
    import copy

    from ..examples.decoder import ExampleDecoderConfig, build_decoder_model
    from ..examples.vision import build_vision_tower, example_pixel_values
    from ..fusion import apply_fusions

    hidden, inter = (4096, 14336) if scale == "full" else (256, 512)
    cfg = ExampleDecoderConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=32 if scale == "full" else 4,
        num_key_value_heads=8 if scale == "full" else 2,
        num_hidden_layers=1,
        vocab_size=1024,
    )
    unfused = build_decoder_model(cfg, seed=0).to(device=device, dtype=torch.bfloat16)
    fused = copy.deepcopy(unfused)
    apply_fusions(fused, {"qkv": True, "gate_up": True}, strict=True)
    modes = [("eager", lambda m: m)] + ([("compiled", torch.compile)] if compile_too else [])
    out: dict[str, Any] = {}
    for label, prompt in (("decode 1x1", 1), ("prefill 1x512", 512 if scale == "full" else 64)):
        ids = torch.randint(0, 1024, (1, prompt), device=device)
        for mode, wrap in modes:
            _measure_pair(out, f"decoder layer {label} {mode}", wrap(unfused), wrap(fused), ids, device)
    tower = build_vision_tower(depth=0, embed_dim=1280, num_heads=1, dtype=torch.bfloat16, device=device)
    patch_unfused = tower.patch_embed
    apply_fusions(tower, {"patch_embeddings": True}, strict=True)
    patch_fused = tower.patch_embed
    x = example_pixel_values(
        tower.config, num_patches=4096 if scale == "full" else 256, dtype=torch.bfloat16, device=device
    )
    for mode, wrap in modes:
        _measure_pair(out, f"patch embedding {mode}", wrap(patch_unfused), wrap(patch_fused), x, device)
    return out


# --------------------------------------------------------------------------- the ring on the CPU


def ring_cost(workdir: str | os.PathLike[str], *, repeat: int = 3) -> dict[str, float]:
    """Best-of-``repeat`` seconds of a CPU load of 1 GiB (32 float32 ``Linear(4096, 2048)``, warm
    cache): straight into the destinations, and through a 256 MiB and a 16 MiB staging ring."""
    import surgery

    from ..checkpoint import write_checkpoint

    def model(device: str) -> torch.nn.Module:
        return torch.nn.ModuleList(torch.nn.Linear(4096, 2048, bias=False, device=device) for _ in range(32))

    path = Path(workdir) / "ring-1GiB"
    if not (path / "model.safetensors").exists():
        write_checkpoint(model("cpu").state_dict(), path)
    warm([path])
    variants: dict[str, dict[str, Any]] = {
        "straight": {"mmap": False},
        "ring 256MiB": {"staging_bytes": "256MiB"},
        "ring 16MiB": {"staging_bytes": "16MiB"},
    }
    out: dict[str, float] = {}
    for name, kwargs in variants.items():
        times = []
        for _ in range(repeat):
            m = model("meta")
            start = time.perf_counter()
            surgery.load_checkpoint(m, path, **kwargs)
            times.append(time.perf_counter() - start)
        out[name] = min(times)
    return out


# --------------------------------------------------------------------------- the run


def run(
    *,
    workdir: str | os.PathLike[str],
    device: str = "cuda",
    scale: str | None = None,
    compile_too: bool | None = None,
    staging_bytes: int | str | None = None,
    budget_s: float = 360.0,
    parts: Sequence[str] | None = None,
    json_path: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Every part in turn, each guarded (an error is recorded, the next part runs); returns the
    results, also written to ``json_path`` after every part (a run cut short keeps what it measured).

    A part that would start past ``budget_s`` is skipped; ``torch.compile`` timings are left out
    of the fusions when less than 120 s of the budget is left."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    cuda = device.startswith("cuda")
    scale = scale or ("full" if cuda else "tiny")
    compile_too = cuda if compile_too is None else compile_too
    staging = staging_bytes if staging_bytes is not None or cuda else "1MiB"  # on the CPU: force the ring
    _require_catalog()
    start = time.perf_counter()
    results: dict[str, Any] = {"env": _env(device), "scale": scale, "staging_bytes": staging}

    def part(name: str, fn: Callable[[], Any]) -> None:
        if parts is not None and name not in parts and name != "checkpoints":
            return
        left = budget_s - (time.perf_counter() - start)
        if left <= 0:
            results[name] = {"skipped": f"over the {budget_s:.0f} s budget"}
            return
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()[-3000:]}
        results.setdefault("seconds", {})[name] = time.perf_counter() - t0
        if json_path is not None:
            Path(json_path).write_text(json.dumps(results, indent=2, default=str))
        print(
            f"[{time.perf_counter() - start:6.1f} s] {name}: {json.dumps(results[name], default=str)[:2000]}",
            flush=True,
        )

    part("checkpoints", lambda: _build_checkpoints(work, scale, device))
    sizes = results["checkpoints"] if "error" not in results["checkpoints"] else {}
    results["pinned_bandwidth_GB/s"] = _pinned_bandwidth(device) / GB  # the loads' floor, always measured
    floor = results["pinned_bandwidth_GB/s"] * GB
    part("loads", lambda: _loads(work, sizes, device, floor, staging))
    part("ring_sweep", lambda: _ring_sweep(work, sizes, device, floor, scale))
    part("exactness", lambda: _exactness(work, device, staging))
    part("fp8_runtime", lambda: _fp8_runtime(work, device, staging))
    part("fp8_matmul", lambda: _fp8_matmul(device, scale))
    time_for_compile = budget_s - (time.perf_counter() - start) > 120
    part("fusions", lambda: _fusions(device, compile_too and time_for_compile, scale))
    results["total_s"] = time.perf_counter() - start
    if json_path is not None:
        Path(json_path).write_text(json.dumps(results, indent=2, default=str))
    return results


def _require_catalog() -> None:
    """The built-in catalog is found through the package's entry points: a source tree on
    ``PYTHONPATH`` alone has none, and the MoE load would then find no mapping."""
    from importlib.metadata import entry_points

    from ..registry import CATALOG_ENTRY_POINT_GROUP

    if not list(entry_points(group=CATALOG_ENTRY_POINT_GROUP)):
        raise SystemExit(
            "surgery bench gpu: no conversion catalog is installed (no 'surgery.catalogs' entry point). Install "
            "the package first, offline: python3 -m pip install --no-deps --no-index --no-build-isolation --target "
            "/tmp/site . && export PYTHONPATH=/tmp/site"
        )


def _env(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "device": device, "cpus": os.cpu_count()}
    try:
        import safetensors
        import transformers

        env["safetensors"], env["transformers"] = safetensors.__version__, transformers.__version__
    except ImportError as exc:
        env["missing"] = str(exc)
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
        env["cuda"] = torch.version.cuda
    return env


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``--child SPEC`` is one measured load, for :func:`run` to spawn)."""
    p = bench_parser("gpu", __doc__)
    p.add_argument("--workdir", help="where the checkpoints go (~25 GB at full scale); required")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu to check the script")
    p.add_argument("--scale", choices=sorted(_SCALES), help="full (default on CUDA) or tiny")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile timings")
    p.add_argument(
        "--staging-bytes", help="the load's staging ring (default 256MiB on CUDA, 1MiB forced on CPU)"
    )
    p.add_argument(
        "--budget", type=float, default=360.0, help="seconds after which remaining parts are skipped"
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--parts",
        help=f"comma-separated parts to run (default all): {', '.join(PARTS)}; checkpoints are always built",
    )
    p.add_argument(
        "--ring-cost", action="store_true", help="only time CPU loads straight and through the ring"
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    if not args.workdir:
        p.error("--workdir is required")
    if args.ring_cost:
        print(json.dumps(ring_cost(args.workdir)))
        return 0
    unknown = sorted(set((args.parts or "").replace(" ", "").split(",")) - set(PARTS) - {""})
    if unknown:
        p.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    results = run(
        workdir=args.workdir,
        device=args.device,
        scale=args.scale,
        compile_too=False if args.no_compile else None,
        staging_bytes=args.staging_bytes,
        budget_s=args.budget,
        parts=None if not args.parts else [x.strip() for x in args.parts.split(",")],
        json_path=args.json,
    )
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
