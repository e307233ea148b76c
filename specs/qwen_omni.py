r"""Qwen2.5-Omni and Qwen3-Omni thinkers: the multimodal "thinker" sub-model of the omni models.

Original layout (the omni checkpoints; a thinker saved on its own has the same keys without the
leading ``thinker.``)::

    thinker.audio_tower.X     thinker.visual.X     thinker.model.X (the text decoder)    thinker.lm_head.X

Runtime layout of ``*ThinkerForConditionalGeneration``::

    model.audio_tower.X       model.visual.X       model.language_model.X                lm_head.X

The entry is looked up by the thinker's class, so it applies scoped to ``thinker`` inside the
whole omni model and at the root of a thinker loaded alone (where ``thinker.`` is stripped).
The experts of Qwen3-Omni's text decoder merge through the ``qwen2_moe`` mapping
(:mod:`specs.qwen2_moe`), which the omni, thinker and text model types all share.
"""

from __future__ import annotations

from surgery import PrefixChange, WeightRenaming
from surgery.transforms import WeightTransform

__all__ = ["ALIASES", "ENTRIES"]


def _thinker() -> list[WeightTransform]:
    return [
        PrefixChange(prefix_to_remove="thinker"),
        WeightRenaming(r"^audio_tower", "model.audio_tower"),
        WeightRenaming(r"^visual", "model.visual"),
        WeightRenaming(r"^model(?!\.(language_model|visual|audio_tower))", "model.language_model"),
    ]


ENTRIES: dict[str, list[WeightTransform]] = {
    "Qwen3OmniMoeThinkerForConditionalGeneration": _thinker(),
    "Qwen2_5OmniThinkerForConditionalGeneration": _thinker(),
    # The thinker's base model: ``thinker.`` goes, the text decoder moves under ``language_model``.
    "Qwen2_5OmniThinkerModel": [
        PrefixChange(prefix_to_remove="thinker"),
        PrefixChange(prefix_to_add="language_model", model_prefix="model"),
    ],
}

ALIASES: dict[str, str] = {
    "qwen2_5_omni_thinker": "Qwen2_5OmniThinkerForConditionalGeneration",
    "Qwen3OmniMoeThinkerModel": "Qwen2_5OmniThinkerModel",
}
