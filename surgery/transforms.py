r"""Weight transforms: how checkpoint keys become runtime keys, and back.

* :class:`WeightRenaming` renames keys. Every renaming that matches a key fires, in list order,
  each on the output of the previous one; a renaming never claims a key.
* :class:`PrefixChange` is a renaming that adds or removes one whole dotted prefix.
* :class:`~surgery.converter.WeightConverter` (in :mod:`surgery.converter`) claims a key and
  runs a chain of :mod:`~surgery.ops` over the tensors collected under its source patterns.

A transform whose ``scope_prefix`` is set fires only on keys under ``f"{scope_prefix}."``; the
prefix is stripped before matching (so ``^`` anchors at the scoped key) and put back afterwards.
Inverses are derived mechanically with :meth:`WeightTransform.reverse_transform`.

Transforms are values: immutable once built, equal (and hashing alike) when they have the same
type, patterns, scope and options. What a load did with them is kept elsewhere (the model's
record, :mod:`surgery.record`), and the tensors a converter collects live in a
:class:`~surgery.converter.Collector` its caller owns.

Example:
    >>> from surgery import WeightRenaming
    >>> r = WeightRenaming(r"\.block_sparse_moe\.", ".mlp.")
    >>> r.rename_source_key("model.layers.0.block_sparse_moe.gate.weight")
    ('model.layers.0.mlp.gate.weight', '\\.block_sparse_moe\\.')
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from .errors import ConfigurationError, ImmutableError, PatternError
from .patterns import SourcePattern, TargetPattern, compile_source, parse_target, reverse_pair

__all__ = [
    "IndexOffsetRenaming",
    "LayerPairCollapse",
    "PrefixChange",
    "TransformMatch",
    "WeightRenaming",
    "WeightTransform",
    "legacy_renamings",
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

    A transform is a value: its attributes cannot be reassigned once it is built, and two
    transforms are equal when their type, patterns, scope and options are. (A subclass sets its
    own fields before calling ``super().__init__``, or with ``object.__setattr__`` as a frozen
    dataclass does.)

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
        object.__setattr__(self, "_frozen", True)

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
    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise ImmutableError(
                f"{self!r} is immutable: cannot set {name!r}. Build a new transform instead "
                "(scoped(...) for another scope); a subclass sets its fields before super().__init__()."
            )
        object.__setattr__(self, name, value)

    def _options(self) -> tuple[Any, ...]:
        """What a subclass adds to the patterns and scope to say what it does (its options)."""
        return ()

    def _value(self) -> tuple[Any, ...]:
        return (type(self), self.source_patterns, self.target_patterns, self.scope_prefix, self._options())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WeightTransform):
            return NotImplemented
        return self is other or self._value() == other._value()

    def __hash__(self) -> int:
        return hash((type(self), self.source_patterns, self.target_patterns, self.scope_prefix))

    def __repr__(self) -> str:
        scope = f", scope_prefix={self.scope_prefix!r}" if self.scope_prefix is not None else ""
        src = self.source_patterns[0] if len(self.source_patterns) == 1 else list(self.source_patterns)
        tgt = self.target_patterns[0] if len(self.target_patterns) == 1 else list(self.target_patterns)
        return f"{type(self).__name__}({src!r} -> {tgt!r}{scope})"

    def _init_kwargs(self) -> dict[str, Any]:
        return {}

    def copy(self) -> WeightTransform:
        """A distinct object equal to this one (a transform list may hold each object once)."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def scoped(self, scope_prefix: str | None) -> WeightTransform:
        """This transform scoped to ``scope_prefix`` (a new value)."""
        _check_scope(scope_prefix)
        new = self.copy()
        object.__setattr__(new, "scope_prefix", scope_prefix)
        return new

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
        return TransformMatch(i, head + key[:start], key[end:], groups, stars)

    @property
    def compiled_sources(self) -> tuple[SourcePattern, ...]:
        """The source patterns, compiled (:func:`~surgery.patterns.compile_source`)."""
        return self._sources

    @property
    def digit_blind(self) -> bool:
        """Whether keys differing only in the digits of numeric components match alike.

        True when every source pattern is digit-blind (:func:`~surgery.patterns.is_digit_blind`)
        and the scope holds no digit (``startswith`` on a scope like ``"blocks.0"`` tells
        ``blocks.0.x`` from ``blocks.1.x``).
        """
        scope = self.scope_prefix or ""
        return all(sp.digit_blind for sp in self._sources) and not any(c in "0123456789" for c in scope)

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


