"""The built-in catalog: fusion specs and checkpoint conversion mappings, one module per family.

:func:`register_catalog` is the ``surgery.catalogs`` entry point (declared in ``pyproject.toml``):
the engine calls it lazily on the first registry lookup. It registers every family from the
explicit list below, through the same public functions a user extending the library calls.
"""

from __future__ import annotations

from . import (
    clip,
    detr,
    dinov2,
    ernie4_5_vl_moe,
    llava,
    mixtral,
    patch_embeddings,
    qwen2_moe,
    qwen2_vl,
    vit,
)

__all__ = ["FAMILIES", "register_catalog"]

FAMILIES = (mixtral, qwen2_moe, llava, qwen2_vl, clip, vit, dinov2, detr, ernie4_5_vl_moe)
"""Checkpoint-conversion families, registered in this order."""


def register_catalog() -> None:
    """Register every built-in family through the public API."""
    from surgery.registry import register_catalog_modules

    # The entries below were written for transformers' model classes and our own examples.
    register_catalog_modules("transformers", "surgery.examples")
    for family in FAMILIES:
        family.register()
    patch_embeddings.register()
