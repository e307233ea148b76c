r"""Weight transforms: how checkpoint keys become runtime keys, and back.

* :class:`WeightRenaming` renames keys. Every renaming that matches a key fires, in list order,
  each on the output of the previous one; a renaming never claims a key.
* :class:`PrefixChange` is a renaming that adds or removes one whole dotted prefix.
* :class:`WeightConverter` claims a key (at most one converter may match any key) and runs a
  chain of :mod:`~surgery.ops` over every tensor collected under its source patterns.

A transform whose ``scope_prefix`` is set fires only on keys under ``f"{scope_prefix}."``; the
prefix is stripped before matching (so ``^`` anchors at the scoped key) and put back afterwards.
Inverses are derived mechanically with :meth:`WeightTransform.reverse_transform`.

Example:
    >>> from surgery import WeightRenaming
    >>> r = WeightRenaming(r"\.block_sparse_moe\.", ".mlp.")
    >>> r.rename_source_key("model.layers.0.block_sparse_moe.gate.weight")
    ('model.layers.0.mlp.gate.weight', '\\.block_sparse_moe\\.')
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

import torch

from .collection import expand_outputs, gather_slots
from .errors import ConfigurationError, ConversionError, PatternError
from .ops import ConversionOp, OpContext, reverse_chain, run_chain
from .patterns import SourcePattern, TargetPattern, compile_source, parse_target, reverse_pair

__all__ = [
    "PrefixChange",
    "TransformMatch",
    "WeightConverter",
    "WeightRenaming",
    "WeightTransform",
    "legacy_renamings",
    "split_transforms",
]


class TransformMatch(NamedTuple):
    """Where a transform matched a key: the text around the match, groups and wildcard indices.

    (An immutable record made once per key on the exact path, hence a ``NamedTuple``.)
    """

    pattern_index: int
    prefix: str
    suffix: str
    groups: tuple[str, ...]
    stars: tuple[str, ...]


_new_match = tuple.__new__  # TransformMatch from its fields in order, without keyword handling


def _as_tuple(patterns: str | Sequence[str], what: str) -> tuple[str, ...]:
    if isinstance(patterns, str):
        return (patterns,)
    out = tuple(patterns)
    if not out or not all(isinstance(p, str) for p in out):
        raise PatternError(f"{what} must be a string or a non-empty list of strings, got {patterns!r}.")
    return out


def _check_scope(scope_prefix: object) -> None:
    if scope_prefix is not None and (not isinstance(scope_prefix, str) or scope_prefix.endswith(".")):
        raise ConfigurationError(
            f'scope_prefix must be a dotted module path without a trailing dot ("" for the root), '
            f"got {scope_prefix!r}."
        )


class WeightTransform:
    """Base of all transforms: source patterns → target patterns, optionally scoped.

    Args:
        source_patterns: one regex or a list (see :mod:`surgery.patterns`).
        target_patterns: one template or a list.
        scope_prefix: dotted path of the sub-model this transform is scoped to (``""`` is the root).
    """

    def __init__(
        self,
        source_patterns: str | Sequence[str],
        target_patterns: str | Sequence[str],
        *,
        scope_prefix: str | None = None,
    ) -> None:
        self.source_patterns: tuple[str, ...] = _as_tuple(source_patterns, "source_patterns")
        self.target_patterns: tuple[str, ...] = _as_tuple(target_patterns, "target_patterns")
        _check_scope(scope_prefix)
        self.scope_prefix = scope_prefix
        self._sources: tuple[SourcePattern, ...] = tuple(compile_source(p) for p in self.source_patterns)
        self._targets: tuple[TargetPattern, ...] = tuple(parse_target(p) for p in self.target_patterns)
        self._check_references()
        self._used = False

    def _pairwise(self) -> bool:
        """Whether source i renames to target i (otherwise every source feeds every target)."""
        return len(self._targets) == len(self._sources) and len(self._targets) > 1

    def _check_references(self) -> None:
        """Every ``\\k`` of a target must name a capture group of each source that feeds it."""
        for j, t in enumerate(self._targets):
            feeding = [self._sources[j]] if self._pairwise() else list(self._sources)
            for sp in feeding:
                if t.max_ref > len(sp.user_groups):
                    raise PatternError(
                        f"Target {t.text!r} refers to \\{t.max_ref}, but source pattern {sp.text!r} has only "
                        f"{len(sp.user_groups)} capture group(s). Add the group to the source or fix the reference."
                    )

    # ------------------------------------------------------------------ identity
    def __repr__(self) -> str:
        scope = f", scope_prefix={self.scope_prefix!r}" if self.scope_prefix is not None else ""
        src = self.source_patterns[0] if len(self.source_patterns) == 1 else list(self.source_patterns)
        tgt = self.target_patterns[0] if len(self.target_patterns) == 1 else list(self.target_patterns)
        return f"{type(self).__name__}({src!r} -> {tgt!r}{scope})"

    def _init_kwargs(self) -> dict[str, Any]:
        return {}

    def copy(self) -> WeightTransform:
        """A fresh copy with the same patterns and scope and no recorded state."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._used = False
        new._reset_state()
        return new

    def scoped(self, scope_prefix: str | None) -> WeightTransform:
        """A fresh copy scoped to ``scope_prefix``."""
        _check_scope(scope_prefix)
        new = self.copy()
        new.scope_prefix = scope_prefix
        return new

    def _reset_state(self) -> None:
        """Forget per-load state. Renamings keep none; converters override this."""

    # ------------------------------------------------------------------ matching
    def match(self, key: str) -> TransformMatch | None:
        """Match ``key`` (scope applied); the leftmost match wins, ties go to the earlier pattern."""
        head = ""
        if self.scope_prefix:
            scope = self.scope_prefix + "."
            if not key.startswith(scope):
                return None
            head, key = scope, key[len(scope) :]
        sources = self._sources
        i = 0
        m = sources[0].regex.search(key)
        for j in range(1, len(sources)):
            other = sources[j].regex.search(key)
            if other is not None and (m is None or other.start() < m.start()):
                i, m = j, other
        if m is None:
            return None
        sp = sources[i]
        groups = tuple([m.group(g) or "" for g in sp.user_groups]) if sp.user_groups else ()
        stars = tuple([m.group(g) for g in sp.star_groups]) if sp.star_groups else ()
        start, end = m.span()
        return _new_match(TransformMatch, (i, head + key[:start], key[end:], groups, stars))

    def target_index(self, pattern_index: int) -> int:
        """Which target a match of source ``pattern_index`` is renamed to (pairwise, else the first)."""
        return pattern_index if self._pairwise() else 0

    def target_keys(self, m: TransformMatch) -> tuple[str, ...]:
        """Every runtime key this match produces (``*`` kept where the op chain fills it)."""
        targets = (self._targets[m.pattern_index],) if self._pairwise() else self._targets
        return tuple(m.prefix + t.expand(m.groups, m.stars) + m.suffix for t in targets)

    def rename_source_key(self, source_key: str) -> tuple[str, str | None]:
        """Return ``(renamed_key, source_pattern)``; ``(source_key, None)`` when nothing matched.

        With several targets the key is renamed to the first (the op chain produces the rest).
        """
        m = self.match(source_key)
        if m is None:
            return source_key, None
        t = self._targets[self.target_index(m.pattern_index)]
        return m.prefix + t.expand(m.groups, m.stars) + m.suffix, self.source_patterns[m.pattern_index]

    # ------------------------------------------------------------------ usage
    def was_used(self) -> bool:
        """Whether an output of this transform was actually loaded into the model."""
        return self._used

    def mark_used(self) -> None:
        self._used = True

    # ------------------------------------------------------------------ reversal
    def reverse_transform(self) -> WeightTransform:
        """The inverse transform (targets become sources), with the same scope."""
        n_s, n_t = len(self.source_patterns), len(self.target_patterns)
        if n_t == n_s:
            pairs = [reverse_pair(s, t) for s, t in zip(self.source_patterns, self.target_patterns)]
            new_src = [p[0] for p in pairs]
            new_tgt = [p[1] for p in pairs]
        else:
            first = self.source_patterns[0]
            new_src = [reverse_pair(first, t)[0] for t in self.target_patterns]
            new_tgt = [reverse_pair(s, self.target_patterns[0])[1] for s in self.source_patterns]
        return self._make_reverse(new_src, new_tgt)

    def _make_reverse(self, sources: list[str], targets: list[str]) -> WeightTransform:
        return type(self)(sources, targets, scope_prefix=self.scope_prefix, **self._init_kwargs())


