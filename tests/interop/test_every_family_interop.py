"""Generated interop test: every catalog family, through transformers' own save and load.

For every key the catalog registers (``specs.FAMILIES``) that names a transformers model type or
class, one tiny random model is built from its config (:mod:`tiny`), transformers writes it in the
original (hub) layout, and :func:`round_trip.round_trip` checks that

* transformers' ``from_pretrained`` of that file gives the model back (else the note says why,
  and surgery is still checked against the model that wrote the file);
* ``surgery.load_checkpoint`` into a fresh model gives exactly the writing model's tensors (keys,
  values, dtypes) with a clean report;
* ``surgery.save_checkpoint`` writes the original file's tensors back bit for bit.

Families this cannot check are listed below with the reason, never skipped silently: each listed
reason is asserted to still hold, so a transformers release that fixes one fails here until the
entry is removed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from round_trip import NotBuilt, RoundTrips, SurgeryMismatch  # noqa: E402
from tiny import Candidate, candidates  # noqa: E402

import specs  # noqa: E402
from specs.releases import release_tuple  # noqa: E402
from surgery.registry import load_catalogs, registry_snapshot  # noqa: E402

pytestmark = pytest.mark.interop

NOT_BUILT: dict[str, str] = {
    # catalog key -> the reason transformers cannot build a tiny model here (a substring of the error).
    "timm_wrapper": "requires the PIL library",
}
"""Families transformers cannot build in this environment, with the error they raise."""

_BEFORE_5_24 = release_tuple(transformers.__version__) < (5, 24, 0)

NOT_SELF_ROUND_TRIPPED: dict[str, str] = {
    # catalog key -> why transformers' own load of its own file fails (surgery is still checked).
    **({"inkling2": "requires accelerate"} if _BEFORE_5_24 else {}),
    "jev": "'tuple' object has no attribute 'decision_config'",
}
"""Families whose file transformers writes but cannot load back itself."""

SAVE_DEFECTS: dict[str, str] = {
    # catalog key -> the start of the mismatch surgery's save still shows (a defect to fix, listed
    # so that the rest of the family stays checked; the test fails once the save is right).
}
"""Families whose save is known to write another layout than the hub file's (none today)."""

UNRELIABLE_SAVE: dict[str, str] = {
    # catalog key -> why transformers' file sometimes does not hold the model that wrote it.
    "qwen3_omni_moe": (
        "in about half the runs transformers 5.23 writes one talker expert's down_proj from "
        "uninitialized memory (NaN or garbage); surgery is then checked against transformers' "
        "reading of the file"
    ),
}
"""Families whose round trip through transformers' save is not deterministic, and why."""


def _renames(*pairs: tuple[str, str]) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """A file rewrite renaming each key by the first pattern that matches it."""
    compiled = [(re.compile(a), b) for a, b in pairs]

    def rename(key: str) -> str:
        for pattern, replacement in compiled:
            key, n = pattern.subn(replacement, key, count=1)
            if n:
                return key
        return key

    return lambda state: {rename(k): v for k, v in state.items()}


