"""A plain Llama-style decoder whose runtime layout is its checkpoint layout: the sibling fusions' example.

Every projection is its own ``nn.Linear`` (``self_attn.q_proj`` / ``k_proj`` / ``v_proj`` /
``o_proj``, ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``), as in a Llama checkpoint, so a
checkpoint saved from it loads with no conversion mapping at all. The ``qkv`` and ``gate_up``
fusions (``specs/sibling_linears.py``) find the sibling projections in its dataflow and fuse
them; the fusions' own weight transforms then load and save this layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Decoder, instantiate

__all__ = ["ExampleDecoderConfig", "ExampleDecoderForCausalLM", "GatedMLP", "build_decoder_model"]


@dataclass
class ExampleDecoderConfig:
    """Hyper-parameters of the example decoder (tiny by default; ``model_type`` has no mapping)."""

    model_type: str = "example_decoder"
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 48
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    bias: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "hidden_size must divide into num_attention_heads, and those into num_key_value_heads."
            )


class GatedMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, cfg: ExampleDecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExampleDecoderForCausalLM(nn.Module):
    """Decoder plus a language-model head; ``base_model_prefix = "model"``."""

    base_model_prefix = "model"

    def __init__(self, cfg: ExampleDecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg, GatedMLP)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


def build_decoder_model(
    config: ExampleDecoderConfig | None = None,
    *,
    seed: int | None = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> ExampleDecoderForCausalLM:
    """Build the example decoder with random weights (``device="meta"`` builds it without storage).

    Example:
        >>> model = build_decoder_model()
        >>> tuple(model.model.layers[0].self_attn.k_proj.weight.shape)
        (16, 32)
    """
    cfg = config or ExampleDecoderConfig()
    return instantiate(lambda: ExampleDecoderForCausalLM(cfg), seed=seed, device=device, dtype=dtype)
