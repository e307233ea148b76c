"""``surgery demo``: the main job, end to end, on the built-in example models.

Part 1 (checkpoint conversion): a Mixtral-style model's checkpoint in the classic per-expert
layout is planned, loaded into the fused-experts runtime model (built on ``meta``, so nothing is
allocated twice), compared with the source weights, saved back in the original layout, and the
written files are compared byte for byte with the input.

Part 2 (fusion): a Qwen2-VL-like vision tower's original checkpoint is loaded into a tower whose
Conv3d patch embedding is rewritten into one ``nn.Linear``; outputs are compared with the
unfused tower and the export is compared with the input files.

Part 3 (fusion found by dataflow): a Llama-style decoder's checkpoint (separate q/k/v and gate/up
projections) is loaded into a decoder whose attention and MLP the ``qkv`` and ``gate_up`` fusions
rewrote into one projection each; logits are compared and the export is compared with the input.

Part 4 (quantization): the MoE checkpoint is stored as block-wise FP8 (DeepSeek-V3 layout),
decoded per expert as it is read into the fused model, and saved back as the same FP8 files;
the float checkpoint is then loaded with int8 weight-only quantization on the fly.
"""

from __future__ import annotations

import filecmp
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .checkpoint import open_checkpoint, write_checkpoint
from .examples.decoder import build_decoder_model
from .examples.moe import ExampleMoEConfig, build_moe_model, original_state_dict
from .examples.vision import build_vision_tower
from .fusion import preview_fusions
from .load import load_checkpoint, plan_load
from .quantization import FP8BlockQuantizer, Int8WeightOnlyQuantizer, blockwise_quantize
from .save import save_checkpoint

__all__ = ["run_demo"]


@contextmanager
def _step(title: str, timings: list[tuple[str, float]]) -> Iterator[None]:
    print(f"\n== {title}")
    start = time.perf_counter()
    yield
    timings.append((title, time.perf_counter() - start))


