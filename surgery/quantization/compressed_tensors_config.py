"""The compressed-tensors ``quantization_config`` schema: config groups, their weight schemes, their targets.

:func:`parse_group` checks one entry of ``config_groups`` (its ``weights`` arguments, ``format``,
``targets``, ``input_activations``) and returns the :class:`WeightScheme` decoding needs;
:func:`target_matches` is compressed-tensors' rule for ``targets`` and ``ignore`` entries.

Example:
    >>> s = parse_group("group_0", {"targets": ["Linear"], "format": "pack-quantized",
    ...     "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}, None)
    >>> s.num_bits, s.group_size, s.symmetric, target_matches("Linear", "model.q_proj", ("Linear", "Module"))
    (4, 32, True, True)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError
from .protocol import bounded_repr

__all__ = ["FLOAT", "FORMATS", "PACKED", "STRATEGIES", "WeightScheme", "parse_group", "target_matches"]

FORMATS = ("pack-quantized", "float-quantized")
"""The compressed-tensors formats this module reads (the others have quantizers of their own)."""

PACKED, FLOAT = FORMATS
STRATEGIES = {PACKED: ("tensor", "channel", "group"), FLOAT: ("tensor", "channel", "group", "block")}
"""The weight strategies each format reads."""


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weight quantization: what decoding a targeted module's weight needs."""

    format: str
    num_bits: int
    strategy: str
    group_size: int | None
    block: tuple[int, int] | None
    symmetric: bool
    g_idx: bool
    static_input: bool
    targets: tuple[str, ...]

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1


def parse_group(name: str, group: Any, top_format: Any) -> WeightScheme:
    where = f"quantization_config.config_groups.{name}"
    if not isinstance(group, Mapping):
        raise ConfigurationError(f"{where} is {bounded_repr(group)}, not a dict.")
    fmt = group.get("format") or top_format
    if fmt not in FORMATS:
        raise ConfigurationError(
            f"{where}.format={bounded_repr(fmt)}; CompressedTensorsQuantizer reads {list(FORMATS)}."
        )
    w = group.get("weights")
    if not isinstance(w, Mapping):
        raise ConfigurationError(f"{where}.weights={bounded_repr(w)}; a quantized weight scheme is a dict.")
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    want_type = "int" if fmt == PACKED else "float"
    if kind != want_type:
        raise ConfigurationError(
            f"{where}.weights.type={bounded_repr(kind)}; {fmt} weights are {want_type!r}."
        )
    if fmt == PACKED and not (isinstance(bits, int) and not isinstance(bits, bool) and 1 <= bits <= 8):
        raise ConfigurationError(
            f"{where}.weights.num_bits={bounded_repr(bits)}; pack-quantized takes 1 to 8."
        )
    if fmt == FLOAT and bits != 8:
        raise ConfigurationError(
            f"{where}.weights.num_bits={bounded_repr(bits)}; float-quantized is FP8 (8)."
        )
    if strategy not in STRATEGIES[fmt]:
        raise ConfigurationError(
            f"{where}.weights.strategy={bounded_repr(strategy)}; valid for {fmt}: {list(STRATEGIES[fmt])}."
        )
    size = w.get("group_size")
    if strategy == "group" and not (isinstance(size, int) and not isinstance(size, bool) and size > 0):
        raise ConfigurationError(f"{where}.weights.group_size={bounded_repr(size)}; give a positive int.")
    block = w.get("block_structure")
    if strategy == "block" and not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigurationError(
            f"{where}.weights.block_structure={bounded_repr(block)}; give two positive ints, e.g. [128, 128]."
        )
    symmetric = w.get("symmetric", True)
    if not isinstance(symmetric, bool) or (fmt == FLOAT and not symmetric):
        raise ConfigurationError(f"{where}.weights.symmetric={bounded_repr(symmetric)}.")
    targets = group.get("targets", [])
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ConfigurationError(f"{where}.targets={bounded_repr(targets)}; give a list of strings.")
    inputs = group.get("input_activations")
    static = isinstance(inputs, Mapping) and inputs.get("dynamic") is False
    return WeightScheme(
        format=fmt,
        num_bits=bits if isinstance(bits, int) else 8,
        strategy=strategy,
        group_size=size if strategy == "group" else None,
        block=(block[0], block[1]) if strategy == "block" and isinstance(block, list) else None,
        symmetric=symmetric,
        g_idx=w.get("actorder") == "group",
        static_input=static,
        targets=tuple(targets),
    )


def target_matches(pattern: str, path: str, classes: tuple[str, ...]) -> bool:
    """compressed-tensors' target rule: ``re:`` regexes match the path, others a path or a class name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], path) is not None
    return pattern == path or pattern in classes
