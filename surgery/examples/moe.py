"""A small Mixtral-style mixture-of-experts language model in pure torch.

Its runtime layout is the fused-experts layout transformers 5 uses
(``model.layers.{i}.mlp.experts.gate_up_proj`` of shape ``(E, 2*I, H)`` and ``down_proj`` of
shape ``(E, H, I)``); :func:`original_state_dict` writes the classic per-expert checkpoint layout
(``model.layers.{i}.block_sparse_moe.experts.{e}.w1/w2/w3.weight``) by hand, independently of
the conversion engine, so tests and the demo compare the engine against an independent truth.
The model declares ``config.model_type = "mixtral"``, so the built-in catalog's Mixtral mapping
applies to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import ATTENTION_TP_PLAN, Decoder, instantiate

__all__ = [
    "ExampleMoEConfig",
    "ExampleMoEExperts",
    "ExampleMoEForCausalLM",
    "ExampleMoEModel",
    "build_moe_model",
    "original_state_dict",
]


@dataclass
class ExampleMoEConfig:
    """Hyper-parameters of the example model (tiny by default)."""

    model_type: str = "mixtral"
    vocab_size: int = 64
    hidden_size: int = 16
    intermediate_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads.")
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError("num_experts_per_tok must be between 1 and num_local_experts.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _normal(t: torch.Tensor, std: float) -> torch.Tensor:
    """``t`` filled from N(0, std²); a ``meta`` tensor is left as it is (nothing to compute)."""
    return t if t.device.type == "meta" else t.normal_(0.0, std)


class ExampleMoEExperts(nn.Module):
    """All experts of one layer as two fused parameters."""

    def __init__(self, cfg: ExampleMoEConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.num_experts, self.intermediate_size = e, i
        self.gate_up_proj = nn.Parameter(_normal(torch.empty(e, 2 * i, h), h**-0.5))
        self.down_proj = nn.Parameter(_normal(torch.empty(e, h, i), i**-0.5))

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, slot = torch.nonzero(top_idx == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, rows, y * top_w[rows, slot, None])
        return out


class _MoEBlock(nn.Module):
    def __init__(self, cfg: ExampleMoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        self.experts = ExampleMoEExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = self.gate(flat).softmax(-1)
        top_w, top_idx = probs.topk(self.top_k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        return self.experts(flat, top_idx, top_w.to(x.dtype)).reshape(shape)


class ExampleMoEModel(Decoder):
    """The decoder stack (the base model).

    ``base_model_prefix = "model"`` follows the transformers convention: a checkpoint saved from
    the model with a head (keys under ``model.``) loads into this bare base model, and the reverse.
    """

    base_model_prefix = "model"

    def __init__(self, cfg: ExampleMoEConfig) -> None:
        super().__init__(cfg, _MoEBlock)


class ExampleMoEForCausalLM(nn.Module):
    """Base model plus a language-model head; ``base_model_prefix = "model"``.

    ``tp_plan`` is the tensor-parallel plan ``load_checkpoint(..., tp_plan="auto")`` applies:
    attention heads split across ranks (q/k/v colwise, o rowwise), experts sharded on their
    intermediate dim, the embedding by vocabulary rows and whole logits from the head. ``ep_plan``
    is what ``tp_plan="auto"`` applies on a mesh named ``"ep"``: whole experts per rank.
    """

    base_model_prefix = "model"
    tp_plan = {**ATTENTION_TP_PLAN, "model.layers.*.mlp.experts": "experts"}
    ep_plan = {"model.layers.*.mlp.experts": "expert_parallel"}

    def __init__(self, cfg: ExampleMoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = ExampleMoEModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


def build_moe_model(
    config: ExampleMoEConfig | None = None,
    *,
    seed: int | None = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> ExampleMoEForCausalLM:
    """Build the example model with random weights (``device="meta"`` builds it without storage).

    Example:
        >>> model = build_moe_model()
        >>> tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape)
        (4, 64, 16)
    """
    cfg = config or ExampleMoEConfig()
    return instantiate(lambda: ExampleMoEForCausalLM(cfg), seed=seed, device=device, dtype=dtype)


def original_state_dict(model: ExampleMoEForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights in the classic Mixtral checkpoint layout, written by hand.

    ``gate_up_proj[e]`` is ``cat(w1_e, w3_e)`` along rows and ``down_proj[e]`` is ``w2_e``;
    the MoE block is named ``block_sparse_moe``.
    """
    out: dict[str, torch.Tensor] = {}
    inter = model.config.intermediate_size
    for key, value in model.state_dict().items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            base = key.removesuffix(".mlp.experts.gate_up_proj") + ".block_sparse_moe.experts"
            for e in range(value.shape[0]):
                out[f"{base}.{e}.w1.weight"] = value[e, :inter].clone()
                out[f"{base}.{e}.w3.weight"] = value[e, inter:].clone()
        elif key.endswith(".mlp.experts.down_proj"):
            base = key.removesuffix(".mlp.experts.down_proj") + ".block_sparse_moe.experts"
            for e in range(value.shape[0]):
                out[f"{base}.{e}.w2.weight"] = value[e].clone()
        else:
            out[key.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = value.clone()
    return out
