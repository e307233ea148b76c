r"""Qwen2-VL / Qwen2.5-VL: the language model moves under ``model.language_model``.

Original layout (hub checkpoints of ``Qwen2VLForConditionalGeneration``)::

    model.X (language model)      visual.X      lm_head.weight

Runtime layout::

    model.language_model.X        model.visual.X      lm_head.weight

Registered by class name only (``qwen2_vl`` / ``qwen2_5_vl`` model types have no entry). A
standalone ``Qwen2VLModel`` has no hub layout of its own: its entry adds ``language_model.``
under a ``model.`` prefix, which serves checkpoints saved from the model with a head.

Adapted from the reference: the look-ahead of the second renaming is written with a
non-capturing group, ``(?!\.(?:language_model|visual))`` (same keys match).
"""

from __future__ import annotations

from surgery import PrefixChange, WeightRenaming
from surgery.transforms import WeightTransform

__all__ = ["ADAPTED_PATTERNS", "ALIASES", "ENTRIES"]

ENTRIES: dict[str, list[WeightTransform]] = {
    "Qwen2VLModel": [
        PrefixChange(prefix_to_add="language_model", model_prefix="model"),
    ],
    "Qwen2VLForConditionalGeneration": [
        WeightRenaming(r"^visual", "model.visual"),
        WeightRenaming(r"^model(?!\.(?:language_model|visual))", "model.language_model"),
    ],
}
"""Registry key → transform list (unscoped prototypes; the registry hands out copies)."""

ALIASES: dict[str, str] = {
    "Qwen2_5_VLModel": "Qwen2VLModel",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2VLForConditionalGeneration",
    "LlavaOnevision15ForConditionalGeneration": "Qwen2VLForConditionalGeneration",
}
"""Registry key → the key whose mapping it shares."""


ADAPTED_PATTERNS: dict[str, dict[str, str]] = {
    "Qwen2VLForConditionalGeneration": {
        r"^model(?!\.(language_model|visual))": r"^model(?!\.(?:language_model|visual))"
    },
}
"""Key -> {transformers' source pattern: ours}: a non-capturing group, so ``\\1`` stays unused."""