def _same_files(a: Path, b: Path) -> bool:
    fa = sorted(p.name for p in a.iterdir() if p.is_file())
    fb = sorted(p.name for p in b.iterdir() if p.is_file())
    return fa == fb and all(filecmp.cmp(a / n, b / n, shallow=False) for n in fa)


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _moe_part(root: Path, shown: Callable[[Path], str], timings: list[tuple[str, float]]) -> bool:

    cfg = ExampleMoEConfig()  # the size of `surgery ... --model example-moe`
    src_dir, out_dir = root / "moe-original", root / "moe-roundtrip"
    with _step("MoE: write the original per-expert checkpoint (sharded)", timings):
        reference = build_moe_model(cfg, seed=0)
        original = original_state_dict(reference)
        write_checkpoint(original, src_dir, max_shard_size=sum(t.nbytes for t in original.values()) // 2 + 1)
        print(
            f"{len(original)} tensors in {len(list(src_dir.glob('*.safetensors')))} shards: {shown(src_dir)}"
        )
    model = build_moe_model(cfg, device="meta")
    with _step("MoE: load plan (headers only)", timings):
        print(plan_load(model, src_dir).render(max_rows=12))
    with _step("MoE: load into the fused-experts model built on meta", timings):
        report = load_checkpoint(model, src_dir)
        print(report)
    ok_values = _same_tensors(model.state_dict(), reference.state_dict())
    print(f"loaded weights equal the source model's: {ok_values}")
    with torch.no_grad():
        ids = torch.randint(0, cfg.vocab_size, (2, 8))
        ok_out = torch.equal(model(ids), reference(ids))
    print(f"outputs equal the source model's: {ok_out}")
    with _step("MoE: save back in the original layout", timings):
        save_checkpoint(model, out_dir, max_shard_size=sum(t.nbytes for t in original.values()) // 2 + 1)
    same_files = _same_files(src_dir, out_dir)
    with open_checkpoint(out_dir) as r:
        same = _same_tensors({k: r.get_tensor(k) for k in r}, original)
    print(f"written files byte-identical to the input: {same_files}; tensors identical: {same}")
    return report.ok and ok_values and ok_out and same_files and same


def _vision_part(root: Path, shown: Callable[[Path], str], timings: list[tuple[str, float]]) -> bool:

    src_dir, out_dir = root / "vision-original", root / "vision-roundtrip"
    with _step("Vision: write the original tower checkpoint (Conv3d patch embedding)", timings):
        unfused = build_vision_tower(seed=0)  # the size of `--model example-vision`
        original = {k: v.clone() for k, v in unfused.state_dict().items()}
        write_checkpoint(original, src_dir)
        print(f"{len(original)} tensors: {shown(src_dir)}")
    fused = build_vision_tower(seed=1)
    with _step("Vision: preview the patch_embeddings fusion", timings):
        print(preview_fusions(fused, {"patch_embeddings": True}).render())
    with _step("Vision: apply the fusion and load the original checkpoint through it", timings):
        report = load_checkpoint(fused, src_dir, fusion_config={"patch_embeddings": True})
        print(report)
    patches = torch.randn(64, _patch_volume(unfused))
    with torch.no_grad():
        a, b = unfused(patches), fused(patches)
    err = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-12)
    print(f"fused vs unfused output: max relative difference {err:.2e}")
    with _step("Vision: export back to the original layout", timings):
        save_checkpoint(fused, out_dir)
    same_files = _same_files(src_dir, out_dir)
    print(f"exported files byte-identical to the input: {same_files}")
    return report.ok and err < 1e-5 and same_files


def _siblings_part(root: Path, shown: Callable[[Path], str], timings: list[tuple[str, float]]) -> bool:

    src_dir, out_dir = root / "decoder-original", root / "decoder-roundtrip"
    config = {"qkv": True, "gate_up": True}
    with _step("Siblings: write a Llama-style decoder checkpoint (separate q/k/v, gate/up)", timings):
        unfused = build_decoder_model(seed=0)  # the size of `--model example-decoder`
        write_checkpoint(dict(unfused.state_dict()), src_dir)
        print(f"{len(unfused.state_dict())} tensors: {shown(src_dir)}")
    fused = build_decoder_model(device="meta")
    with _step("Siblings: preview qkv and gate_up (found in the dataflow, not by name)", timings):
        plan = preview_fusions(fused, config)
        for c in plan.matched:
            print(f"  {c.path}: {c.reason}")
    with _step("Siblings: apply them and load the original checkpoint through them", timings):
        report = load_checkpoint(fused, src_dir, fusion_config=config)
        print(report)
    ids = torch.randint(0, unfused.config.vocab_size, (2, 8))
    with torch.no_grad():
        a, b = unfused(ids), fused(ids)
    err = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-12)
    print(f"fused vs unfused logits: max relative difference {err:.2e}")
    with _step("Siblings: export back to the original layout", timings):
        save_checkpoint(fused, out_dir)
    same_files = _same_files(src_dir, out_dir)
    print(f"exported files byte-identical to the input: {same_files}")
    return report.ok and err < 1e-5 and same_files