class WeightRenaming(WeightTransform):
    """Rename keys. Never claims a key: later renamings and one converter may still fire.

    Source and target lists are paired one to one, or several sources share one target.
    """

    def __init__(
        self,
        source_patterns: str | Sequence[str],
        target_patterns: str | Sequence[str],
        *,
        scope_prefix: str | None = None,
    ) -> None:
        super().__init__(source_patterns, target_patterns, scope_prefix=scope_prefix)
        if len(self.target_patterns) not in (1, len(self.source_patterns)):
            raise ConfigurationError(
                f"{self!r}: a renaming needs one target, or one target per source "
                f"({len(self.source_patterns)} sources, {len(self.target_patterns)} targets)."
            )

    def reverse_transform(self) -> WeightTransform:
        if len(self.target_patterns) == 1 and len(self.source_patterns) > 1:
            raise PatternError(
                f"{self!r} maps several sources to one target and cannot be reversed; "
                "give one target per source."
            )
        return super().reverse_transform()


class PrefixChange(WeightRenaming):
    """Add or remove one whole dotted prefix, optionally right after ``model_prefix``.

    Adding a prefix that is already there does nothing.

    Example:
        >>> PrefixChange(prefix_to_add="model").rename_source_key("layers.0.weight")[0]
        'model.layers.0.weight'
        >>> PrefixChange(prefix_to_remove="bad_prefix", model_prefix="model.layers").rename_source_key(
        ...     "model.layers.bad_prefix.weight")[0]
        'model.layers.weight'
    """

    def __init__(
        self,
        prefix_to_add: str | None = None,
        prefix_to_remove: str | None = None,
        model_prefix: str | None = None,
        *,
        scope_prefix: str | None = None,
    ) -> None:
        if (prefix_to_add is None) == (prefix_to_remove is None):
            raise ConfigurationError(
                "PrefixChange needs exactly one of prefix_to_add=... or prefix_to_remove=...."
            )
        for name, value in (
            ("prefix_to_add", prefix_to_add),
            ("prefix_to_remove", prefix_to_remove),
            ("model_prefix", model_prefix),
        ):
            if value is not None and (not value or value.startswith(".") or value.endswith(".")):
                raise ConfigurationError(
                    f"PrefixChange({name}={value!r}): give a dotted name without outer dots."
                )
        self.prefix_to_add = prefix_to_add
        self.prefix_to_remove = prefix_to_remove
        self.model_prefix = model_prefix
        head = re.escape(model_prefix) + r"\." if model_prefix else ""
        head_t = model_prefix + "." if model_prefix else ""
        if prefix_to_add is not None:
            src = rf"^{head}(?!{re.escape(prefix_to_add)}\.)(.+)"
            tgt = head_t + prefix_to_add + r".\1"
        else:
            src = rf"^{head}{re.escape(str(prefix_to_remove))}\.(.+)"  # checked above: not None
            tgt = head_t + r"\1"
        super().__init__(src, tgt, scope_prefix=scope_prefix)

    def __repr__(self) -> str:
        what = (
            f"prefix_to_add={self.prefix_to_add!r}"
            if self.prefix_to_add
            else f"prefix_to_remove={self.prefix_to_remove!r}"
        )
        mp = f", model_prefix={self.model_prefix!r}" if self.model_prefix else ""
        scope = f", scope_prefix={self.scope_prefix!r}" if self.scope_prefix is not None else ""
        return f"PrefixChange({what}{mp}{scope})"

    def reverse_transform(self) -> WeightTransform:
        return PrefixChange(
            prefix_to_add=self.prefix_to_remove,
            prefix_to_remove=self.prefix_to_add,
            model_prefix=self.model_prefix,
            scope_prefix=self.scope_prefix,
        )


