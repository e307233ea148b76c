"""Benchmark: build a :class:`~surgery.graph.ModuleGraph` of a 100-layer decoder.

Run ``python -m surgery.bench.graph [--layers N] [--repeat R]``. The model is built on the
``meta`` device (no storage), so only the graph build is timed; it prints the module count and
the best and median build times.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch
from torch import nn

from surgery.graph import ModuleGraph
from surgery.resolution import get_model_conversion_mapping

from .harness import parser as bench_parser
from .harness import positive_int

__all__ = ["build_decoder", "main"]


class _Attention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, 4 * hidden, bias=False)
        self.up_proj = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down_proj = nn.Linear(4 * hidden, hidden, bias=False)


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.self_attn = _Attention(hidden)
        self.mlp = _MLP(hidden)
        self.input_layernorm = nn.LayerNorm(hidden)
        self.post_attention_layernorm = nn.LayerNorm(hidden)


class _Decoder(nn.Module):
    def __init__(self, layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type="bench_decoder")
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)


class _CausalLM(nn.Module):
    def __init__(self, layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type="bench_decoder")
        self.model = _Decoder(layers, hidden, vocab)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied, as in most decoders


def build_decoder(layers: int = 100, hidden: int = 4096, vocab: int = 32000) -> nn.Module:
    """A Llama-shaped decoder (attention q/k/v/o, gated MLP, two norms per block) on ``meta``."""
    with torch.device("meta"):
        return _CausalLM(layers, hidden, vocab)


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("graph", __doc__)
    parser.add_argument("--layers", type=positive_int, default=100, help="decoder layers (default 100)")
    parser.add_argument("--repeat", type=positive_int, default=7, help="timed builds (default 7)")
    args = parser.parse_args(argv)
    model = build_decoder(args.layers)
    ModuleGraph(model)  # warm-up: first registry access loads the catalogs
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        graph = ModuleGraph(model)
        times.append(time.perf_counter() - start)
    resolve = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        get_model_conversion_mapping(model, graph=graph)
        resolve.append(time.perf_counter() - start)
    print(
        f"model: {args.layers} layers, {len(graph)} modules, {sum(1 for _ in graph.submodels())} sub-model(s)"
    )
    print(
        f"ModuleGraph build: best {min(times) * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms "
        f"({args.repeat} runs)"
    )
    print(f"resolution (graph given): median {statistics.median(resolve) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
