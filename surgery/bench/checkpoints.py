"""The Mixtral-style checkpoints the load and save benchmarks read, written once per work directory.

:func:`config_for_size` gives checkpoint A (large tensors, ~``size_gb`` GiB), :func:`per_key_config`
checkpoint B (~100,000 tiny tensors); :func:`prepare` writes ``workdir/NAME/original`` (the
per-expert layout, 500 MB shards, with a transformers ``config.json`` when transformers is
installed) and optionally the runtime-layout file, and reuses them while their stamp matches.
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from ..examples.moe import ExampleMoEConfig, ExampleMoEForCausalLM, build_moe_model, original_state_dict

__all__ = ["config_for_size", "empty_model", "per_key_config", "prepare"]

_STAMP = "bench-stamp.json"


def config_for_size(size_gb: float) -> ExampleMoEConfig:
    """A Mixtral-like configuration (hidden 1024, intermediate 1792, 8 experts) of ~``size_gb`` GiB in bf16."""
    one = ExampleMoEConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=1792,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    one_bytes, two_bytes = _param_bytes(one), _param_bytes(replace(one, num_hidden_layers=2))
    per_layer, fixed = two_bytes - one_bytes, 2 * one_bytes - two_bytes
    return replace(one, num_hidden_layers=max(1, round((size_gb * 2**30 - fixed) / per_layer)))


def per_key_config(
    layers: int = 32, experts: int = 1024, *, width: int = 16, vocab: int = 64
) -> ExampleMoEConfig:
    """A tiny-tensor configuration: ``layers * experts * 3`` expert keys of ``width x width``
    (512 bytes each in bf16 at the default width)."""
    return ExampleMoEConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=experts,
        num_experts_per_tok=2,
    )


def _param_bytes(cfg: ExampleMoEConfig) -> int:
    model = build_moe_model(cfg, seed=None, device="meta", dtype=torch.bfloat16)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _largest_merge_group(cfg: ExampleMoEConfig) -> int:
    """Bytes of the largest converter output (one layer's ``gate_up_proj``)."""
    return cfg.num_local_experts * 2 * cfg.intermediate_size * cfg.hidden_size * 2


def _write_hf_config(cfg: ExampleMoEConfig, directory: Path) -> bool:
    try:
        from transformers import MixtralConfig
    except ImportError:
        return False
    MixtralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        num_local_experts=cfg.num_local_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ).save_pretrained(directory)
    return True


def empty_model(cfg: ExampleMoEConfig) -> ExampleMoEForCausalLM:
    """The runtime model with allocated but uninitialized bf16 storage (no random init cost)."""
    return build_moe_model(cfg, seed=None, device="meta", dtype=torch.bfloat16).to_empty(device="cpu")


def _filled_model(cfg: ExampleMoEConfig) -> ExampleMoEForCausalLM:
    """The runtime model with cheap pseudo-random weights: slices of one random pool."""
    model = empty_model(cfg)
    largest = max(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(largest + 4099, generator=gen, dtype=torch.bfloat16)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            start = (i * 997) % 4099
            p.view(-1).copy_(pool[start : start + p.numel()])
    return model


def prepare(workdir: Path, name: str, cfg: ExampleMoEConfig, *, runtime_file: bool) -> dict[str, Any]:
    """Write (or reuse) ``workdir/name/original`` (per-expert, sharded) and the runtime-layout file."""
    from ..checkpoint import write_checkpoint

    root = workdir / name
    stamp = {"config": asdict(cfg), "runtime_file": runtime_file, "version": 1}
    stamp_path = root / _STAMP
    original, runtime = root / "original", root / "runtime.safetensors"
    if stamp_path.is_file() and json.loads(stamp_path.read_text()) == stamp:
        info = json.loads((root / "info.json").read_text())
        info["generated_s"] = 0.0
        return info
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    start = time.perf_counter()
    model = _filled_model(cfg)
    state = original_state_dict(model)
    files = write_checkpoint(state, original, max_shard_size="500MB")
    has_hf = _write_hf_config(cfg, original)
    if runtime_file:
        from safetensors.torch import save_file

        save_file(model.state_dict(), runtime)
    info = {
        "model_bytes": sum(t.nbytes for t in model.state_dict().values()),
        "keys": len(state),
        "shards": sum(f.name.endswith(".safetensors") for f in files),
        "hf_config": has_hf,
        "largest_group": _largest_merge_group(cfg),
        "generated_s": time.perf_counter() - start,
    }
    del model, state
    gc.collect()
    (root / "info.json").write_text(json.dumps(info))
    stamp_path.write_text(json.dumps(stamp))
    return info