class WeightConverter(WeightTransform):
    """Claim keys and convert the tensors collected under the source patterns with ``operations``.

    1→1, 1→N (e.g. ``Chunk``) and N→1 (e.g. ``Concatenate``) are always allowed; N→M needs an op
    with ``supports_many_to_many = True``.

    Collected tensors are kept per *target key*, so one converter instance serves every layer:
    :meth:`add_tensor` files a tensor (or a future, or a zero-argument callable), :meth:`convert`
    runs the chain for one target key and forgets its inputs.
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
        self.operations: tuple[ConversionOp, ...] = ops
        self._reset_state()

    def _reset_state(self) -> None:
        self._collected: dict[str, dict[int, dict[tuple[int, ...], Any]]] = {}
        self._sources_of: dict[str, dict[int, dict[tuple[int, ...], str]]] = {}

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

    # ------------------------------------------------------------------ collection
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
        i = self._pattern_number(source_pattern)
        n = self._gathered(i)
        index = tuple(int(x) for x in index)
        if len(index) > n:
            index = index[len(index) - n :] if n else ()
        elif len(index) < n:
            raise ConversionError(
                f"{self!r}: {source_key!r} matched {self.source_patterns[i]!r}, which gathers {n} index "
                f"wildcard(s), but add_tensor got index={index!r}; pass index=gather_index(match)."
            )
        slot = self._collected.setdefault(target_key, {}).setdefault(i, {})
        names = self._sources_of.setdefault(target_key, {}).setdefault(i, {})
        if index in slot:
            raise ConversionError(
                f"{self!r}: checkpoint keys {names[index]!r} and {source_key!r} both land on "
                f"{target_key!r} (pattern {self.source_patterns[i]!r}, index {index}); remove one."
            )
        slot[index] = tensor
        names[index] = source_key

    def _pattern_number(self, source_pattern: str | int) -> int:
        if isinstance(source_pattern, int) and not isinstance(source_pattern, bool):
            if 0 <= source_pattern < len(self.source_patterns):
                return source_pattern
        elif source_pattern in self.source_patterns:
            return self.source_patterns.index(source_pattern)
        raise ConversionError(
            f"{self!r}: {source_pattern!r} is not one of its source patterns {list(self.source_patterns)}; "
            "pass the pattern text or its index as returned by rename_source_key() or match()."
        )

    def pending_targets(self) -> list[str]:
        return list(self._collected)

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
            raise ConversionError(f"{self!r}: nothing was collected for {target_key!r}.")
        source_keys = tuple(k for i in sorted(names) for _, k in sorted(names[i].items()))
        slots = gather_slots(self, collected, names, target_key)
        if target_keys is not None:
            targets = tuple(target_keys)
            if len(targets) != len(self._targets):
                raise ConversionError(
                    f"{self!r}: got {len(targets)} target keys {list(targets)} for {len(self._targets)} "
                    f"target pattern(s); pass the group's target keys in pattern order."
                )
        else:
            targets = self._expand_target_keys(target_key)
        base = ctx or OpContext()
        ctx = OpContext(
            n_targets=len(self._targets),
            target_shapes=base.target_shapes,
            config=base.config,
            source_keys=source_keys,
            target_keys=targets,
            transform=repr(self),
        )
        out = run_chain(self.operations, slots, ctx)
        return expand_outputs(targets, out, self)

    def _expand_target_keys(self, first_target_key: str) -> tuple[str, ...]:
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


def legacy_renamings() -> list[WeightTransform]:
    """The built-in renames every model gets: ``LayerNorm.gamma/beta`` → ``LayerNorm.weight/bias``."""
    return [
        WeightRenaming(r"LayerNorm\.gamma", "LayerNorm.weight"),
        WeightRenaming(r"LayerNorm\.beta", "LayerNorm.bias"),
    ]


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
