"""Building blocks shared by the example decoders: RMSNorm, grouped-query attention, the
pre-norm decoder layer and the decoder stack (each example brings its own MLP).

The attention derives its head counts from the projections' output sizes at run time, so the
same module runs whole or tensor-parallel (q/k/v colwise: each rank holds whole heads).
``config`` below is any object with ``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
``num_attention_heads``, ``num_key_value_heads`` and ``rms_norm_eps``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ..empty import init_empty

_M = TypeVar("_M", bound=nn.Module)

__all__ = ["ATTENTION_TP_PLAN", "Attention", "Decoder", "DecoderLayer", "RMSNorm", "instantiate"]

ATTENTION_TP_PLAN = {
    "model.embed_tokens": "rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "lm_head": "colwise_gather",
}
"""The tensor-parallel plan of everything but the MLP: heads split across ranks (q/k/v colwise,
o rowwise), the embedding by vocabulary rows, whole logits from the head."""


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    """Causal grouped-query attention with separate ``q_proj``/``k_proj``/``v_proj``/``o_proj``."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (``mlp(config)`` builds it)."""

    def __init__(self, config: Any, mlp: Callable[[Any], nn.Module]) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = Attention(h, config.num_attention_heads, config.num_key_value_heads)
        self.mlp = mlp(config)  # built after the attention: the examples' seeded weights stay as they were
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Token embedding, ``num_hidden_layers`` :class:`DecoderLayer` s with ``mlp(config)`` each, a final norm."""

    def __init__(self, config: Any, mlp: Callable[[Any], nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, mlp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def instantiate(
    factory: Callable[[], _M],
    *,
    seed: int | None,
    device: torch.device | str | None,
    dtype: torch.dtype | None = None,
) -> _M:
    """Build an example model: seeded (``None``: the global RNG as it is), on ``device``; on
    ``meta`` without storage or computed init (:func:`~surgery.empty.init_empty`); cast to ``dtype``."""
    if seed is not None:
        torch.manual_seed(seed)
    if device is not None and torch.device(device).type == "meta":
        with init_empty(include_buffers=True):  # the examples have no buffers: all on meta, no init computed
            model = factory()
    else:
        with torch.device(device or "cpu"):
            model = factory()
    return model if dtype is None else model.to(dtype)
