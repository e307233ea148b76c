"""Which transformers release the catalog's entries are written for.

A family's ``ENTRIES`` hold the lists for the newest transformers release in the supported range
(:data:`NEWEST`). Where a release changed the *runtime* modules of a family (its classes name their
parameters differently, so one list cannot route both), the family module also declares
``BEFORE``: registry key → :class:`Before`, the list the classes of the earlier releases need.
:func:`entries_for` picks, per key, the list for a release; :func:`specs.register_catalog` asks
for the installed one, so a model always gets the list written for its own classes. The
checkpoint (hub) layout is the same under both lists: a hub file loads and saves back the same
bytes with either release installed.

Where a release only *added* renamings for another checkpoint layout (the runtime modules stayed),
the newest list serves every release and loads the older layouts too; the family module names
those keys in ``EXTENDED``: registry key → the release whose list ``ENTRIES`` holds. The release
guard (``tests/interop/test_catalog_interop.py``) then checks, under an older release, that its
list is contained in ours in order.

Example:
    >>> from specs import decoders
    >>> sorted(entries_for(decoders, "5.23.0")) == sorted(decoders.ENTRIES)
    True
    >>> release_tuple("5.26.0.dev0")
    (5, 26, 0)
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

from surgery.errors import ConfigurationError
from surgery.transforms import WeightTransform

__all__ = ["NEWEST", "PINNED", "Before", "entries_for", "installed_release", "release_tuple"]

PINNED = "5.23.0"
"""The release CI's main environment pins (the ``interop`` extra); ``docs/catalog.md`` counts against it."""

NEWEST = "5.25.0"
"""The newest release in the supported range (``>=5.20,<6``) that the catalog maps."""


def release_tuple(release: str) -> tuple[int, int, int]:
    """``"5.24.1"`` → ``(5, 24, 1)``; pre-release and local suffixes are ignored (``5.26.0.dev0`` → 5.26.0)."""
    parts: list[int] = []
    for piece in release.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise ConfigurationError(f"{release!r} is not a transformers release number such as '5.25.0'.")
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


@dataclass(frozen=True)
class Before:
    """The list a key needs before ``release``: ``ENTRIES`` holds the list from ``release`` on.

    Attributes:
        release: the first transformers release whose classes need the ``ENTRIES`` list.
        transforms: the list for the releases before it.
    """

    release: str
    transforms: list[WeightTransform]

    def __post_init__(self) -> None:
        release_tuple(self.release)  # refuses a malformed release number
        if not self.transforms:
            raise ConfigurationError(
                f"Before(release={self.release!r}) has no transforms; an entry with nothing to "
                "convert before that release needs no Before."
            )


def installed_release() -> str | None:
    """The installed transformers release, read from its metadata (transformers is not imported)."""
    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def entries_for(family: ModuleType, release: str | None) -> dict[str, list[WeightTransform]]:
    """A family module's entries for ``release`` (``None``: the newest lists)."""
    entries = dict(family.ENTRIES)
    if release is None:
        return entries
    installed = release_tuple(release)
    for key, before in getattr(family, "BEFORE", {}).items():
        if key not in entries:
            raise ConfigurationError(
                f"{family.__name__}.BEFORE names {key!r}, which its ENTRIES lack; declare the newest "
                "list in ENTRIES and the earlier one in BEFORE."
            )
        if installed < release_tuple(before.release):
            entries[key] = before.transforms
    return entries
