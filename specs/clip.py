r"""CLIP / SigLIP towers loaded on their own: the tower prefix disappears.

Original layout (a ``CLIPModel``/``SiglipModel`` checkpoint, or a tower saved from one)::

    vision_model.embeddings.patch_embedding.weight     text_model.embeddings.token_embedding.weight

Runtime layout of a standalone ``CLIPVisionModel`` / ``CLIPTextModel``::

    embeddings.patch_embedding.weight                  embeddings.token_embedding.weight

Registered by class name on purpose: classes that share a ``model_type`` keep different layouts
(``CLIPVisionModelWithProjection`` is ``clip_vision_model`` too, but keeps ``vision_model.`` at
runtime). A standalone tower, and a tower inside a Llava-style model, save with the prefix (the
hub layout) whether or not they were loaded from a file. Inside a dual encoder (``CLIPModel``,
``AltCLIPModel``) the towers are scoped to ``vision_model`` / ``text_model`` themselves: the rule
only fires on a doubled prefix, and saving inverts it only when it fired.

``mlcd``, ``mlcd_vision``, ``xCLIPVisionModel`` and ``xCLIPTextModel`` are kept for parity with the
reference although no class or model type of that name exists in transformers 5.23.
"""

from __future__ import annotations

from surgery import PrefixChange
from surgery.transforms import WeightTransform

__all__ = ["ALIASES", "ENTRIES"]

ENTRIES: dict[str, list[WeightTransform]] = {
    "CLIPVisionModel": [PrefixChange(prefix_to_remove="vision_model")],
    "CLIPTextModel": [PrefixChange(prefix_to_remove="text_model")],
}
"""Registry key → transform list (unscoped prototypes; the registry hands out copies)."""

ALIASES: dict[str, str] = {
    "AltCLIPVisionModel": "CLIPVisionModel",
    "ChineseCLIPVisionModel": "CLIPVisionModel",
    "CLIPSegVisionModel": "CLIPVisionModel",
    "MetaClip2VisionModel": "CLIPVisionModel",
    "SiglipVisionModel": "CLIPVisionModel",
    "Siglip2VisionModel": "CLIPVisionModel",
    "mlcd": "CLIPVisionModel",
    "mlcd_vision": "CLIPVisionModel",
    "xCLIPVisionModel": "CLIPVisionModel",
    "CLIPSegTextModel": "CLIPTextModel",
    "MetaClip2TextModel": "CLIPTextModel",
    "SiglipTextModel": "CLIPTextModel",
    "Siglip2TextModel": "CLIPTextModel",
    "xCLIPTextModel": "CLIPTextModel",
}
"""Registry key → the key whose mapping it shares."""
