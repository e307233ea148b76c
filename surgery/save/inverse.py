"""Which transforms a save inverts, and how each runtime name goes back to a checkpoint name.

:func:`reverting_transforms` filters the model's record by :class:`~surgery.record.Origin`: the
model's mapping is always inverted (the family's original layout, however the weights arrived);
legacy renames and the base-model prefix only when they fired at load, since nothing else says
the checkpoint had them; a load quantizer's additions when they fired; fusions always.
:func:`reversed_converters` reverses the converters and ranks them, so the save decides which
wins where two reverse onto one runtime key before :func:`route_by_precedence` routes anything.
:class:`InverseRenamer` names each output as the checkpoint did, and :class:`RecordedShapes` looks
up the checkpoint shapes the reversed ops need.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import torch
from torch import nn

from ..converter import WeightConverter, split_transforms
from ..errors import ConfigurationError, ConversionError
from ..fusion import fusion_transforms
from ..record import LoadRecord, Origin, record_of
from ..resolution import get_model_conversion_mapping
from ..routing import RouteConflict, route_keys
from ..transforms import PrefixChange, WeightRenaming, WeightTransform

__all__ = [
    "ConverterRoutes",
    "InverseRenamer",
    "RecordedShapes",
    "inverse_renamer",
    "reversed_converters",
    "reverting_transforms",
    "route_by_precedence",
]


def reverting_transforms(model: nn.Module, *, loaded: bool = True) -> list[WeightTransform]:
    """The forward transforms a save in original format inverts: the family's layout, once defined.

    Structural transforms (the model's conversion mapping: converters, renamings, prefix
    changes, and every fusion) are always inverted, however the weights arrived (an original
    checkpoint, a runtime-layout one, ``load_state_dict``): the output is the family's original
    (hub) layout. Renames that exist only for legacy checkpoints (``LayerNorm.gamma`` →
    ``.weight``) and the base-model prefix a checkpoint had or lacked are inverted only when they
    fired on load, so nothing the checkpoint did not have is invented; transforms a load's
    quantizer added are inverted when they fired. ``loaded=False``: as for a model never loaded.
    """
    record = record_of(model).load if loaded else None
    mapping = get_model_conversion_mapping(model, include_legacy=False)
    if record is None:
        return [t for t in mapping if not _placed_at_its_prefix(t, mapping)] + fusion_transforms(model)
    fired = {f.transform for f in record.fired if f.origin is not Origin.FUSION}
    structural = [t for t in mapping if not _placed_at_its_prefix(t, mapping) or t in fired]
    known = set(structural)
    # What the load's quantizer added to the mapping (update/get_weight_conversions) fired too.
    added = [t for t in record.of(Origin.MAPPING, Origin.QUANTIZER) if t not in known]
    return [
        *record.of(Origin.BASE_PREFIX_BEFORE),
        *record.of(Origin.LEGACY),
        *structural,
        *added,
        *record.of(Origin.BASE_PREFIX_AFTER),
        *fusion_transforms(model),
    ]


def _placed_at_its_prefix(t: WeightTransform, mapping: list[WeightTransform]) -> bool:
    """A ``PrefixChange(prefix_to_remove=P)`` of a sub-model whose keys its parent already places.

    Such an entry exists for a sub-model loaded on its own, from a checkpoint of its own whose
    keys start with ``P.``. Inside a parent whose scope for it already holds ``P``, which strips
    ``P`` itself, or whose mapping renames ``P`` to the sub-model's place (``^P.`` → the scope),
    the hub keys never hold ``P`` twice: inverting it would write ``P.P.*``, so it is inverted
    only when it fired. A parent that renames another component keeps the sub-model's ``P``.
    """
    if not isinstance(t, PrefixChange) or t.prefix_to_remove is None or t.model_prefix or not t.scope_prefix:
        return False
    scope, prefix = t.scope_prefix, t.prefix_to_remove
    if prefix in scope.split("."):  # the sub-model at P, or one inside it (``P.model``)
        return True
    for other in mapping:
        if other is t:
            continue
        if isinstance(other, PrefixChange) and other.prefix_to_remove == prefix and not other.model_prefix:
            outer = other.scope_prefix or ""
            if outer == "" or scope.startswith(outer + "."):
                return True  # a parent already strips P
        if (
            type(other) is not WeightRenaming
            or len(other.source_patterns) != 1
            or len(other.target_patterns) != 1
        ):
            continue
        source = other.source_patterns[0].replace("\\.", ".").lstrip("^").rstrip(".")
        target = other.target_patterns[0].rstrip(".")
        if (source == prefix or source.endswith("." + prefix)) and (
            target == scope or scope.endswith("." + target)
        ):
            return True
    return False


def reversed_converters(
    forward: list[WeightConverter], record: LoadRecord | None
) -> tuple[list[WeightConverter], list[tuple[bool, int]]]:
    """Each converter reversed, with its precedence where two reverse onto one runtime key.

    A whole model's converter and a sub-model's (an entry for the sub-model's own checkpoints)
    can both reverse onto one runtime key: the one that fired at load wins, then the outer one
    (the whole model's layout).

    Raises:
        ConfigurationError: the reverse of a converter is not a converter.
    """
    fired = set(record.transforms) if record is not None else set()
    reversed_: list[WeightConverter] = []
    precedence: list[tuple[bool, int]] = []
    for c in forward:
        r = c.reverse_transform()
        if not isinstance(r, WeightConverter):
            raise ConfigurationError(f"the reverse of {c!r} is not a converter.")
        depth = len((c.scope_prefix or "").split(".")) if c.scope_prefix else 0
        precedence.append((c in fired, -depth))
        reversed_.append(r)
    return reversed_, precedence


def inverse_renamer(
    model: nn.Module, renamings: list[WeightTransform], record: LoadRecord | None, runtime: Collection[str]
) -> InverseRenamer:
    """How a save names its outputs: the names the load read lead the way back.

    Unless the file held runtime names only (``runtime``: the model's keys): a runtime-layout
    checkpoint saves the hub layout, as a model never loaded does. Otherwise the hub's name where
    the plain chain gives it, else one the load read, never a mix.
    """
    read = record.source_shapes if record is not None else {}
    if read.keys() <= set(runtime):
        return InverseRenamer(renamings)
    hub_renamings, _ = split_transforms(reverting_transforms(model, loaded=False))
    return InverseRenamer(renamings, recorded=read, hub=InverseRenamer(hub_renamings))


class RecordedShapes:
    """The recorded checkpoint shapes, by the names the reversed renamings see, looked up per name.

    A save asks for a handful (one per converter target); renaming every recorded key up front
    would cost a routing pass over every key (``docs/benchmarks.md``). A name is resolved by renaming it back
    and checking that the forward renamings give it again; anything else falls back to routing
    every recorded key once.
    """

    def __init__(self, record: LoadRecord | None, rename: InverseRenamer) -> None:
        self._record = record
        self._rename = rename
        self._forward = [t for t in record.transforms if not isinstance(t, WeightConverter)] if record else []
        self._renamed = _Renamer(self._forward)
        self._table: dict[str, str] | None = None  # name -> recorded checkpoint key

    def get(self, name: str) -> tuple[int, ...] | None:
        """The shape the op chain saw for ``name``: the stored one, or the decoded one of a packed format."""
        if self._record is None:
            return None
        source = self._record.source_shapes
        key = self._rename(name)
        if key in source and self._renamed(key) == name:
            return self._as_decoded(key, source[key])
        if self._table is None:
            fwd = route_keys(list(source), self._forward) if self._forward else None
            self._table = {(fwd.routes[k].target_key if fwd is not None else k): k for k in source}
        found = self._table.get(name)
        return None if found is None else self._as_decoded(found, source[found])

    def _as_decoded(self, key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``shape`` as decoding made it, for a format whose decode changes shapes (``stored_region``:
        packed words); a ``meta`` run of ``decode`` with the recorded companions."""
        record = self._record
        assert record is not None
        companions = record.companions.get(key)
        quantizer = record.quantizer
        if not companions or quantizer is None or not callable(getattr(quantizer, "stored_region", None)):
            return shape
        stored = torch.empty(shape, dtype=record.source_dtypes[key], device="meta")
        return tuple(quantizer.decode(key, stored, dict(companions), None).shape)


class _Renamer:
    def __init__(self, renamings: list[WeightTransform]) -> None:
        self.renamings = renamings

    def __call__(self, key: str) -> str:
        for r in self.renamings:
            key, _ = r.rename_source_key(key)
        return key


class InverseRenamer:
    """The checkpoint name of a runtime name: one that the forward renamings turn back into it.

    Each renaming's inverse runs in reverse order. Where the renamings are not one-to-one, that
    plain chain can give a name the load would not read back: a sub-model's own renaming
    (LlavaOnevision-1.5's base model moving ``model.`` under ``language_model.``) inverted inside
    a parent whose renaming already put the key there writes ``model.model.layers.*``, which the
    parent's renaming would load as ``model.language_model.model.layers.*``. A plain chain that the
    forward renamings undo is kept as it is (the common case, one forward check per name);
    otherwise each step either inverts its renaming or leaves the name, keeping only steps that
    the forward renaming undoes exactly, inverting where both do (as the plain chain does), and the
    first complete chain wins. Nothing consistent found: the plain chain, as before.

    A prefix the load stripped from every key (the base-model prefix of a file that held it twice,
    as transformers writes GTE: ``new.gte.*`` read as ``gte.gte.*``) is put back even where the
    name already starts with it, so the file the model was loaded from is written back, not half
    of it (``new.*`` beside ``new.lm_head.*``). A plain name the load read (``recorded``) or the
    hub layout's name (``hub``: what a model never loaded writes) is kept; otherwise a chain that
    leads to a name the load read wins, so a file in transformers' own layout where it differs
    from the hub's never saves part hub and part neither.
    """

    def __init__(
        self,
        forward: list[WeightTransform],
        *,
        recorded: Collection[str] = (),
        hub: InverseRenamer | None = None,
    ) -> None:
        self._forward = forward
        self._hub = hub
        self._reverse = [r.reverse_transform() for r in forward]
        self.plain = _Renamer(self._reverse[::-1])
        self._renamed = _Renamer(forward)
        self._recorded = recorded

    def __call__(self, key: str) -> str:
        plain = self.plain(key)
        if plain in self._recorded or (not self._recorded and self._renamed(plain) == key):
            return plain
        if self._hub is not None and self._renamed(plain) == key and plain == self._hub(key):
            return plain  # the hub layout's name: a variant layout comes back in the hub layout
        if self._recorded:  # a name the load read, if one leads here: the file is written back as it was
            found = self._search(len(self._forward), key, set(), goal=self._recorded)
            if found is not None:
                return found
            if self._renamed(plain) == key:
                return plain
        found = self._search(len(self._forward), key, set())
        return plain if found is None else found

    def _search(
        self, step: int, key: str, dead: set[tuple[int, str]], *, goal: Collection[str] | None = None
    ) -> str | None:
        """A name that renamings ``[0, step)`` turn into ``key`` (one in ``goal`` when given);
        ``None`` if none (memoised in ``dead``)."""
        if step == 0:
            return key if goal is None or key in goal else None
        if (step, key) in dead:
            return None
        forward, reverse = self._forward[step - 1], self._reverse[step - 1]
        inverted, pattern = reverse.rename_source_key(key)
        if (
            isinstance(reverse, PrefixChange)
            and reverse.prefix_to_add is not None
            and not reverse.model_prefix
            and not reverse.scope_prefix
            and pattern is None
        ):
            inverted, pattern = f"{reverse.prefix_to_add}.{key}", "prefix already there"
        if (
            pattern is not None
            and inverted != key
            and forward.rename_source_key(inverted)[0] == key
            and (found := self._search(step - 1, inverted, dead, goal=goal)) is not None
        ):
            return found
        if (
            forward.rename_source_key(key)[0] == key
            and (found := self._search(step - 1, key, dead, goal=goal)) is not None
        ):
            return found
        dead.add((step, key))
        return None


class ConverterRoutes(NamedTuple):
    """The runtime keys routed through the reversed converters (:func:`route_by_precedence`)."""

    routes: dict[str, tuple[int, tuple[int, ...]]]  # key -> (source pattern index, wildcard indices)
    groups: list[tuple[int | None, str, tuple[str, ...]]]  # (converter, group key, runtime keys)


def route_by_precedence(
    keys: list[str], converters: list[WeightConverter], precedence: list[tuple[bool, int]]
) -> ConverterRoutes:
    """Route ``keys`` through ``converters``; where several could claim a key, the highest precedence wins.

    The save decides before routing: converters are routed one precedence level at a time, the
    highest first, and a key claimed at one level is not offered to the next. Within a level two
    converters claiming one key are a configuration error, as they are at load.

    Raises:
        ConversionError: two keys land on one runtime key.
    """
    levels = sorted(set(precedence), reverse=True) or [(False, 0)]
    routes: dict[str, tuple[int, tuple[int, ...]]] = {}
    groups: dict[str, tuple[int | None, str, tuple[str, ...]]] = {}
    first_of: dict[str, str] = {}
    remaining = keys
    for n, level in enumerate(levels):
        chosen = [i for i, p in enumerate(precedence) if p == level]
        level_converters = [converters[i] for i in chosen]
        routing = route_keys(remaining, level_converters)
        last = n == len(levels) - 1
        if routing.conflicts and not last:  # only among the keys this level claims
            claimed = [k for k in remaining if routing.routes[k].converter is not None]
            routing = route_keys(claimed, level_converters)
        if routing.conflicts:
            raise _collision(routing.conflicts[0])
        for tg in routing.groups.values():
            if tg.converter is None and not last:
                continue  # offered to the next level
            if tg.key in groups:
                raise _collision(RouteConflict(tg.key, first_of[tg.key], tg.source_keys[0]))
            converter = None if tg.converter is None else chosen[tg.converter]
            groups[tg.key] = (converter, tg.key, tuple(tg.source_keys))
            first_of[tg.key] = tg.source_keys[0]
            for k in tg.source_keys:
                route = routing.routes[k]
                routes[k] = (route.pattern_index or 0, route.index)
        remaining = [k for k in remaining if k not in routes]
    position = {k: i for i, k in enumerate(keys)}  # groups in the order their first key comes
    ordered = sorted(groups.values(), key=lambda g: min(position[k] for k in g[2]))
    return ConverterRoutes(routes, ordered)


def _collision(conflict: RouteConflict) -> ConversionError:
    return ConversionError(
        f"saving: {conflict}; the reversed converters collide. Check the mapping for two "
        "converters whose targets overlap."
    )
