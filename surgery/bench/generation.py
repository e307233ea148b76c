"""Benchmark: ``generate()`` tokens/s of a transformers Llama, unfused and fused with ``qkv`` + ``gate_up``.

Part 4 of ``surgery bench fusion`` (``--part generate``; needs transformers). Two Llama-shaped
models are built with random weights: ``tiny`` (hidden 64, 2 layers) and ``100m`` (hidden 768,
12 layers, 12/4 heads, MLP 2048, vocabulary 32000, tied embeddings: 97M parameters). Each is
timed in float32 and bfloat16 with sdpa attention: greedy ``generate()`` of ``--new-tokens``
tokens after a ``--prompt``-token prompt (batch 1, dynamic cache), unfused and fused in
interleaved rounds, reported as new tokens per second (median). The fused model's tokens are
checked to equal the unfused ones. Then one decode step of each is profiled and the ops that
take the most time are listed, to say where the time goes.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
from torch import nn

from ..fusion import apply_fusions

__all__ = ["MODELS", "run_generate"]

MODELS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128),
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
}  # fmt: skip


def _build(name: str, dtype: torch.dtype) -> nn.Module:
    import transformers  # optional: only this benchmark needs it

    config_cls: Any = transformers.LlamaConfig  # its typed signature does not list every kwarg it takes
    config = config_cls(
        **MODELS[name],
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model.to(dtype).eval()


def _generate(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out: torch.Tensor = model.generate(  # type: ignore[operator]
        prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )
    return out


def _tokens_per_second(
    models: dict[str, nn.Module], prompt: torch.Tensor, *, new_tokens: int, rounds: int
) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in models}
    for model in models.values():
        _generate(model, prompt, 2)  # warm up
    for _ in range(rounds):
        for key, model in models.items():
            start = time.perf_counter()
            _generate(model, prompt, new_tokens)
            times[key].append(time.perf_counter() - start)
    return {k: new_tokens / statistics.median(v) for k, v in times.items()}


def _where_the_time_goes(model: nn.Module, prompt: torch.Tensor, *, top: int) -> list[tuple[str, float, int]]:
    """Self CPU time (ms) and calls of the ``top`` busiest ops in one decode step."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        first = model(prompt, use_cache=True)
        step = prompt[:, -1:]
        model(step, past_key_values=copy.deepcopy(first.past_key_values))  # warm up
        cache = first.past_key_values
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(step, past_key_values=cache)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in events[:top]]


def run_generate(*, prompt: int = 32, new_tokens: int = 32, rounds: int = 5, top: int = 6) -> dict[str, Any]:
    """Time generate() of both models in both dtypes, fused and not; print a table, return tokens/s."""
    print(
        f"generate(): greedy, batch 1, {prompt}-token prompt, {new_tokens} new tokens, sdpa, dynamic cache; "
        f"threads={torch.get_num_threads()}; median of {rounds} interleaved rounds"
    )
    print(f"{'model':>6} {'dtype':>9} {'unfused tok/s':>14} {'fused tok/s':>12} {'fused/unfused':>13}")
    results: dict[str, Any] = {}
    ids = torch.randint(1, 128, (1, prompt), generator=torch.Generator().manual_seed(0))
    for name in MODELS:
        for dtype in (torch.float32, torch.bfloat16):
            unfused = _build(name, dtype)
            fused = copy.deepcopy(unfused)
            apply_fusions(fused, {"qkv": True, "gate_up": True}, strict=True)
            with torch.inference_mode():
                if not torch.equal(_generate(fused, ids, 8), _generate(unfused, ids, 8)):
                    raise AssertionError(f"{name} {dtype}: the fused model generated other tokens")
                t = _tokens_per_second(
                    {"unfused": unfused, "fused": fused}, ids, new_tokens=new_tokens, rounds=rounds
                )
            key = f"{name} {str(dtype).removeprefix('torch.')}"
            results[key] = t
            print(
                f"{name:>6} {str(dtype).removeprefix('torch.'):>9} {t['unfused']:14.1f} {t['fused']:12.1f} "
                f"{t['fused'] / t['unfused']:12.2f}x"
            )
            if dtype == torch.float32:
                for label, model in (("unfused", unfused), ("fused", fused)):
                    ops = _where_the_time_goes(model, ids, top=top)
                    total = sum(ms for _, ms, _ in ops)
                    shown = ", ".join(f"{op} {ms:.2f} ms ({n})" for op, ms, n in ops)
                    results[f"{key} profile {label}"] = ops
                    print(
                        f"    one decode step, {label}, top {top} ops by self CPU time ({total:.2f} ms): {shown}"
                    )
    return results
