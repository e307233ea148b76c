"""Fusion specs: what a fusion looks for in a module, and what it turns it into.

A :class:`FusionSpec` is a recipe in four steps, each a method a family overrides:

1. ``target_modules_patterns``: regexes over module paths that pick *candidates* cheaply.
2. :meth:`FusionSpec.is_fusable`: a structural check of one candidate (its children's settings)
   before anything is traced; the reason it gives goes into the plan.
3. :meth:`FusionSpec.find_matches` and :meth:`FusionSpec.rewrite`: the candidate is traced
   alone with :mod:`torch.fx` (every child is a leaf), the dataflow pattern is matched on that
   graph, and the graph is rewritten in place, with the new child modules it calls.
4. :meth:`FusionSpec.make_transforms`: the weight transforms between the original and the
   fused parameter layout, derived from the module itself and scoped to its path.

The engine (:mod:`surgery.fusion.rewrite`, :mod:`surgery.fusion.apply`) drives the steps, builds
the replacement module on the side and swaps it in only when everything succeeded.

Every spec accepts the options in :data:`COMMON_OPTIONS` (``modules``, ``exclude``) and may
declare more in :attr:`FusionSpec.options`; a fusion config is validated against them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from torch import fx, nn

from ..errors import FusionError
from ..transforms import WeightTransform

__all__ = [
    "COMMON_OPTIONS",
    "FusionMatch",
    "FusionOption",
    "FusionSpec",
    "GraphRewrite",
]


@dataclass(frozen=True)
class FusionOption:
    """One option a fusion accepts in its config mapping.

    Attributes:
        types: the accepted Python types of the value.
        default: the value when the option is not given.
        doc: one line for error messages and ``--help`` style listings.
        check: optional extra validation; returns the normalized value or raises ``ValueError``
            with a message saying what is wrong.
    """

    types: tuple[type, ...]
    default: Any
    doc: str
    check: Callable[[Any], Any] | None = None

    def validate(self, fusion: str, name: str, value: Any) -> Any:
        """Check ``value`` and return its normalized form.

        Raises:
            FusionError: wrong type or rejected by ``check``; the message names the fusion and option.
        """
        if isinstance(value, bool) and bool not in self.types:
            ok = False
        else:
            ok = isinstance(value, self.types)
        if not ok:
            wanted = " or ".join(t.__name__ for t in self.types)
            raise FusionError(
                f"Fusion {fusion!r}: option {name!r} must be {wanted} ({self.doc}), "
                f"got {type(value).__name__}: {value!r}."
            )
        if self.check is None:
            return value
        try:
            return self.check(value)
        except ValueError as exc:
            raise FusionError(f"Fusion {fusion!r}: option {name!r}={value!r} is invalid: {exc}") from exc


def _regex_list(value: Sequence[str]) -> tuple[str, ...]:
    items = tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"every entry must be a regex string, got {type(item).__name__}: {item!r}")
        try:
            re.compile(item)
        except re.error as exc:
            raise ValueError(f"{item!r} is not a valid regex ({exc})") from exc
    return items


def _non_empty_regex_list(value: Sequence[str]) -> tuple[str, ...]:
    items = _regex_list(value)
    if not items:
        raise ValueError("give at least one regex (to fuse nothing, set the fusion to False)")
    return items


COMMON_OPTIONS: Mapping[str, FusionOption] = MappingProxyType(
    {
        "modules": FusionOption(
            (list, tuple),
            None,
            "regexes (re.search) over module paths that replace the spec's target_modules_patterns",
            _non_empty_regex_list,
        ),
        "exclude": FusionOption(
            (list, tuple),
            (),
            "regexes (re.search) over module paths of candidates to leave alone",
            _regex_list,
        ),
    }
)
"""Options every fusion accepts: ``modules`` (where to look) and ``exclude`` (what to skip)."""


@dataclass(frozen=True)
class FusionMatch:
    """One place in a candidate's traced graph where a spec's pattern matched.

    Families subclass this to carry what their rewrite needs (child names, node names, shapes).

    Attributes:
        description: one line for the plan, e.g. which child and which reshapes matched.
        nodes: names of the matched fx nodes, in dataflow order.
    """

    description: str
    nodes: tuple[str, ...]


@dataclass
class GraphRewrite:
    """What :meth:`FusionSpec.rewrite` did to a traced graph.

    Attributes:
        new_modules: child modules the rewritten graph calls, by child name.
        replaced: ``{old child name: new child name}``; the old child is dropped and the new one
            takes its place in the child order (so ``state_dict`` keeps its order).
        removed: further old children the rewritten graph no longer calls (e.g. the ``k_proj`` and
            ``v_proj`` that ``qkv_proj`` replaces along with ``q_proj``); they are dropped.
    """

    new_modules: dict[str, nn.Module]
    replaced: dict[str, str]
    removed: tuple[str, ...] = ()


class FusionSpec:
    """Base class of fusion recipes; register an instance with :func:`~surgery.register_fusion`.

    Class attributes a family sets:
        target_modules_patterns: regexes (``re.search``) over dotted module paths that select
            candidates; the ``modules`` option replaces them per call.
        options: extra options this fusion accepts (besides :data:`COMMON_OPTIONS`).
        no_match_message: said when a fusion finds nothing compatible; say what was looked for
            and how to point the fusion elsewhere.
        fused_class_prefix: the fused module's class name is this prefix + the original name.
        searches_everywhere: the fusion is found by dataflow in any module (its candidates are
            every module :meth:`is_candidate` accepts), so a candidate whose graph does not hold
            the pattern is normal: when :meth:`find_matches` starts its reason with
            ``NOTHING_HERE`` it is reported, but ``strict=True`` does not raise for it (it still
            does for a pattern that is there and refused, and for finding nothing at all).
        transformers_name: the name under which transformers' ``from_pretrained(fusion_config=...)``
            performs this same fusion with the same runtime layout, or ``None`` (it does not). A
            runtime-layout save writes such a fusion into ``config.json``'s ``fusion_config``;
            any other makes transformers refuse the checkpoint (:mod:`surgery.saved_config`).
    """

    target_modules_patterns: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[Mapping[str, FusionOption]] = MappingProxyType({})
    no_match_message: ClassVar[str] = "no candidate module matched this fusion's pattern."
    fused_class_prefix: ClassVar[str] = "Fused"
    searches_everywhere: ClassVar[bool] = False
    transformers_name: ClassVar[str | None] = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def all_options(self) -> dict[str, FusionOption]:
        """Every option this fusion accepts: the common ones, then the family's own."""
        return {**COMMON_OPTIONS, **self.options}

    def candidate_patterns(self, options: Mapping[str, Any]) -> tuple[str, ...]:
        """The path regexes that select candidates under ``options``."""
        modules = options.get("modules")
        return tuple(modules) if modules else tuple(self.target_modules_patterns)

    def fused_class_name(self, module: nn.Module) -> str:
        """Class name of the replacement for ``module`` (``Fused`` + the original class name)."""
        name = type(module).__name__
        return name if name.startswith(self.fused_class_prefix) else f"{self.fused_class_prefix}{name}"

    # ------------------------------------------------------------------ the recipe
    def is_candidate(self, module: nn.Module) -> bool:
        """Whether a module whose path matched is worth a plan entry at all (default: yes).

        A fusion found by dataflow anywhere in a model (``modules`` matching every path) uses it
        to leave modules that cannot hold its pattern out of the plan, instead of listing each as
        skipped.
        """
        return True

    def is_fusable(self, module: nn.Module) -> tuple[bool, str]:
        """Cheap structural check of a candidate before it is traced.

        Returns:
            ``(True, why)`` or ``(False, why not)``; the reason goes into the plan.
        """
        return True, "no structural precondition"

    def find_matches(self, module: nn.Module, graph: fx.Graph) -> tuple[list[FusionMatch], str]:
        """Match the dataflow pattern on ``graph`` (``module`` traced alone, children as leaves).

        Returns:
            ``(matches, reason)``: ``reason`` says why nothing matched when ``matches`` is empty.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement find_matches()")

    def rewrite(
        self,
        module: nn.Module,
        graph: fx.Graph,
        matches: Sequence[FusionMatch],
        *,
        materialize: bool,
    ) -> GraphRewrite:
        """Rewrite ``graph`` in place for ``matches`` and build the child modules it now calls.

        Never touches ``module``. With ``materialize=False`` (a preview) new parameters may live
        on the ``meta`` device; with ``True`` they hold the converted weights.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement rewrite()")

    def make_transforms(
        self,
        path: str,
        module: nn.Module,
        matches: Sequence[FusionMatch] | None = None,
    ) -> list[WeightTransform]:
        """Weight transforms original → fused layout for the (unfused) ``module`` at ``path``.

        Derived from the module itself (shapes, kernel sizes), never from a config, and scoped to
        ``path`` so they fire on that module's keys only.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement make_transforms()")