def _transposed_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3-VL-MoE hub files hold the fused experts as [E, H, 2I] / [E, I, H]; transformers 5.23
    writes the runtime [E, 2I, H] / [E, H, I] (its shape-checked transpose never fires on save)."""
    return {
        k: v.transpose(1, 2) if re.search(r"mlp\.experts\.(gate_up|down)_proj$", k) else v
        for k, v in state.items()
    }


_THINKER = _renames(
    (r"^thinker\.model\.thinker\.language_model\.", "thinker.model."),
    (r"^thinker\.model\.thinker\.", "thinker."),
)
_OMNI = _renames(
    (r"^thinker\.thinker\.model\.thinker\.language_model\.", "thinker.model."),
    (r"^thinker\.thinker\.model\.thinker\.", "thinker."),
    (r"^thinker\.thinker\.", "thinker."),
)
_ULTRABERT = _renames(
    (r"^ultrabert\.ultrabert\.", "ultrabert."),
    (r"^ultrabert\.head\.decoder\.", "cls."),
    (r"^ultrabert\.", ""),
)

_DOUBLED = (
    _renames(  # transformers writes the tower prefix twice (its reversed PrefixChange fires inside the scope)
        (r"^text_encoder\.text_encoder\.", "text_encoder."),
        (r"^vision_encoder\.vision_encoder\.", "vision_encoder."),
        (r"^vision_model\.vision_model\.", "vision_model."),
        (r"^text_model\.text_model\.", "text_model."),
        (r"^model\.vision_model\.vision_model\.", "model.vision_model."),
    )
)
_TIPSV2_DPT = _renames(
    (r"^vision_encoder\.vision_encoder\.", "vision_encoder."),
    (r"^vision_encoder\.((?:depth_|normals_|segmentation_)?head)\.", r"\1."),
)
_DOTS3_NOTE = _renames(  # the adapter sits in the audio encoder in the hub files (the first renaming says so)
    (r"^model\.model\.audio_adapter\.", "audio_encoder.audio_adapter."),
    (r"^model\.model\.(audio_encoder|vision_encoder)\.", r"\1."),
    (r"^model\.model\.", "model."),
    (r"^model\.lm_head\.", "lm_head."),
)

_GTE = (
    _renames(  # transformers adds new. to every key; the hub has it on the base model only (specs.encoders)
        (r"^new\.gte\.", "new."),
        (r"^new\.", ""),
    )
)


def _two_blocks_per_layer(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dory hub files hold layer ``i`` as blocks ``2i`` (attention: ``mixer``, ``attn_alpha``) and
    ``2i+1`` (mlp: ``mixer``, ``mlp_alpha``); transformers 5.25 cannot write that (its
    ``LayerPairCollapse`` has no reverse) and saves the one-layer names."""
    blocks = {
        "self_attn": (0, "mixer"),
        "mlp": (1, "mixer"),
        "lambda_1": (0, "attn_alpha"),
        "lambda_2": (1, "mlp_alpha"),
    }

    def block(m: re.Match[str]) -> str:
        odd, name = blocks[m[2]]
        return f"layers.{2 * int(m[1]) + odd}.{name}"

    pattern = re.compile(r"layers\.(\d+)\.(self_attn|mlp|lambda_1|lambda_2)(?=\.|$)")
    return {pattern.sub(block, k, count=1): v for k, v in state.items()}


