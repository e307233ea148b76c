r"""The dense example decoder (``surgery.examples.dense``): Llama's checkpoint layout ↔ a fused MLP.

Original layout::

    model.layers.N.mlp.gate_proj.weight       [I, H]
    model.layers.N.mlp.up_proj.weight         [I, H]
    model.layers.N.self_attn.q_proj.weight    [heads*D, H]     (RoPE pairs interleaved)
    model.layers.N.self_attn.k_proj.weight    [kv_heads*D, H]  (RoPE pairs interleaved)

Runtime layout::

    model.layers.N.mlp.gate_up_proj.weight    [2I, H]          (cat(gate, up) along rows)
    model.layers.N.self_attn.q_proj.weight    [heads*D, H]     (split-half RoPE rows)
    model.layers.N.self_attn.k_proj.weight    [kv_heads*D, H]
"""

from __future__ import annotations

from surgery import WeightConverter, ops
from surgery.transforms import WeightTransform

__all__ = ["ALIASES", "ENTRIES"]

ENTRIES: dict[str, list[WeightTransform]] = {
    "dense_example": [
        WeightConverter(
            [r"\.mlp\.gate_proj\.weight", r"\.mlp\.up_proj\.weight"],
            ".mlp.gate_up_proj.weight",
            [ops.Concatenate(dim=0)],
        ),
        WeightConverter(
            r"\.self_attn\.q_proj\.weight",
            ".self_attn.q_proj.weight",
            [ops.PermuteForRope(config_attribute="num_attention_heads")],
        ),
        WeightConverter(
            r"\.self_attn\.k_proj\.weight",
            ".self_attn.k_proj.weight",
            [ops.PermuteForRope(config_attribute="num_key_value_heads")],
        ),
    ],
}
"""Registry key → transform list."""

ALIASES: dict[str, str] = {}
