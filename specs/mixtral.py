r"""Mixtral-style sparse MoE: per-expert ``w1``/``w3``/``w2`` lists ↔ fused expert tensors.

Original layout (hub checkpoints)::

    model.layers.N.block_sparse_moe.gate.weight            [E, H]
    model.layers.N.block_sparse_moe.experts.{e}.w1.weight  [I, H]   (gate)
    model.layers.N.block_sparse_moe.experts.{e}.w3.weight  [I, H]   (up)
    model.layers.N.block_sparse_moe.experts.{e}.w2.weight  [H, I]   (down)

Runtime layout::

    model.layers.N.mlp.gate.weight                         [E, H]
    model.layers.N.mlp.experts.gate_up_proj                [E, 2I, H]  (gate_up[e] = cat(w1_e, w3_e))
    model.layers.N.mlp.experts.down_proj                   [E, H, I]   (down[e] = w2_e)

``minimax`` shares the layout exactly; ``minimax_m2`` adds one rename for its router bias.
"""

from __future__ import annotations

from surgery import WeightConverter, WeightRenaming, ops
from surgery.transforms import WeightTransform

__all__ = ["ALIASES", "ENTRIES"]

_RENAME_BLOCK = WeightRenaming(r"\.block_sparse_moe\.", ".mlp.")

_EXPERTS: list[WeightTransform] = [
    WeightConverter(
        [r"\.experts\.*\.w1\.weight", r"\.experts\.*\.w3\.weight"],
        ".experts.gate_up_proj",
        [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
    ),
    WeightConverter(r"\.experts\.*\.w2\.weight", ".experts.down_proj", [ops.MergeModulelist(dim=0)]),
]

ENTRIES: dict[str, list[WeightTransform]] = {
    "mixtral": [_RENAME_BLOCK, *_EXPERTS],
    "minimax_m2": [
        _RENAME_BLOCK,
        WeightRenaming(r"\.block_sparse_moe\.e_score_correction_bias", ".mlp.e_score_correction_bias"),
        *_EXPERTS,
    ],
}
"""Registry key → transform list (unscoped prototypes; the registry hands out copies)."""

ALIASES: dict[str, str] = {
    "minimax": "mixtral",
}
"""Registry key → the key whose mapping it shares."""
