r"""ViT-style encoders: BERT-era attention/MLP names → the modular ``layers.N.*`` names.

Original layout (hub checkpoints)::

    encoder.layer.N.attention.attention.query.weight    encoder.layer.N.attention.output.dense.weight
    encoder.layer.N.intermediate.dense.weight           encoder.layer.N.output.dense.weight

Runtime layout::

    layers.N.attention.q_proj.weight                    layers.N.attention.o_proj.weight
    layers.N.mlp.fc1.weight                             layers.N.mlp.fc2.weight

The order is part of the mapping: ``attention.output.dense`` is renamed before the generic
``output.dense`` can claim it. ``BeitModel`` adds its relative-position-bias renames on top.
Models with a head (``ViTForImageClassification``) pick the entry up scoped to their ``vit``
sub-model.
"""

from __future__ import annotations

from surgery import WeightRenaming
from surgery.transforms import WeightTransform

__all__ = ["ALIASES", "ENTRIES"]

_VIT: list[WeightTransform] = [
    WeightRenaming(r"encoder\.layer\.", "layers."),
    WeightRenaming(r"attention\.query", "q_proj"),
    WeightRenaming(r"attention\.key", "k_proj"),
    WeightRenaming(r"attention\.value", "v_proj"),
    WeightRenaming(r"attention\.output\.dense", "attention.o_proj"),
    WeightRenaming(r"intermediate\.dense", "mlp.fc1"),
    WeightRenaming(r"output\.dense", "mlp.fc2"),
]

ENTRIES: dict[str, list[WeightTransform]] = {
    "ViTModel": [*_VIT],
    "BeitModel": [
        *_VIT,
        WeightRenaming(r"encoder\.relative_position_bias", "shared_position_bias"),
        WeightRenaming(
            r"attention\.attention\.relative_position_bias\.relative_position_bias_table",
            "relative_position_bias.relative_position_bias_table",
        ),
    ],
}
"""Registry key → transform list (unscoped prototypes; the registry hands out copies)."""

ALIASES: dict[str, str] = {
    "ASTModel": "ViTModel",
    "DeiTModel": "ViTModel",
    "IJepaModel": "ViTModel",
    "ViTMAEModel": "ViTModel",
    "ViTMSNModel": "ViTModel",
    "VivitModel": "ViTModel",
}
"""Registry key → the key whose mapping it shares."""