def _quantization_part(root: Path, shown: Callable[[Path], str], timings: list[tuple[str, float]]) -> bool:

    cfg = ExampleMoEConfig()
    block = (8, 8)
    reference = build_moe_model(cfg, seed=0)
    original = original_state_dict(reference)
    src_dir, out_dir, float_dir = root / "moe-fp8", root / "moe-fp8-roundtrip", root / "moe-float"
    with _step("Quantization: store the expert weights as block-wise FP8 (8x8 blocks)", timings):
        stored: dict[str, torch.Tensor] = {}
        for key, value in original.items():
            if ".experts." in key:
                stored[key], stored[key + "_scale_inv"] = blockwise_quantize(value, block)
            else:
                stored[key] = value
        write_checkpoint(stored, src_dir)
        print(
            f"{sum(k.endswith('_scale_inv') for k in stored)} FP8 weights with their scales: {shown(src_dir)}"
        )
    model = build_moe_model(cfg, device="meta")
    quantizer = FP8BlockQuantizer(block_size=block)
    with _step("Quantization: load, decoding each expert before the merge", timings):
        report = load_checkpoint(model, src_dir, quantizer=quantizer)
        print(report)
    with _step("Quantization: save back as loaded (the recorded scales)", timings):
        save_checkpoint(model, out_dir)
    same_files = _same_files(src_dir, out_dir)
    print(f"FP8 files byte-identical to the input: {same_files}")
    write_checkpoint(original, float_dir)
    int8 = build_moe_model(cfg, device="meta")
    with _step("Quantization: int8 weight-only on the fly (attention projections)", timings):
        int8_report = load_checkpoint(
            int8, float_dir, quantizer=Int8WeightOnlyQuantizer(targets=["model.layers.*.self_attn.*"])
        )
        print(int8_report)
    with torch.no_grad():
        ids = torch.randint(0, cfg.vocab_size, (2, 8))
        want, got = reference(ids), int8(ids)
    err = float((got - want).norm() / want.norm())
    print(f"int8 model vs float model: relative difference {err:.2e}")
    return report.ok and same_files and int8_report.ok and err < 0.1


def _patch_volume(tower: Any) -> int:
    pe = tower.patch_embed
    return int(pe.in_channels * pe.temporal_patch_size * pe.patch_size * pe.patch_size)


def run_demo(*, workdir: str | None = None, quick: bool = False) -> int:
    """Run the parts of the demo (``quick``: without the quantization part); 0 when every check passed.

    The models have the sizes of the CLI's built-in examples, so a kept ``workdir`` can be
    inspected and converted with ``--model example-moe`` / ``example-vision`` afterwards.
    """
    start = time.perf_counter()
    timings: list[tuple[str, float]] = []
    parts: list[tuple[str, Callable[[Path, Callable[[Path], str], list[tuple[str, float]]], bool]]] = [
        ("checkpoint conversion (Mixtral-style MoE)", _moe_part),
        ("fusion (Qwen2-VL-like vision tower)", _vision_part),
        ("fusion (q/k/v and gate/up of a Llama-style decoder)", _siblings_part),
    ]
    if not quick:
        parts.append(("quantization (FP8 checkpoint round trip, int8 on the fly)", _quantization_part))
    results: list[tuple[str, bool]] = []
    with tempfile.TemporaryDirectory(prefix="surgery-demo-") as tmp:
        root = Path(workdir) if workdir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)

        def shown(path: Path) -> str:  # a temporary directory is deleted: do not print its paths
            return str(path) if workdir else f"{path.name}/ (temporary; keep it with --workdir DIR)"

        for name, part in parts:
            results.append((name, part(root, shown, timings)))
    total = time.perf_counter() - start
    print("\n== timings")
    for title, seconds in timings:
        print(f"  {seconds * 1000:9.1f} ms  {title}")
    rest = total - sum(seconds for _, seconds in timings)
    print(f"  {rest * 1000:9.1f} ms  the rest: building models, comparing outputs, first-use imports")
    print(f"  {total * 1000:9.1f} ms  in all")
    print("\n== summary")
    for name, ok in results:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    if workdir:
        print(f"\n== next: the checkpoints are kept in {workdir}")
        print(f"  surgery inspect {root / 'moe-original'} --model example-moe")
        print(
            f"  surgery convert {root / 'moe-original'} {root / 'moe-runtime'} --model example-moe --runtime-layout"
        )
    else:
        print("\n== next: surgery demo --workdir DIR keeps the checkpoints, then")
        print("  surgery inspect DIR/moe-original --model example-moe")
    return 0 if all(ok for _, ok in results) else 1
