"""The built-in catalog: fusion specs and checkpoint conversion mappings, one module per family.

:func:`register_catalog` is the ``surgery.catalogs`` entry point (declared in ``pyproject.toml``):
the engine calls it lazily on the first registry lookup. Each family module is data: ``ENTRIES``
(registry key → a literal transform list) and ``ALIASES`` (registry key → the key whose mapping
it shares); a key whose runtime modules changed between transformers releases also has a
``BEFORE`` list (:mod:`specs.releases`). :func:`register_family` hands the lists for the installed
release to the same public function a user extending the library calls; the fusion specs register themselves with ``patch_embeddings.register()`` and
``sibling_linears.register()``.
"""

from __future__ import annotations

from types import ModuleType

from surgery.registry import register_catalog_modules, register_checkpoint_conversion_mapping

from . import (
    audio,
    clip,
    decoders,
    dense_example,
    dense_vision,
    detection,
    detr,
    dinov2,
    encoders,
    ernie4_5_vl_moe,
    inkling2,
    llava,
    mixtral,
    patch_embeddings,
    qwen2_moe,
    qwen2_vl,
    qwen_omni,
    releases,
    sibling_linears,
    vision_language,
    vit,
    vit_heads,
)

__all__ = ["EXAMPLE_FAMILIES", "FAMILIES", "register_catalog", "register_family"]

FAMILIES = (
    mixtral,
    qwen2_moe,
    llava,
    qwen2_vl,
    qwen_omni,
    clip,
    vit,
    dinov2,
    detr,
    ernie4_5_vl_moe,
    decoders,
    vision_language,
    audio,
    detection,
    dense_vision,
    vit_heads,
    encoders,
    inkling2,
)
"""Checkpoint-conversion families of transformers model types and classes, registered in this order."""

EXAMPLE_FAMILIES = (dense_example,)
"""Families of the built-in example models only (``surgery.examples``), registered after them."""


def register_family(family: ModuleType, *, release: str | None = None) -> None:
    """Register one family module's entries and ``ALIASES`` through the public API.

    Args:
        family: the family module.
        release: the transformers release whose classes the entries are for (``BEFORE`` lists
            apply below their release); ``None``: the newest lists.
    """
    for key, transforms in releases.entries_for(family, release).items():
        register_checkpoint_conversion_mapping(key, transforms)
    for key, target in family.ALIASES.items():
        register_checkpoint_conversion_mapping(key, target)


def register_catalog() -> None:
    """Register every built-in family through the public API."""
    # The entries below were written for transformers' model classes and our own examples.
    register_catalog_modules("transformers", "surgery.examples")
    # Entries follow the installed transformers' classes (without transformers: the newest lists).
    release = releases.installed_release()
    for family in (*FAMILIES, *EXAMPLE_FAMILIES):
        register_family(family, release=release)
    patch_embeddings.register()
    sibling_linears.register()