HUB_LAYOUT: dict[str, Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = {
    # transformers 5.23 writes these families' files in a layout no hub checkpoint has (its reverse
    # renamings also fire inside other names, or add a base prefix twice): the file is put back into
    # the hub layout before anything loads it.
    "ViTMAEForPreTraining": _renames((r"^decoder\.decoder_encoder\.layer\.", "decoder.decoder_layers.")),
    "UltrabertForMaskedLM": _ULTRABERT,
    "UltrabertForSequenceClassification": _ULTRABERT,
    "UltrabertForTokenClassification": _ULTRABERT,
    "UltrabertForQuestionAnswering": _ULTRABERT,
    "Qwen2_5OmniThinkerForConditionalGeneration": _THINKER,
    "Qwen3OmniMoeThinkerForConditionalGeneration": _THINKER,
    "qwen2_5_omni_thinker": _THINKER,
    "qwen3_omni_moe_thinker": _THINKER,
    "qwen3_omni_moe": _OMNI,
    "tipsv2_dpt": _TIPSV2_DPT,
    "Tipsv2DptForDepthEstimation": _TIPSV2_DPT,
    "Tipsv2DptForNormalEstimation": _TIPSV2_DPT,
    "Tipsv2DptForSemanticSegmentation": _TIPSV2_DPT,
    "Dots3NoteForConditionalGeneration": _DOTS3_NOTE,
    "qwen3_vl_moe": _transposed_experts,
    "gte": _GTE,
    "tipsv2": _DOUBLED,
    "altclip": _DOUBLED,
    "UltraVBertForMaskedLM": _DOUBLED,
    "dory": _two_blocks_per_layer,
    # transformers 5.25 writes the vision tower's prefix twice (its reversed PrefixChange fires
    # inside the tower's scope), and the text model's ``model.`` twice (the base model's renaming
    # reversed inside its scope); hub files hold ``visual.blocks.*`` and ``model.layers.*``
    "LlavaOnevision15ForConditionalGeneration": _renames(
        (r"^visual\.visual\.", "visual."), (r"^model\.model\.", "model.")
    ),
    "LlavaOnevision15Model": _renames((r"^visual\.visual\.", "visual.")),
}

HUB_EVIDENCE: dict[tuple[str, ...], str] = {
    # families -> the layout surgery saves where transformers' write differs, and why it is the hub's.
    ("gte",): (
        "`new.*` (the base model) beside `lm_head.*`; a bare `GteModel` saves bare keys. transformers "
        "writes `new.gte.*` and `new.lm_head.*`. Evidence: its own mapping strips `new.` (the hub's name "
        "of the base model), and the remote-code `NewForMaskedLM` that wrote the hub files "
        "(gte-multilingual-mlm-base, loaded by transformers' GTE integration test) holds `self.new` and "
        "`self.lm_head`, its tied-weights table naming `new.embeddings.word_embeddings.weight`. A file "
        "transformers wrote saves back as written (`new.gte.*`, `new.lm_head.*`), never a mix of the two"
    ),
    ("ViTMAEForPreTraining",): (
        "`decoder.decoder_layers.N.attention.attention.query.*`; transformers writes "
        "`decoder.decoder_encoder.layer.N.*` (the ViT `encoder.layer` renaming reversed inside the "
        "decoder). Evidence: the decoder's module is `decoder_layers` in the class that wrote the hub "
        "files, and transformers' docs quote a VideoMAE hub checkpoint (same decoder) reporting "
        "`decoder.decoder_layers.1.attention.output.dense.bias` (docs/source/ko/tasks/video_classification.md)"
    ),
    (
        "UltrabertForMaskedLM",
        "UltrabertForSequenceClassification",
        "UltrabertForTokenClassification",
        "UltrabertForQuestionAnswering",
    ): (
        "`ultrabert.*` with the head at the root (`cls.*`, `classifier.*`); transformers writes "
        "`ultrabert.ultrabert.*`, `ultrabert.head.decoder.*`, `ultrabert.classifier.*`. Evidence: the heads' own mappings read "
        "`^ultrabert.` and `^cls.` (the BERT layout: base model and head side by side)"
    ),
    ("UltraVBertForMaskedLM",): (
        "`model.vision_model.*` (transformers writes it twice: `model.vision_model.vision_model.*`; the "
        "class keeps `vision_model.head.` among the hub keys it ignores). NOT ESTABLISHED: the text "
        "tower's `model.text_model.ultrabert.*` (Ultrabert's `ultrabert.` put back inside the tower): no "
        "hub key list of UltraVBERT is quoted in transformers, so surgery saves transformers' layout there"
    ),
    (
        "Qwen2_5OmniThinkerForConditionalGeneration",
        "Qwen3OmniMoeThinkerForConditionalGeneration",
        "qwen2_5_omni_thinker",
        "qwen3_omni_moe_thinker",
        "qwen3_omni_moe",
    ): (
        "`thinker.model.*`, `thinker.lm_head.*`, `thinker.audio_tower.*`, `thinker.visual.*`; transformers "
        "writes `thinker.model.thinker.language_model.*` / `thinker.thinker.*`. Evidence: the thinker "
        "mapping strips `thinker.` and moves `model.` under `language_model`, i.e. it reads the omni "
        "checkpoint's `thinker.model.*` (the v4 module tree of `Qwen2_5OmniForConditionalGeneration.thinker`)"
    ),
    (
        "tipsv2",
        "tipsv2_dpt",
        "Tipsv2DptForDepthEstimation",
        "Tipsv2DptForNormalEstimation",
        "Tipsv2DptForSemanticSegmentation",
    ): (
        "`text_encoder.*` / `vision_encoder.*` once, DPT heads at the root (`depth_head.*`); transformers "
        "writes `text_encoder.text_encoder.*`, `vision_encoder.vision_encoder.*`, `vision_encoder.depth_head.*`. "
        "Evidence: the tower mappings read the original TIPS names under one prefix (`transformer.resblocks`, "
        "`ln_final`, `patch_embed.proj`, `pos_embed`), the DPT mappings read `depth_head.depth_head.` at the root"
    ),
    ("Dots3NoteForConditionalGeneration",): (
        "`model.*` (text decoder), `lm_head.*`, `vision_encoder.*`, `audio_encoder.*` (adapter at "
        "`audio_encoder.audio_adapter.*`); transformers writes `model.model.*` and `model.lm_head.*`. "
        "Evidence: the class mapping reads `^audio_encoder.audio_adapter.` and `^(vision_encoder|audio_encoder)` at the root"
    ),
    ("altclip",): (
        "`vision_model.*` once; transformers writes `vision_model.vision_model.*` (a doubled name is in "
        "no module tree that wrote hub files)"
    ),
    ("qwen3_vl_moe",): (
        "fused experts as `[E, H, 2I]` / `[E, I, H]`; transformers 5.23 writes the runtime `[E, 2I, H]` "
        "(its shape-checked transpose never fires on save)"
    ),
    ("dory",): (
        "two blocks per layer: `backbone.layers.2i.mixer.*` with `attn_alpha`, `backbone.layers.2i+1.mixer.*` "
        "with `mlp_alpha`; transformers 5.25 writes the one-layer runtime names (its `LayerPairCollapse` has "
        "no reverse). Evidence: the mapping reads exactly those (`LayerPairCollapse` folds block `2i+1` into "
        "layer `i`, `^backbone.` renamed to `model.`)"
    ),
    ("LlavaOnevision15ForConditionalGeneration", "LlavaOnevision15Model"): (
        "`visual.blocks.*` and `model.layers.*` once; transformers 5.25 writes `visual.visual.*` and "
        "`model.model.*`. Evidence: the vision mapping strips one `visual.` and the model mapping moves "
        "`model.` under `language_model.`, i.e. they read a file with each name once"
    ),
    ("hyperclovax_vision_v2",): (
        "the same as transformers: `model.language_model.model.*`, `model.language_model.lm_head.*`, "
        "`model.vision_projector.*`. Evidence: the mapping reads exactly these (`^model.language_model.lm_head`, "
        "`^model.vision_projector`, `model.` removed under `model.language_model`)"
    ),
    ("lfm3_vl_vision",): (
        "the same as transformers: `patchifier`, `q_layernorm` / `k_layernorm`. Evidence: the mapping reads "
        "them, the LFM attention's own names (`q_layernorm`, `k_layernorm` beside `out_proj`)"
    ),
}
"""Where surgery's save is the hub layout and transformers writes another, with the evidence
(docs/catalog.md renders this table); the last two are checked and equal transformers' write."""

NEVER_LOADED_SAVES_OTHERWISE: dict[str, str] = {
    # catalog key -> why saving the model that wrote the file, never loaded, gives another file.
    "nemo_speechlm": (
        "the file holds the Nemotron-H per-expert layout; a model never loaded saves the whole "
        "model's NeMo layout (fused gate_and_up_projs), a loaded one what fired"
    ),
    "jina_embeddings_v3": "the tied embedding is written under lm_head.decoder.weight, not the embedding's name",
}
"""Families whose never-loaded save differs from the loaded one, and why."""
"""Rewrites of transformers' written file into the real hub layout (its save defects)."""


def _catalog_keys() -> list[str]:
    return [k for fam in specs.FAMILIES for k in (*fam.ENTRIES, *fam.ALIASES)]


CASES: list[Candidate] = [c for key in _catalog_keys() for c in candidates(key)]
UNBUILDABLE_KEYS = sorted(set(_catalog_keys()) - {c.key for c in CASES})

ADDED_IN_5_24: tuple[str, ...] = (
    "LlavaOnevision15ForConditionalGeneration",
    "LlavaOnevision15Model",
    "apertus1p5_text",
    "dory",
    "ergo",
    "exaone",
    "hy_v4_vl",
    "hy_v4_vl_text",
    "inkling2_loop",
    "inkling2_loop_text",
    "kolibri1_1",
    "lara_mini",
    "llava_onevision1_5_vision",
    "minicpm5_moe",
    "ovis2_5",
    "param2moe",
    "pi05",
    "sarvam_mla",
    "sarvam_moe",
)
"""Catalog keys of the classes and model types transformers 5.24 and 5.25 added."""

NO_CLASS: dict[str, str] = {
    **dict.fromkeys(
        ADDED_IN_5_24 if _BEFORE_5_24 else (),
        f"transformers {transformers.__version__} has no class or model type of that name (a later release added it)",
    ),
    **dict.fromkeys(
        (
            "MaskFormerDetrDecoder",
            "MtpModel",
            "PPChart2TableModel",
            "mlcd_vision",
            "xCLIPTextModel",
            "xCLIPVisionModel",
        ),
        "no transformers class or model type of that name (kept for parity with its mapping)",
    ),
    **dict.fromkeys(
        (
            "UnlimitedOcrSamVisionEncoder",
            "UnlimitedOcrVisionEncoder",
            "dots3_note_audio_encoder",
            "dots3_note_vision_encoder",
            "qwen3_omni_moe_text",
            "step3p5_vision",
        ),
        "a sub-model with no head class of its own: resolved inside its parent's case",
    ),
}
"""Catalog keys the test has no class to build for, and why (docs/catalog.md shows where the
sub-model keys are resolved)."""


@pytest.fixture(scope="module", autouse=True)
def catalog():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with registry_snapshot():
        load_catalogs()
        yield


def test_every_catalog_key_without_a_class_is_listed_with_the_reason() -> None:
    assert sorted(NO_CLASS) == UNBUILDABLE_KEYS


@pytest.mark.parametrize("case", CASES, ids=[f"{c.key}-{c.class_name}" for c in CASES])
def test_family_loads_and_saves_exactly(case: Candidate, round_trips: RoundTrips) -> None:
    if case.key in NOT_BUILT:
        with pytest.raises(NotBuilt, match=re.escape(NOT_BUILT[case.key])):
            round_trips.run(case)
        return
    if case.key in SAVE_DEFECTS:
        with pytest.raises(SurgeryMismatch, match=re.escape(SAVE_DEFECTS[case.key])):
            round_trips.run(case, hub_layout=HUB_LAYOUT.get(case.key))
        return
    note = round_trips.run(
        case,
        hub_layout=HUB_LAYOUT.get(case.key),
        check_never_loaded=case.key not in NEVER_LOADED_SAVES_OTHERWISE,
    )
    if case.key in NOT_SELF_ROUND_TRIPPED:
        assert note is not None and NOT_SELF_ROUND_TRIPPED[case.key] in note, note
    elif case.key in UNRELIABLE_SAVE:
        assert note is None or "gives another model" in note, note
    else:
        assert note is None, note


def test_every_recorded_hub_layout_has_its_evidence() -> None:
    documented = {k for keys in HUB_EVIDENCE for k in keys}
    assert set(HUB_LAYOUT) <= documented, sorted(set(HUB_LAYOUT) - documented)


def test_lists_name_catalog_keys() -> None:
    keys = set(_catalog_keys())
    for listed in (
        NOT_BUILT,
        NOT_SELF_ROUND_TRIPPED,
        UNRELIABLE_SAVE,
        SAVE_DEFECTS,
        HUB_LAYOUT,
        NEVER_LOADED_SAVES_OTHERWISE,
        {k: "" for group in HUB_EVIDENCE for k in group},
    ):
        assert set(listed) <= keys, set(listed) - keys


THEIR_WRITE_NOT_LOADED: dict[str, str] = {
    # catalog key -> why transformers' own (defective) write of the family does not load into it cleanly:
    # the load reports the keys it could not place, so nothing is saved from it silently.
    "ViTMAEForPreTraining": "its decoder keys (`decoder.decoder_encoder.layer.*`) name no decoder layer",
    "Qwen2_5OmniThinkerForConditionalGeneration": "`thinker.model.thinker.language_model.*` names no module",
    "Qwen3OmniMoeThinkerForConditionalGeneration": "`thinker.model.thinker.language_model.*` names no module",
    "qwen2_5_omni_thinker": "`thinker.model.thinker.language_model.*` names no module",
    "qwen3_omni_moe_thinker": "`thinker.model.thinker.language_model.*` names no module",
    "qwen3_omni_moe": "`thinker.thinker.*` names no module",
}
"""HUB_LAYOUT families whose transformers-written file the load reports as not placed, and why."""

_HUB_CASES = [c for c in CASES if c.key in HUB_LAYOUT and c.key not in NOT_BUILT]


@pytest.mark.parametrize("case", _HUB_CASES, ids=[f"{c.key}-{c.class_name}" for c in _HUB_CASES])
def test_a_file_in_transformers_layout_saves_back_that_layout_never_a_mix(
    case: Candidate, tmp_path: Path
) -> None:
    """Where transformers writes another layout than the hub's, a file it wrote loads and saves back as
    itself (a loaded model saves what fired), or as the hub layout: never some keys of each."""
    from round_trip import read
    from tiny import build
    from transformers.conversion_mapping import get_model_conversion_mapping

    from surgery.load.loader import load_checkpoint
    from surgery.save import save_checkpoint

    writer = build(case, seed=0)
    writer._weight_conversions = get_model_conversion_mapping(writer, add_legacy=False)
    try:
        writer.save_pretrained(tmp_path / "theirs")
    except Exception as e:  # the every-family test lists these (e.g. inkling2 needs accelerate)
        pytest.skip(f"transformers cannot write {case.class_name}: {type(e).__name__}")
    theirs = read(tmp_path / "theirs")
    hub = HUB_LAYOUT[case.key](dict(theirs))
    model = build(case, seed=1)
    report = load_checkpoint(model, tmp_path / "theirs")
    if case.key in THEIR_WRITE_NOT_LOADED:
        assert not report.ok, f"{case.key} now loads transformers' write: drop it from THEIR_WRITE_NOT_LOADED"
        return
    assert report.ok, report
    save_checkpoint(model, tmp_path / "ours")
    ours = read(tmp_path / "ours")
    want = theirs if set(ours) == set(theirs) else hub
    assert set(ours) == set(want), (
        f"a mix: {sorted(set(ours) - set(theirs) - set(hub))[:4]} in neither transformers' write nor the hub layout"
    )
    changed = [k for k in want if ours[k].dtype != want[k].dtype or not torch.equal(ours[k], want[k])]
    assert not changed, changed[:4]
