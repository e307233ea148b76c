r"""Llava-style vision-language models: a language model, a vision tower and a projector.

Original layout (hub checkpoints of ``*ForConditionalGeneration``)::

    language_model.model.X        language_model.lm_head.weight
    vision_tower.X                multi_modal_projector.X

Runtime layout::

    model.language_model.X        lm_head.weight
    model.vision_tower.X          model.multi_modal_projector.X

Two keys cooperate: the model_type entry (``llava`` and the model types sharing it) moves the
top-level modules under ``model.``; the base-model class entry (``LlavaModel`` and its aliases)
drops the inner ``model.`` of the language model. When the tower is a CLIP/SigLIP vision model,
the tower's own entry (:mod:`specs.clip`) removes its ``vision_model.`` prefix.

The related families that use the same scheme with other module names (``llava_next`` with its
``image_newline``, ``video_llava`` with image and video towers, ``fuyu``, ``mllama``) live here too.
"""

from __future__ import annotations

from surgery import WeightRenaming
from surgery.transforms import WeightTransform

__all__ = ["ALIASES", "ENTRIES"]

_LM_HEAD = WeightRenaming(r"^language_model\.lm_head", "lm_head")
_LANGUAGE_MODEL = WeightRenaming(r"^language_model", "model.language_model")
_PROJECTOR = WeightRenaming(r"^multi_modal_projector", "model.multi_modal_projector")

ENTRIES: dict[str, list[WeightTransform]] = {
    "llava": [
        _LM_HEAD,
        _LANGUAGE_MODEL,
        WeightRenaming(r"^vision_tower", "model.vision_tower"),
        _PROJECTOR,
    ],
    "LlavaModel": [
        WeightRenaming(r"^language_model\.model", "language_model"),
    ],
    "llava_next": [
        _LM_HEAD,
        _LANGUAGE_MODEL,
        WeightRenaming(r"^vision_tower", "model.vision_tower"),
        _PROJECTOR,
        WeightRenaming(r"^image_newline", "model.image_newline"),
    ],
    "video_llava": [
        _LM_HEAD,
        _LANGUAGE_MODEL,
        WeightRenaming(r"^image_tower", "model.image_tower"),
        WeightRenaming(r"^video_tower", "model.video_tower"),
        _PROJECTOR,
    ],
    "VideoLlavaModel": [
        WeightRenaming(r"^language_model\.model", "language_model"),
    ],
    "fuyu": [
        _LM_HEAD,
        _LANGUAGE_MODEL,
        WeightRenaming(r"^vision_embed_tokens", "model.vision_embed_tokens"),
    ],
    "mllama": [
        _LM_HEAD,
        _LANGUAGE_MODEL,
        WeightRenaming(r"^vision_model", "model.vision_model"),
        _PROJECTOR,
    ],
}
"""Registry key → transform list (unscoped prototypes; the registry hands out copies)."""

ALIASES: dict[str, str] = {
    # model types whose *ForConditionalGeneration checkpoints use the llava layout
    "aria": "llava",
    "aya_vision": "llava",
    "gemma3": "llava",
    "got_ocr2": "llava",
    "internvl": "llava",
    "mistral3": "llava",
    "paligemma": "llava",
    "pp_chart2table": "llava",
    "vipllava": "llava",
    "llava_next_video": "llava_next",
    "llava_onevision": "llava_next",
    # base-model classes whose language model drops the inner ``model.``
    "AriaModel": "LlavaModel",
    "AyaVisionModel": "LlavaModel",
    "FuyuModel": "LlavaModel",
    "Gemma3Model": "LlavaModel",
    "GotOcr2Model": "LlavaModel",
    "InternVLModel": "LlavaModel",
    "LlavaNextModel": "LlavaModel",
    "LlavaNextVideoModel": "LlavaModel",
    "LlavaOnevisionModel": "LlavaModel",
    "Mistral3Model": "LlavaModel",
    "MllamaModel": "LlavaModel",
    "PaliGemmaModel": "LlavaModel",
    "PPChart2TableModel": "LlavaModel",
    "VipLlavaModel": "LlavaModel",
}
"""Registry key → the key whose mapping it shares."""
