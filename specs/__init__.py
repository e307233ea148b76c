"""The built-in catalog: fusion specs and checkpoint conversion mappings, one module per family.

``register_catalog`` is the ``surgery.catalogs`` entry point: the engine calls it lazily on the
first registry lookup.
"""

__all__ = ["register_catalog"]


def register_catalog() -> None:
    """Register every built-in family through the public API."""