class IndexOffsetRenaming(WeightRenaming):
    r"""A renaming whose first capture group is an index moved by ``offset``.

    For per-layer lists that do not start at layer 0 in the checkpoint: with ``offset=1``,
    ``attn_queries\.(\d+)`` → ``layers.\1.query`` renames ``attn_queries.0`` to
    ``layers.1.query``. The reverse renaming moves the index back by ``offset``.

    Example:
        >>> IndexOffsetRenaming(r"queries\.(\d+)", r"layers.\1.query", offset=1).rename_source_key("queries.4")[0]
        'layers.5.query'
    """

    def __init__(
        self,
        source_patterns: str | Sequence[str],
        target_patterns: str | Sequence[str],
        *,
        offset: int,
        scope_prefix: str | None = None,
    ) -> None:
        super().__init__(source_patterns, target_patterns, scope_prefix=scope_prefix)
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise ConfigurationError(f"IndexOffsetRenaming(offset={offset!r}): the offset must be an int.")
        self.offset: int
        object.__setattr__(self, "offset", offset)
        if any(not sp.user_groups for sp in self._sources):
            raise PatternError(f"{self!r}: every source pattern needs a capture group holding the index.")
        if any("\\1" not in t.text for t in self._targets):
            raise PatternError(f"{self!r}: every target must place the index with \\1.")

    def _make_reverse(self, sources: list[str], targets: list[str]) -> WeightTransform:
        return IndexOffsetRenaming(sources, targets, offset=-self.offset, scope_prefix=self.scope_prefix)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, offset={self.offset})"

    def _options(self) -> tuple[Any, ...]:
        return (self.offset,)

    @property
    def digit_blind(self) -> bool:
        return False  # the index is rewritten, so keys differing in digits route differently

    def match(self, key: str) -> TransformMatch | None:
        m = super().match(key)
        if m is None:
            return None
        index = m.groups[0]
        if not index.isdigit() or index != str(int(index)):
            return None  # not a plain index (``09`` would not come back as written)
        shifted = int(index) + self.offset
        if shifted < 0:
            return None
        return m._replace(groups=(str(shifted), *m.groups[1:]))


_PAIR_BLOCKS = ("mixer", "attn_alpha", "mlp_alpha")  # names in the two-block layout
_PAIR_LAYER = ("self_attn", "mlp", "lambda_1", "lambda_2")  # names in the one-layer layout


class LayerPairCollapse(WeightRenaming):
    r"""Decoder layers stored as two blocks each (attention at ``layers.{2i}``, mlp at ``layers.{2i+1}``).

    ``layers.{2i}.mixer.*`` → ``layers.{i}.self_attn.*``, ``layers.{2i+1}.mixer.*`` →
    ``layers.{i}.mlp.*``, ``layers.{2i}.attn_alpha`` → ``layers.{i}.lambda_1`` and
    ``layers.{2i+1}.mlp_alpha`` → ``layers.{i}.lambda_2``. The reverse (``inverse=True``) writes
    the two-block layout back. A block name on an index of the other parity (``attn_alpha`` on an
    odd block) has no one-layer name that comes back as written, so it does not match and is
    reported unexpected.

    Example:
        >>> LayerPairCollapse().rename_source_key("model.layers.3.mixer.up_proj.weight")[0]
        'model.layers.1.mlp.up_proj.weight'
        >>> LayerPairCollapse(inverse=True).rename_source_key("model.layers.1.mlp.up_proj.weight")[0]
        'model.layers.3.mixer.up_proj.weight'
    """

    def __init__(self, *, inverse: bool = False, scope_prefix: str | None = None) -> None:
        names = _PAIR_LAYER if inverse else _PAIR_BLOCKS
        # The name is whole (``mixers`` is not ``mixer``): followed by a dot or the end of the key.
        super().__init__(
            rf"layers\.(\d+)\.({'|'.join(names)})(?=\.|$)", r"layers.\1.\2", scope_prefix=scope_prefix
        )
        self.inverse: bool
        object.__setattr__(self, "inverse", inverse)

    def __repr__(self) -> str:
        scope = f", scope_prefix={self.scope_prefix!r}" if self.scope_prefix is not None else ""
        return f"LayerPairCollapse(inverse={self.inverse}{scope})"

    def _options(self) -> tuple[Any, ...]:
        return (self.inverse,)

    def reverse_transform(self) -> WeightTransform:
        return LayerPairCollapse(inverse=not self.inverse, scope_prefix=self.scope_prefix)

    @property
    def digit_blind(self) -> bool:
        return False  # the index is rewritten, and its parity picks the name

    def match(self, key: str) -> TransformMatch | None:
        m = super().match(key)
        if m is None:
            return None
        index, name = m.groups
        if index != str(int(index)):
            return None  # not a plain index (``07`` would not come back as written)
        i = int(index)
        if self.inverse:
            block, renamed = {
                "self_attn": (2 * i, "mixer"),
                "mlp": (2 * i + 1, "mixer"),
                "lambda_1": (2 * i, "attn_alpha"),
                "lambda_2": (2 * i + 1, "mlp_alpha"),
            }[name]
            return m._replace(groups=(str(block), renamed))
        odd = i % 2 == 1
        if (name == "attn_alpha" and odd) or (name == "mlp_alpha" and not odd):
            return None
        layer_name = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}.get(name, _PAIR_LAYER[odd])
        return m._replace(groups=(str(i // 2), layer_name))


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

    def _options(self) -> tuple[Any, ...]:
        return (self.prefix_to_add, self.prefix_to_remove, self.model_prefix)

    def reverse_transform(self) -> WeightTransform:
        return PrefixChange(
            prefix_to_add=self.prefix_to_remove,
            prefix_to_remove=self.prefix_to_add,
            model_prefix=self.model_prefix,
            scope_prefix=self.scope_prefix,
        )


def legacy_renamings() -> list[WeightTransform]:
    """The built-in renames every model gets: ``LayerNorm.gamma/beta`` → ``LayerNorm.weight/bias``."""
    return [
        WeightRenaming(r"LayerNorm\.gamma", "LayerNorm.weight"),
        WeightRenaming(r"LayerNorm\.beta", "LayerNorm.bias"),
    ]
