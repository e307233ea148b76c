"""Fast routing: share one routing decision between keys that differ only in their indices.

This module starts as the exact per-key path; :class:`TemplateRouter` is the seam where the
template cache plugs in.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .routing import _Router

__all__ = ["TemplateRouter"]

Decision = tuple[str, tuple[int, ...], "int | None", "int | None", tuple[str, ...], tuple[str, ...]]


class TemplateRouter:
    """Route keys through a compiled :class:`~surgery.routing._Router`."""

    def __init__(self, router: _Router) -> None:
        self.router = router

    def route_one(self, key: str) -> Decision:
        return self.router.route(key)

    def route_many(self, keys: Iterable[str]) -> Iterator[tuple[str, Decision]]:
        route = self.router.route
        for key in keys:
            yield key, route(key)
