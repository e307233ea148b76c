"""Converters: claim checkpoint keys and convert the tensors collected under them.

:class:`WeightConverter` is the transform that claims a key (at most one converter may match
any key) and runs a chain of :mod:`~surgery.ops` over every tensor collected under its source
patterns. A converter is a value (immutable, compared by what it does); the tensors collected for
it live in a :class:`Collector` that the caller (the loader, the saver) owns:
:meth:`Collector.add_tensor` files each tensor under its group's first target key,
:meth:`Collector.convert` orders what was collected into the slots the chain takes (one per source
pattern; a gathering pattern's tensors in wildcard-index order, with no index missing), runs the
chain and names the outputs after the target keys (:func:`expand_outputs`).

Example:
    >>> import torch
    >>> from surgery import ops
    >>> c = WeightConverter("experts.*.w1", "experts.w1", [ops.MergeModulelist()])
    >>> collector = Collector(c)
    >>> for i in (1, 0):
    ...     collector.add_tensor("experts.w1", f"experts.{i}.w1", 0, torch.full((2,), float(i)), index=(i,))
    >>> collector.convert("experts.w1")["experts.w1"].tolist()
    [[0.0, 0.0], [1.0, 1.0]]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from .errors import ConfigurationError, ConversionError
from .ops import ConversionOp, OpContext, Slot, reverse_chain, run_chain
from .transforms import TransformMatch, WeightTransform

__all__ = ["Collector", "WeightConverter", "expand_outputs", "split_transforms"]


class WeightConverter(WeightTransform):
    """Claim keys and convert the tensors collected under the source patterns with ``operations``.

    1→1, 1→N (e.g. ``Chunk``) and N→1 (e.g. ``Concatenate``) are always allowed; N→M needs an op
    with ``supports_many_to_many = True``.

    A converter holds no tensors: a :class:`Collector` gathers them per *target key* (so one
    converter serves every layer) and runs the chain.
    """

    def __init__(
        self,
        source_patterns: str | Sequence[str],
        target_patterns: str | Sequence[str],
        operations: Sequence[ConversionOp] = (),
        *,
        scope_prefix: str | None = None,
    ) -> None:
        super().__init__(source_patterns, target_patterns, scope_prefix=scope_prefix)
        ops = tuple(operations)
        bad = [op for op in ops if not isinstance(op, ConversionOp)]
        if bad:
            raise ConfigurationError(f"{self!r}: operations must be ConversionOp instances, got {bad!r}.")
        if (
            len(self.source_patterns) > 1
            and len(self.target_patterns) > 1
            and not any(op.supports_many_to_many for op in ops)
        ):
            raise ConfigurationError(
                f"{self!r} maps {len(self.source_patterns)} sources to {len(self.target_patterns)} targets; "
                "N→M needs an op with supports_many_to_many=True. Split it into N→1 or 1→N converters."
            )
        if not ops and (
            len(self.source_patterns) != len(self.target_patterns) or any(s.has_star for s in self._sources)
        ):
            raise ConfigurationError(f"{self!r} has no operations; only a 1→1 rename can do without one.")
        self.operations: tuple[ConversionOp, ...]
        object.__setattr__(self, "operations", ops)

    def _options(self) -> tuple[Any, ...]:
        return self.operations

    def _init_kwargs(self) -> dict[str, Any]:
        return {"operations": reverse_chain(self.operations)}

    def __repr__(self) -> str:
        base = super().__repr__()
        return f"{base[:-1]}, operations={list(getattr(self, 'operations', ()))!r})"

    def target_keys(self, m: TransformMatch) -> tuple[str, ...]:
        return tuple(m.prefix + t.expand(m.groups, m.stars) + m.suffix for t in self._targets)

    def _pairwise(self) -> bool:
        return False  # every source feeds every target of a converter

    @property
    def _target_stars(self) -> int:
        """How many wildcards the targets keep; a source's wildcards beyond these are gathered."""
        return max((t.n_stars for t in self._targets), default=0)

    def _gathered(self, pattern_index: int) -> int:
        """How many trailing wildcards of source ``pattern_index`` are gathered into one target."""
        return max(0, len(self._sources[pattern_index].star_groups) - self._target_stars)

    def gathers_from(self, pattern_index: int) -> bool:
        """Whether keys of source ``pattern_index`` are gathered into a list (ordered by index)."""
        return self._gathered(pattern_index) > 0

    @property
    def gathers(self) -> bool:
        """Whether a source has more index wildcards than the targets keep (a merge).

        ``experts.*.w1 -> experts.gate`` gathers every expert; so does
        ``layers.*.experts.*.w1 -> layers.*.experts.gate`` (one merge per layer: the targets keep
        the first wildcard, the second is gathered).
        """
        return any(self._gathered(i) for i in range(len(self._sources)))

    def gather_index(self, m: TransformMatch) -> tuple[int, ...]:
        """The gathered wildcard values of a match: its position in the merge (``()`` if none).

        Example:
            >>> from surgery import ops
            >>> c = WeightConverter("layers.*.experts.*.w1", "layers.*.experts.gate", [ops.MergeModulelist()])
            >>> c.gather_index(c.match("model.layers.3.experts.10.w1.weight"))
            (10,)
        """
        n = self._gathered(m.pattern_index)
        return tuple(int(x) for x in m.stars[len(m.stars) - n :]) if n else ()

    def pattern_number(self, source_pattern: str | int) -> int:
        if isinstance(source_pattern, int) and not isinstance(source_pattern, bool):
            if 0 <= source_pattern < len(self.source_patterns):
                return source_pattern
        elif source_pattern in self.source_patterns:
            return self.source_patterns.index(source_pattern)
        raise ConversionError(
            f"{self!r}: {source_pattern!r} is not one of its source patterns {list(self.source_patterns)}; "
            "pass the pattern text or its index as returned by rename_source_key() or match()."
        )

    def expand_target_keys(self, first_target_key: str) -> tuple[str, ...]:
        """All target keys of the group whose first target key is ``first_target_key``."""
        if len(self._targets) == 1:
            return (first_target_key,)
        # The first target's text sits somewhere inside the key; rebuild the others around it.
        m = self._targets[0].locate(first_target_key)
        if m is None:
            raise ConversionError(
                f"{self!r}: cannot locate {self.target_patterns[0]!r} in {first_target_key!r}."
            )
        prefix, groups, stars, suffix = m
        return tuple(prefix + t.expand(groups, stars) + suffix for t in self._targets)


