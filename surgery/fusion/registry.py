"""The fusion registry: fusion names → :class:`~surgery.fusion.spec.FusionSpec` instances.

A plain dict behind :func:`register_fusion` / :func:`get_fusion`. Built-in fusions come from the
catalogs (``surgery.catalogs`` entry points, e.g. ``specs.patch_embeddings.register``), loaded
lazily on the first access through :func:`surgery.registry.load_catalogs`, the same single loader
the conversion registry uses, so every catalog runs once per process.

Testing: :func:`fusion_registry_snapshot` restores the fusion registry on exit.
"""

from __future__ import annotations

import difflib
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import RegistryError
from ..registry import current_catalog, load_catalogs
from .spec import FusionSpec
from .tracing import restore_tracing_state, tracing_state

__all__ = [
    "find_fusion",
    "fusion_registry_snapshot",
    "get_fusion",
    "list_fusions",
    "register_fusion",
]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LOCK = threading.RLock()
_FUSIONS: dict[str, FusionSpec] = {}
_PROVENANCE: dict[str, str] = {}  # name -> "user" | "catalog:<entry point name>"


def _ensure_catalogs() -> None:
    load_catalogs()  # re-entrant: a catalog registering a fusion does not load itself again


def _current_catalog() -> str | None:
    """The catalog whose entry point is running in this thread, or ``None``."""
    return current_catalog()


def register_fusion(name: str, spec: FusionSpec, *, overwrite: bool = False) -> None:
    """Register ``spec`` under ``name`` (the key used in fusion configs).

    Args:
        name: an identifier such as ``"patch_embeddings"``.
        spec: a :class:`~surgery.fusion.spec.FusionSpec` instance.
        overwrite: replace an existing registration instead of failing.

    Raises:
        RegistryError: the name is not an identifier, ``spec`` is not a ``FusionSpec`` instance,
            or the name is taken and ``overwrite`` is false (the message names both specs).

    Example:
        >>> from surgery.fusion import FusionSpec
        >>> class Nothing(FusionSpec):
        ...     pass
        >>> with fusion_registry_snapshot(clear=True):
        ...     register_fusion("nothing", Nothing())
        ...     list_fusions()
        ['nothing']
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise RegistryError(f"A fusion name must be an identifier like 'patch_embeddings', got {name!r}.")
    if isinstance(spec, type) or not isinstance(spec, FusionSpec):
        raise RegistryError(
            f"register_fusion({name!r}, ...) needs a FusionSpec instance, got {spec!r}; "
            "subclass surgery.fusion.FusionSpec and pass an instance (e.g. MySpec())."
        )
    if not isinstance(overwrite, bool):
        raise RegistryError(f"overwrite must be True or False, got {overwrite!r}.")
    _ensure_catalogs()
    catalog = _current_catalog()
    provenance = f"catalog:{catalog}" if catalog is not None else "user"
    with _LOCK:
        old = _FUSIONS.get(name)
        # A catalog running again (the conversion registry was reset and reloads its catalogs)
        # replaces its own earlier entries; any other collision is an error.
        rerun = catalog is not None and _PROVENANCE.get(name) == provenance
        if old is not None and not overwrite and not rerun:
            raise RegistryError(
                f"A fusion named {name!r} is already registered ({old!r}, by {_PROVENANCE.get(name, 'user')}); "
                f"the new spec {spec!r} (by {provenance}) collides with it. Pass overwrite=True to replace it, "
                "or choose another name."
            )
        _FUSIONS[name] = spec
        _PROVENANCE[name] = provenance


def find_fusion(name: str) -> FusionSpec | None:
    """The spec registered under ``name``, or ``None``."""
    _ensure_catalogs()
    with _LOCK:
        return _FUSIONS.get(name)


def get_fusion(name: str) -> FusionSpec:
    """The spec registered under ``name``.

    Raises:
        RegistryError: no such fusion; the message lists the registered names and the closest one.
    """
    spec = find_fusion(name)
    if spec is not None:
        return spec
    raise RegistryError(f"No fusion is registered as {name!r}{_closest(name)}. {_known()}")


def list_fusions() -> list[str]:
    """Every registered fusion name, sorted."""
    _ensure_catalogs()
    with _LOCK:
        return sorted(_FUSIONS)


def _closest(name: object) -> str:
    with _LOCK:
        close = difflib.get_close_matches(str(name), list(_FUSIONS), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _known() -> str:
    names = list_fusions()
    if not names:
        return "No fusion is registered; register one with register_fusion(name, spec)."
    return f"Valid names: {', '.join(map(repr, names))}."


@contextmanager
def fusion_registry_snapshot(*, clear: bool = False) -> Iterator[None]:
    """Restore the fusion registry, leaf functions and None-in-inference names on exit (for tests).

    Args:
        clear: start from an empty fusion registry (the catalogs still count as loaded).
    """
    _ensure_catalogs()
    tracing = tracing_state()
    with _LOCK:
        saved = dict(_FUSIONS), dict(_PROVENANCE)
        if clear:
            _FUSIONS.clear()
            _PROVENANCE.clear()
    try:
        yield
    finally:
        with _LOCK:
            _FUSIONS.clear()
            _FUSIONS.update(saved[0])
            _PROVENANCE.clear()
            _PROVENANCE.update(saved[1])
        restore_tracing_state(tracing)
