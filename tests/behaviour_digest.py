"""Behaviour digest of ``surgery``: hashes of every written file and every loaded state.

Run from a checkout's root (it imports that checkout's ``surgery`` and ``specs``) on the old and the
new code, then diff the two JSON files; any difference is a change of behaviour.

    python tests/behaviour_digest.py --out old.json   # in a worktree of the old commit
    python tests/behaviour_digest.py --out new.json   # in the new tree
    python tests/behaviour_digest.py --diff old.json new.json

It uses the public API only (``surgery.*``, ``surgery.examples``, ``surgery.quantization``,
``surgery.parallel``), so it runs unchanged on both sides of a refactor. Covered:

- catalog: every family of the catalog that transformers can build tiny (tests/interop/tiny.py):
  transformers writes the hub file, surgery loads it into a fresh model (plan JSON, report JSON,
  loaded state) and saves it (every file's bytes); the never-loaded model's save too;
- fusion: the example vision tower (patch_embeddings), the example decoder (qkv, gate_up), a tiny
  transformers Llama (qkv, gate_up): preview text, load, state, save, revert_state_dict;
- quantization: block FP8 checkpoint decoded into the fused MoE and saved back, FP8 and int8 on the
  fly (state, quantized save), save with dtype=bfloat16;
- conversion: the example MoE (per-expert → fused) load/save, runtime-layout save, a sharded save;
- tensor parallelism: 2 gloo ranks, dense + MoE + FP8 + fused decoder (local shards per rank, plan
  JSON with tp_size=2, the saved files).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "interop"))  # tiny.py: the tiny transformers models
sys.path.insert(0, os.getcwd())

ROOT_MARK = "<ROOT>"


def _h(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:20]


def tensor_digest(t: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    t = t.detach().cpu().contiguous()
    head = f"{t.dtype}|{tuple(t.shape)}|".encode()
    if t.device.type == "meta" or t.numel() == 0:
        return _h(head)
    return _h(head + t.reshape(-1).view(torch.uint8).numpy().tobytes())


def state_digest(model: torch.nn.Module) -> dict[str, str]:
    return {k: tensor_digest(v) for k, v in sorted(model.state_dict().items())}


def files_digest(directory: Path) -> dict[str, str]:
    return {p.name: _h(p.read_bytes()) for p in sorted(directory.iterdir()) if p.is_file()}


def text_digest(text: str, root: Path) -> str:
    return _h(text.replace(str(root), ROOT_MARK).encode())


def _guard(out: dict[str, Any], name: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[name] = fn(*args, **kwargs)
    except Exception as e:  # recorded: an error's type and message are behaviour too
        out[name] = {"error": f"{type(e).__name__}: {e}"[:400]}


def report_digest(report: Any, root: Path) -> str:
    data = json.loads(report.to_json())
    data.pop("seconds", None)  # wall time: the only field that differs between identical runs
    return text_digest(json.dumps(data, sort_keys=True), root)


def _load_save(model: torch.nn.Module, ckpt: Path, out: Path, root: Path, **kwargs: Any) -> dict[str, Any]:
    import surgery

    save_kwargs = kwargs.pop("save_kwargs", {})
    facts: dict[str, Any] = {}
    report = surgery.load_checkpoint(model, ckpt, **kwargs)
    facts["report"] = report_digest(report, root)
    facts["plan"] = text_digest(report.plan.to_json(sort_keys=True), root)
    facts["ok"] = report.ok
    facts["state"] = state_digest(model)
    surgery.save_checkpoint(model, out, **save_kwargs)
    facts["saved"] = files_digest(out)
    return facts


# -- catalog ---------------------------------------------------------------------------------------


def catalog(root: Path) -> dict[str, Any]:
    from tiny import build, candidates
    from transformers.conversion_mapping import get_model_conversion_mapping

    import specs

    keys = [k for fam in specs.FAMILIES for k in (*fam.ENTRIES, *fam.ALIASES)]
    out: dict[str, Any] = {}
    for key in keys:
        for c in candidates(key):
            work = root / "catalog" / f"{c.key}-{c.class_name}"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = build(c, seed=0)
                    model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False)
                    model.save_pretrained(work / "original")
                    fresh = build(c, seed=1)
            except Exception as e:
                out[f"{c.key}-{c.class_name}"] = {"not_built": type(e).__name__}
                continue
            out[f"{c.key}-{c.class_name}"] = _family(model, fresh, work, root)
            shutil.rmtree(work, ignore_errors=True)
    return out


def _family(model: torch.nn.Module, fresh: torch.nn.Module, work: Path, root: Path) -> dict[str, Any]:
    import surgery

    facts: dict[str, Any] = {}
    plan = surgery.plan_load
    _guard(facts, "plan", lambda: text_digest(plan(fresh, work / "original").to_json(sort_keys=True), root))
    _guard(facts, "load_save", _load_save, fresh, work / "original", work / "saved", root)
    _guard(facts, "never_loaded", lambda: files_digest(_saved(model, work / "never")))
    _guard(
        facts,
        "reverted",
        lambda: {k: tensor_digest(v) for k, v in sorted(surgery.revert_state_dict(fresh).items())},
    )
    return facts


def _saved(model: torch.nn.Module, out: Path) -> Path:
    import surgery

    surgery.save_checkpoint(model, out)
    return out


# -- fusion, conversion, quantization ------------------------------------------------------------


def examples(root: Path) -> dict[str, Any]:
    import surgery
    from surgery.checkpoint import write_checkpoint
    from surgery.examples import (
        ExampleMoEConfig,
        build_decoder_model,
        build_moe_model,
        build_vision_tower,
        original_state_dict,
    )
    from surgery.quantization import FP8BlockQuantizer, Int8WeightOnlyQuantizer, blockwise_quantize

    out: dict[str, Any] = {}
    cfg = ExampleMoEConfig()
    original = original_state_dict(build_moe_model(cfg, seed=0))
    write_checkpoint(original, root / "moe")
    half = sum(t.nbytes for t in original.values()) // 2 + 1
    write_checkpoint(original, root / "moe-sharded", max_shard_size=half)
    # FP8 checkpoint: the experts stored block-wise, decoded per expert at load
    stored: dict[str, torch.Tensor] = {}
    for key, value in original.items():
        if ".experts." in key:
            stored[key], stored[key + "_scale_inv"] = blockwise_quantize(value, (8, 8))
        else:
            stored[key] = value
    write_checkpoint(stored, root / "moe-fp8")
    fp8 = {"quantizer": FP8BlockQuantizer(block_size=(8, 8))}
    int8 = {"quantizer": Int8WeightOnlyQuantizer(targets=["model.layers.*.self_attn.*"])}
    cases: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {  # name: (checkpoint, load, save)
        "moe": ("moe", {}, {}),
        "moe_sharded": ("moe-sharded", {}, {"max_shard_size": half}),
        "moe_bf16": ("moe", {}, {"dtype": torch.bfloat16}),
        "moe_fp8": ("moe-fp8", fp8, {}),
        "moe_fp8_dequantized": ("moe-fp8", fp8, {"quantization": "dequantized"}),
        "moe_fp8_runtime": ("moe-fp8", fp8, {"original_format": False}),
        "moe_int8": ("moe", int8, {}),
    }
    for name, (ckpt, load, save) in cases.items():
        model = build_moe_model(cfg, device="meta")
        _guard(
            out, name, _load_save, model, root / ckpt, root / f"{name}-out", root, save_kwargs=save, **load
        )
    _guard(
        out,
        "moe_runtime_layout",
        lambda: files_digest(_runtime_save(build_moe_model(cfg, seed=0), root / "moe-runtime")),
    )
    # fusions
    tower = build_vision_tower(seed=0)
    write_checkpoint(dict(tower.state_dict()), root / "vision")
    fused = build_vision_tower(seed=1)
    _guard(
        out,
        "vision_preview",
        lambda: text_digest(surgery.preview_fusions(fused, {"patch_embeddings": True}).render(), root),
    )
    _guard(
        out,
        "vision",
        _load_save,
        fused,
        root / "vision",
        root / "vision-saved",
        root,
        fusion_config={"patch_embeddings": True},
    )
    dec = build_decoder_model(seed=0)
    write_checkpoint(dict(dec.state_dict()), root / "decoder")
    config = {"qkv": True, "gate_up": True}
    fdec = build_decoder_model(device="meta")
    _guard(
        out,
        "decoder_preview",
        lambda: text_digest(
            surgery.preview_fusions(build_decoder_model(device="meta"), config).render(), root
        ),
    )
    _guard(
        out, "decoder", _load_save, fdec, root / "decoder", root / "decoder-saved", root, fusion_config=config
    )
    _guard(
        out,
        "decoder_reverted",
        lambda: {k: tensor_digest(v) for k, v in sorted(surgery.revert_state_dict(fdec).items())},
    )
    try:
        import transformers
    except ImportError:
        return out
    torch.manual_seed(3)
    lcfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        attn_implementation="sdpa",
    )
    transformers.LlamaForCausalLM(lcfg).eval().save_pretrained(root / "llama")
    torch.manual_seed(4)
    llama = transformers.LlamaForCausalLM(lcfg).eval()
    _guard(
        out,
        "llama_fused",
        _load_save,
        llama,
        root / "llama",
        root / "llama-saved",
        root,
        fusion_config=config,
    )
    return out


def _runtime_save(model: torch.nn.Module, out: Path) -> Path:
    import surgery

    surgery.save_checkpoint(model, out, original_format=False)
    return out


# -- tensor parallelism ----------------------------------------------------------------------------


def _tp_rank(rank: int, work: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import surgery
    from surgery.examples import (
        ExampleDecoderConfig,
        ExampleDenseConfig,
        ExampleMoEConfig,
        build_decoder_model,
        build_dense_model,
        build_moe_model,
    )
    from surgery.quantization import FP8BlockQuantizer

    root = Path(work)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    facts: dict[str, Any] = {}
    moe_cfg = ExampleMoEConfig(num_attention_heads=4, num_key_value_heads=2)
    mha = ExampleDecoderConfig(num_key_value_heads=4)
    cases = {
        "dense": (
            lambda: build_dense_model(ExampleDenseConfig(), seed=None, device="meta"),
            "dense",
            {"tp_plan": "auto"},
        ),
        "moe": (lambda: build_moe_model(moe_cfg, seed=None, device="meta"), "moe", {"tp_plan": "auto"}),
        "dense_fp8": (
            lambda: build_dense_model(ExampleDenseConfig(), seed=None, device="meta"),
            "dense-fp8",
            {"tp_plan": "auto", "quantizer": FP8BlockQuantizer(block_size=(6, 10))},
        ),
        "decoder_fused": (
            lambda: build_decoder_model(mha, seed=None, device="meta"),
            "decoder-mha",
            {"tp_plan": _qkv_plan(), "fusion_config": {"qkv": True, "gate_up": True}},
        ),
    }
    for name, (build, ckpt, kwargs) in cases.items():
        case: dict[str, Any] = {}
        try:
            model = build()
            report = surgery.load_checkpoint(model, root / ckpt, device_mesh=mesh, **kwargs)
            case["report"] = report_digest(report, root)
            case["plan"] = text_digest(report.plan.to_json(sort_keys=True), root)
            case["state"] = state_digest(model)
            dry_kwargs = {k: v for k, v in kwargs.items() if k != "quantizer"}
            dry = surgery.plan_load(build(), root / ckpt, tp_size=2, tp_rank=rank, **dry_kwargs)
            case["dry_plan"] = text_digest(dry.to_json(sort_keys=True), root)
            out = root / f"{ckpt}-saved"
            surgery.save_checkpoint(model, out)
            dist.barrier()
            if rank == 0:
                case["saved"] = files_digest(out)
        except Exception as e:
            case["error"] = f"{type(e).__name__}: {e}"[:400] + traceback.format_exc()[-600:]
        facts[name] = case
    (root / f"rank{rank}.json").write_text(json.dumps(facts, sort_keys=True))
    dist.barrier()
    dist.destroy_process_group()


def _qkv_plan() -> dict[str, Any]:
    from surgery.parallel import PackedColwiseParallel

    return {
        "model.embed_tokens": "rowwise",
        "model.layers.*.self_attn.qkv_proj": PackedColwiseParallel(split_factor=3),
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_up_proj": "packed_colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "colwise_gather",
    }


def tensor_parallel(root: Path) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from surgery.checkpoint import write_checkpoint
    from surgery.examples import (
        ExampleDecoderConfig,
        ExampleDenseConfig,
        ExampleMoEConfig,
        build_decoder_model,
        build_dense_model,
        build_moe_model,
        original_state_dict,
    )
    from surgery.examples import dense as dense_mod
    from surgery.quantization import blockwise_quantize

    work = root / "tp"
    work.mkdir(parents=True)
    write_checkpoint(
        dense_mod.original_state_dict(build_dense_model(ExampleDenseConfig(), seed=1)), work / "dense"
    )
    write_checkpoint(
        original_state_dict(
            build_moe_model(ExampleMoEConfig(num_attention_heads=4, num_key_value_heads=2), seed=2)
        ),
        work / "moe",
    )
    fp8: dict[str, torch.Tensor] = {}
    for k, v in dense_mod.original_state_dict(build_dense_model(ExampleDenseConfig(), seed=4)).items():
        if k.endswith("proj.weight"):
            fp8[k], fp8[k + "_scale_inv"] = blockwise_quantize(v, (6, 10))
        else:
            fp8[k] = v
    write_checkpoint(fp8, work / "dense-fp8")
    write_checkpoint(
        build_decoder_model(ExampleDecoderConfig(num_key_value_heads=4), seed=2).state_dict(),
        work / "decoder-mha",
    )
    mp.spawn(_tp_rank, args=(str(work),), nprocs=2, join=True)
    return {f"rank{r}": json.loads((work / f"rank{r}.json").read_text()) for r in range(2)}


# -- driver ----------------------------------------------------------------------------------------


def run(only: list[str]) -> dict[str, Any]:
    torch.manual_seed(0)
    parts = {"examples": examples, "tensor_parallel": tensor_parallel, "catalog": catalog}
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="digest-") as tmp:
        for name, part in parts.items():
            if only and name not in only:
                continue
            root = Path(tmp) / name
            root.mkdir()
            print(f"digest: {name} ...", file=sys.stderr, flush=True)
            try:
                result[name] = part(root)
            except Exception:
                result[name] = {"crash": traceback.format_exc()}
    return result


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def diff(a_path: str, b_path: str) -> int:
    a, b = _flatten(json.loads(Path(a_path).read_text())), _flatten(json.loads(Path(b_path).read_text()))
    changed = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    print(
        f"{len(a)} vs {len(b)} digests; {len(changed)} differ, {len(only_a)} only in {a_path}, {len(only_b)} only in {b_path}"
    )
    for k in changed[:60]:
        print(f"  differs: {k}: {str(a[k])[:150]!r} -> {str(b[k])[:150]!r}")
    for k in only_a[:20]:
        print(f"  only in first: {k}")
    for k in only_b[:20]:
        print(f"  only in second: {k}")
    return 1 if changed or only_a or only_b else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the digest JSON here")
    p.add_argument("--only", action="append", default=[], help="examples | tensor_parallel | catalog")
    p.add_argument("--diff", nargs=2, metavar=("OLD", "NEW"))
    args = p.parse_args()
    if args.diff:
        return diff(*args.diff)
    result = run(args.only)
    flat = _flatten(result)
    errors = {k: v for k, v in flat.items() if k.endswith("/error") or k.endswith("crash")}
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text)
    print(f"digest: {len(flat)} values, {len(errors)} errors recorded", file=sys.stderr)
    for k, v in list(errors.items())[:10]:
        print(f"  {k}: {str(v)[:300]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