class Collector:
    """The tensors collected for one converter, per target key, until each group is converted.

    The loader and the saver own one (per converter, or per group); the converter itself stays a
    value that any number of collectors, threads and models share.

    Args:
        converter: the converter whose chain runs over what is collected.
    """

    def __init__(self, converter: WeightConverter) -> None:
        self._converter = converter
        self._collected: dict[str, dict[int, dict[tuple[int, ...], Any]]] = {}
        self._sources_of: dict[str, dict[int, dict[tuple[int, ...], str]]] = {}

    @property
    def converter(self) -> WeightConverter:
        """The converter this collector collects for."""
        return self._converter

    def add_tensor(
        self,
        target_key: str,
        source_key: str,
        source_pattern: str | int,
        tensor: torch.Tensor | Future[torch.Tensor] | Any,
        *,
        index: tuple[int, ...] = (),
    ) -> None:
        """File ``tensor`` (or a future / zero-argument callable) for ``target_key``.

        Args:
            target_key: the group's first target key (``route_keys`` gives it).
            source_key: the checkpoint key, for error messages.
            source_pattern: the source pattern that matched, as text or as its index.
            tensor: a tensor, a :class:`~concurrent.futures.Future` of one, or a zero-argument callable.
            index: the values the wildcards captured (:meth:`gather_index`, or every wildcard of the
                source: the ones the targets keep are dropped); it decides the position in the merge.

        Raises:
            ConversionError: when another key already landed at the same position, or
                ``source_pattern`` is not one of this converter's patterns.
        """
        i = self._converter.pattern_number(source_pattern)
        n = self._converter._gathered(i)
        index = tuple(int(x) for x in index)
        if len(index) > n:
            index = index[len(index) - n :] if n else ()
        elif len(index) < n:
            raise ConversionError(
                f"{self._converter!r}: {source_key!r} matched {self._converter.source_patterns[i]!r}, which gathers {n} index "
                f"wildcard(s), but add_tensor got index={index!r}; pass index=gather_index(match)."
            )
        slot = self._collected.setdefault(target_key, {}).setdefault(i, {})
        names = self._sources_of.setdefault(target_key, {}).setdefault(i, {})
        if index in slot:
            raise ConversionError(
                f"{self._converter!r}: checkpoint keys {names[index]!r} and {source_key!r} both land on "
                f"{target_key!r} (pattern {self._converter.source_patterns[i]!r}, index {index}); remove one."
            )
        slot[index] = tensor
        names[index] = source_key

    def pending_targets(self) -> list[str]:
        """The target keys with tensors collected and not yet converted."""
        return list(self._collected)

    def is_pending(self, target_key: str) -> bool:
        """Whether tensors were collected for ``target_key`` and not yet converted."""
        return target_key in self._collected

    def convert(
        self,
        target_key: str,
        ctx: OpContext | None = None,
        *,
        target_keys: Sequence[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Run the op chain for ``target_key`` and return ``{runtime_key: tensor}``.

        Args:
            target_key: the group's first target key, as given to :meth:`add_tensor`.
            ctx: target shapes and config for the ops (key names are filled in here).
            target_keys: every target key of the group (``TargetGroup.target_keys``); without it they
                are rebuilt from ``target_key`` and the target patterns.

        Raises:
            ConversionError: a source pattern got nothing, an index is missing from a merge, or an
                op failed; the message names this transform, the keys and the target.
        """
        collected = self._collected.pop(target_key, None)
        names = self._sources_of.pop(target_key, {})
        if collected is None:
            raise ConversionError(f"{self._converter!r}: nothing was collected for {target_key!r}.")
        source_keys = tuple(k for i in sorted(names) for _, k in sorted(names[i].items()))
        conv = self._converter
        slots = _gather_slots(conv, collected, names, target_key)
        if target_keys is not None:
            targets = tuple(target_keys)
            if len(targets) != len(conv.target_patterns):
                raise ConversionError(
                    f"{conv!r}: got {len(targets)} target keys {list(targets)} for {len(conv.target_patterns)} "
                    f"target pattern(s); pass the group's target keys in pattern order."
                )
        else:
            targets = conv.expand_target_keys(target_key)
        base = ctx or OpContext()
        ctx = OpContext(
            n_targets=len(targets),
            target_shapes=base.target_shapes,
            config=base.config,
            source_keys=source_keys,
            target_keys=targets,
            transform=repr(conv),
            keep_residue=base.keep_residue,
            residue=base.residue,
        )
        out = run_chain(conv.operations, slots, ctx)
        return expand_outputs(targets, out, conv)


def split_transforms(
    transforms: Iterable[WeightTransform],
) -> tuple[list[WeightTransform], list[WeightConverter]]:
    """Renamings (in order) and converters (in order) of a transform list."""
    renamings: list[WeightTransform] = []
    converters: list[WeightConverter] = []
    for t in transforms:
        if isinstance(t, WeightConverter):
            converters.append(t)
        elif isinstance(t, WeightTransform):
            renamings.append(t)
        else:
            raise ConfigurationError(f"{t!r} is not a WeightTransform.")
    return renamings, converters


def _gather_slots(
    transform: WeightConverter,
    collected: dict[int, dict[tuple[int, ...], Any]],
    names: dict[int, dict[tuple[int, ...], str]],
    target_key: str,
) -> list[Slot]:
    """Order collected tensors into slots: one per source pattern, lists ordered by wildcard index.

    Raises:
        ConversionError: a source pattern has no tensor, or the indices have a gap.
    """
    slots: list[Slot] = []
    for i, sp in enumerate(transform.compiled_sources):
        got = collected.get(i)
        if not got:
            raise ConversionError(
                f"{transform!r}: no checkpoint key matched source pattern {sp.text!r} for target "
                f"{target_key!r}; the checkpoint is incomplete or the pattern is wrong."
            )
        if transform.gathers_from(i):
            indices = sorted(got)
            _check_complete(transform, sp.text, indices, names.get(i, {}), target_key)
            slots.append([_resolve(got[ix]) for ix in indices])
        else:
            if len(got) != 1:
                raise ConversionError(
                    f"{transform!r}: {len(got)} keys matched {sp.text!r} for {target_key!r}, expected one."
                )
            (value,) = got.values()
            slots.append(_resolve(value))
    return slots


def _check_complete(
    transform: WeightConverter,
    pattern: str,
    indices: list[tuple[int, ...]],
    names: dict[tuple[int, ...], str],
    target_key: str,
) -> None:
    """Gathered indices must run from 0 without a gap (and form a full grid for several wildcards)."""
    dims = len(indices[0])
    for d in range(dims):
        values = sorted({ix[d] for ix in indices})
        n_missing = values[-1] + 1 - len(values)  # sorted, distinct, from 0: no gap iff last == len - 1
        if n_missing:
            # The first few gaps, in at most len(values) + 8 steps: one stray huge index (a key
            # ``experts.99999999999``) must not make this loop or a set that large.
            seen, missing = set(values), []
            for i in itertools.count():
                if i not in seen:
                    missing.append(i)
                    if len(missing) == min(8, n_missing):
                        break
            shown = ", ".join(map(str, missing)) + (" ..." if n_missing > 8 else "")
            example = names.get(indices[0], "")
            raise ConversionError(
                f"{transform!r}: index {shown} of {pattern!r} is missing for {target_key!r} "
                f"(found {len(values)} indices up to {values[-1]}, e.g. {example!r}). "
                "Every index from 0 must be present; the checkpoint is incomplete."
            )
    expected_count = math.prod(len({ix[d] for ix in indices}) for d in range(dims))
    if len(indices) != expected_count:
        present = set(indices)
        grid = itertools.product(*(sorted({ix[d] for ix in indices}) for d in range(dims)))
        absent = next(ix for ix in grid if ix not in present)
        raise ConversionError(
            f"{transform!r}: index {absent} of {pattern!r} is missing for {target_key!r}; the gathered "
            "indices must form a full grid. The checkpoint is incomplete."
        )


def _resolve(value: Any) -> Any:
    if isinstance(value, Future):
        return value.result()
    if callable(value) and not isinstance(value, torch.Tensor):
        return value()
    return value


def expand_outputs(
    targets: tuple[str, ...], out: list[Slot], transform: WeightConverter
) -> dict[str, torch.Tensor]:
    """Name the chain's output slots: a list output fills the target's ``*`` with its position."""
    result: dict[str, torch.Tensor] = {}
    for key, slot in zip(targets, out):
        if isinstance(slot, list):
            if "*" not in key:
                raise ConversionError(
                    f"{transform!r} produced {len(slot)} tensors for {key!r}, which has no '*' to number them; "
                    "add MergeModulelist or a '*' in the target."
                )
            for i, t in enumerate(slot):
                result[key.replace("*", str(i), 1)] = t
        else:
            if "*" in key:
                raise ConversionError(
                    f"{transform!r} produced one tensor for {key!r}, whose '*' needs a list; add SplitModulelist."
                )
            result[key] = slot
    return result
