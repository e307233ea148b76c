r"""DETR: backbone wrapper, attention output and decoder-layer MLP renames; segmentation head.

Original layout (hub checkpoints of ``DetrModel``)::

    backbone.conv_encoder.model.X          encoder.layers.N.self_attn.out_proj.weight
    encoder.layers.N.fc1.weight            decoder.layers.N.fc2.weight

Runtime layout::

    backbone.model.X                       encoder.layers.N.self_attn.o_proj.weight
    encoder.layers.N.mlp.fc1.weight        decoder.layers.N.mlp.fc2.weight

``DetrForSegmentation`` (and ``ConditionalDetrForSegmentation``, whose head is the same) renames
its bbox attention and mask head; the inner ``DetrModel`` entry applies scoped to ``detr.model``.
MaskFormer's DETR decoder is a ``MaskFormerDetrDecoder`` (an alias of ``DetrModel``), and the
``maskformer`` model type repeats the two ``fc1``/``fc2`` renames at the root, as in the reference.
"""

from __future__ import annotations

from surgery import WeightRenaming
from surgery.transforms import WeightTransform

__all__ = ["ALIASES", "ENTRIES"]

_LAYER_MLP: list[WeightTransform] = [
    WeightRenaming(r"layers\.(\d+)\.fc1", r"layers.\1.mlp.fc1"),
    WeightRenaming(r"layers\.(\d+)\.fc2", r"layers.\1.mlp.fc2"),
]

_SEGMENTATION_HEAD: list[WeightTransform] = [
    WeightRenaming(r"bbox_attention\.q_linear", "bbox_attention.q_proj"),
    WeightRenaming(r"bbox_attention\.k_linear", "bbox_attention.k_proj"),
    WeightRenaming(r"mask_head\.lay1", "mask_head.conv1.conv"),
    WeightRenaming(r"mask_head\.gn1", "mask_head.conv1.norm"),
    WeightRenaming(r"mask_head\.lay2", "mask_head.conv2.conv"),
    WeightRenaming(r"mask_head\.gn2", "mask_head.conv2.norm"),
    WeightRenaming(r"mask_head\.adapter1", "mask_head.fpn_stages.0.fpn_adapter"),
    WeightRenaming(r"mask_head\.lay3", "mask_head.fpn_stages.0.refine.conv"),
    WeightRenaming(r"mask_head\.gn3", "mask_head.fpn_stages.0.refine.norm"),
    WeightRenaming(r"mask_head\.adapter2", "mask_head.fpn_stages.1.fpn_adapter"),
    WeightRenaming(r"mask_head\.lay4", "mask_head.fpn_stages.1.refine.conv"),
    WeightRenaming(r"mask_head\.gn4", "mask_head.fpn_stages.1.refine.norm"),
    WeightRenaming(r"mask_head\.adapter3", "mask_head.fpn_stages.2.fpn_adapter"),
    WeightRenaming(r"mask_head\.lay5", "mask_head.fpn_stages.2.refine.conv"),
    WeightRenaming(r"mask_head\.gn5", "mask_head.fpn_stages.2.refine.norm"),
    WeightRenaming(r"mask_head\.out_lay", "mask_head.output_conv"),
]

ENTRIES: dict[str, list[WeightTransform]] = {
    "DetrModel": [
        WeightRenaming(r"backbone\.conv_encoder", "backbone"),
        WeightRenaming("out_proj", "o_proj"),
        *_LAYER_MLP,
    ],
    "DetrForSegmentation": [*_SEGMENTATION_HEAD],
    "ConditionalDetrForSegmentation": [*_SEGMENTATION_HEAD],
    "maskformer": [*_LAYER_MLP],
}
"""Registry key → transform list (unscoped prototypes; the registry hands out copies)."""

ALIASES: dict[str, str] = {
    "MaskFormerDetrDecoder": "DetrModel",
}
"""Registry key → the key whose mapping it shares."""
