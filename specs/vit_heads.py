r"""ViT-lineage heads whose checkpoints differ from the base model's layout: BEiT, ViTMAE, ViTMSN, VideoMAE, Pixio.

The attention/MLP renames are those of :mod:`specs.vit` (``attention.query`` → ``q_proj``,
``attention.output.dense`` → ``attention.o_proj``, ``intermediate.dense`` → ``mlp.fc1``,
``output.dense`` → ``mlp.fc2``), applied to the head's own modules too (ViTMAE's decoder layers,
BEiT's backbone); ``BeitBackbone`` and ``BeitForSemanticSegmentation`` add the ``beit.`` prefix
of a base checkpoint and rename the FPN and the UperNet head (``decode_head.psp_modules.N.1``
→ ``decode_head.psp_modules.blocks.N``, ``bn``/``conv`` → ``normalization``/``convolution``).
``ViTMSNForImageClassification`` adds ``vit.``; VideoMAE's ``q_bias``/``v_bias`` become the
query/value biases.
"""

from __future__ import annotations

from surgery import WeightRenaming
from surgery.transforms import WeightTransform

__all__ = ["ALIASES", "ENTRIES"]

ENTRIES: dict[str, list[WeightTransform]] = {
    "BeitBackbone": [
        WeightRenaming(r"^fpn1\.0\.", "fpn.fpn1.conv_transpose1."),
        WeightRenaming(r"^fpn1\.1\.", "fpn.fpn1.normalization."),
        WeightRenaming(r"^fpn1\.3\.", "fpn.fpn1.conv_transpose2."),
        WeightRenaming(r"^fpn2\.0\.", "fpn.fpn2."),
        WeightRenaming(r"^encoder\.layer\.", "beit.encoder.layer."),
        WeightRenaming(r"^embeddings\.", "beit.embeddings."),
        WeightRenaming(r"attention\.query", "q_proj"),
        WeightRenaming(r"attention\.key", "k_proj"),
        WeightRenaming(r"attention\.value", "v_proj"),
        WeightRenaming(r"attention\.output\.dense", "attention.o_proj"),
        WeightRenaming(r"intermediate\.dense", "mlp.fc1"),
        WeightRenaming(r"output\.dense", "mlp.fc2"),
    ],
    "BeitForSemanticSegmentation": [
        WeightRenaming(r"(?<!psp_modules\.[0-9]\.1\.)bn\.", "normalization."),
        WeightRenaming(r"(?<!psp_modules\.[0-9]\.1\.)conv\.weight", "convolution.weight"),
        WeightRenaming(r"^fpn1\.0\.", "fpn.fpn1.conv_transpose1."),
        WeightRenaming(r"^fpn1\.1\.", "fpn.fpn1.normalization."),
        WeightRenaming(r"^fpn1\.3\.", "fpn.fpn1.conv_transpose2."),
        WeightRenaming(r"^fpn2\.0\.", "fpn.fpn2."),
        WeightRenaming(r"decode_head\.bottleneck\.", "decode_head.psp_bottleneck."),
        WeightRenaming(
            r"decode_head\.psp_modules\.(\d+)\.1\.conv\.weight",
            r"decode_head.psp_modules.blocks.\1.conv.convolution.weight",
        ),
        WeightRenaming(
            r"decode_head\.psp_modules\.(\d+)\.1\.bn\.",
            r"decode_head.psp_modules.blocks.\1.conv.normalization.",
        ),
    ],
    "ViTMAEForPreTraining": [
        WeightRenaming(r"attention\.query", "q_proj"),
        WeightRenaming(r"attention\.key", "k_proj"),
        WeightRenaming(r"attention\.value", "v_proj"),
        WeightRenaming(r"attention\.output\.dense", "attention.o_proj"),
        WeightRenaming(r"intermediate\.dense", "mlp.fc1"),
        WeightRenaming(r"output\.dense", "mlp.fc2"),
    ],
    "ViTMSNForImageClassification": [
        WeightRenaming(r"^encoder\.", "vit.encoder."),
    ],
    "videomae": [
        WeightRenaming(r"attention\.attention\.q_bias", "attention.attention.query.bias"),
        WeightRenaming(r"attention\.attention\.v_bias", "attention.attention.value.bias"),
    ],
    "pixio": [
        WeightRenaming(r"encoder\.layer\.", "layers."),
        WeightRenaming(r"attention\.query", "q_proj"),
        WeightRenaming(r"attention\.key", "k_proj"),
        WeightRenaming(r"attention\.value", "v_proj"),
        WeightRenaming(r"attention\.output\.dense", "attention.o_proj"),
        WeightRenaming(r"intermediate\.dense", "mlp.fc1"),
        WeightRenaming(r"output\.dense", "mlp.fc2"),
        WeightRenaming("norm1", "layernorm_before"),
        WeightRenaming("norm2", "layernorm_after"),
        WeightRenaming(r"^encoder\.", "pixio."),
    ],
}

ALIASES: dict[str, str] = {}
