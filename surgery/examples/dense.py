"""A small dense Llama-style decoder in pure torch, with a fused MLP in its runtime layout.

The checkpoint layout is Llama's (``mlp.gate_proj`` / ``mlp.up_proj`` / ``mlp.down_proj``,
``self_attn.q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``), with ``q_proj`` and ``k_proj``
rows stored in the interleaved RoPE pair order of Meta's original release. The runtime layout
fuses the MLP input projections into one ``mlp.gate_up_proj`` (``[gate; up]`` rows) and keeps
q/k rows in the split-half order. :func:`original_state_dict` writes the checkpoint layout by
hand, independently of the engine; the catalog's ``dense_example`` mapping
(``specs/dense_example.py``, registered like any family) converts between the two.

``tp_plan`` shards it for tensor parallelism: heads colwise, the fused MLP ``packed_colwise``
(each rank holds its share of the gate rows and of the up rows), ``o_proj``/``down_proj``
rowwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import ATTENTION_TP_PLAN, Decoder, instantiate

__all__ = [
    "ExampleDenseConfig",
    "ExampleDenseForCausalLM",
    "build_dense_model",
    "original_state_dict",
    "rope_interleave",
]


@dataclass
class ExampleDenseConfig:
    """Hyper-parameters of the example model (tiny by default)."""

    model_type: str = "dense_example"
    vocab_size: int = 64
    hidden_size: int = 16
    intermediate_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "hidden_size must divide into num_attention_heads, and those into num_key_value_heads."
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("the head size must be even (RoPE pairs).")


class _MLP(nn.Module):
    def __init__(self, cfg: ExampleDenseConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class ExampleDenseForCausalLM(nn.Module):
    """Decoder plus a language-model head; ``base_model_prefix = "model"``."""

    base_model_prefix = "model"
    tp_plan = {
        **ATTENTION_TP_PLAN,
        "model.layers.*.mlp.gate_up_proj": "packed_colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
    }

    def __init__(self, cfg: ExampleDenseConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg, _MLP)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


def build_dense_model(
    config: ExampleDenseConfig | None = None,
    *,
    seed: int | None = 0,
    device: torch.device | str | None = None,
) -> ExampleDenseForCausalLM:
    """Build the example model with random weights (``device="meta"`` builds it without storage).

    Example:
        >>> tuple(build_dense_model().model.layers[0].mlp.gate_up_proj.weight.shape)
        (64, 16)
    """
    cfg = config or ExampleDenseConfig()
    return instantiate(lambda: ExampleDenseForCausalLM(cfg), seed=seed, device=device)


def rope_interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Split-half RoPE rows (``[x0..x_{d/2-1}, y0..]`` per head) to interleaved pairs (``[x0, y0, ...]``)."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(rows, *w.shape[1:]).contiguous()


def original_state_dict(model: ExampleDenseForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights in the checkpoint layout, written by hand (see the module docstring)."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key.endswith(".mlp.gate_up_proj.weight"):
            base = key.removesuffix(".gate_up_proj.weight")
            out[f"{base}.gate_proj.weight"] = value[: cfg.intermediate_size].clone()
            out[f"{base}.up_proj.weight"] = value[cfg.intermediate_size :].clone()
        elif key.endswith(".self_attn.q_proj.weight"):
            out[key] = rope_interleave(value, cfg.num_attention_heads)
        elif key.endswith(".self_attn.k_proj.weight"):
            out[key] = rope_interleave(value, cfg.num_key_value_heads)
        else:
            out[key] = value.clone()
    return out
