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

import abc
import copy
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from ..errors import ConfigurationError, ConversionError
from .protocol import bounded_repr

__all__ = [
    "FLOAT",
    "FORMATS",
    "PACKED",
    "STRATEGIES",
    "ConfigGroups",
    "WeightScheme",
    "parse_group",
    "target_matches",
]

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


class ConfigGroups(abc.ABC):
    """What every compressed-tensors quantizer shares: its ``quantization_config`` read and kept,
    and which config group's scheme each module has.

    A subclass names its schemes' parser (``parse_scheme(name, group, top_format)``) and what its
    checkpoints store (for the message refusing a checkpoint not stored compressed).
    """

    method = "compressed-tensors"
    stores: ClassVar[str]

    @staticmethod
    @abc.abstractmethod
    def parse_scheme(name: str, group: Any, top_format: Any) -> Any:
        """The scheme of config group ``name`` (``top_format``: the config's own ``format``)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        name = type(self).__name__
        if not isinstance(config, Mapping):
            raise ConfigurationError(f"expected a quantization_config dict, got {type(config).__name__}.")
        if config.get("quant_method") != self.method:
            raise ConfigurationError(
                f"quantization_config.quant_method={bounded_repr(config.get('quant_method'))}; "
                f"{name} reads {self.method!r} configs."
            )
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ConfigurationError(
                f"quantization_config.quantization_status={bounded_repr(status)}; only 'compressed' checkpoints "
                f"store {self.stores}."
            )
        groups = config.get("config_groups")
        if not isinstance(groups, Mapping) or not groups:
            raise ConfigurationError(
                f"quantization_config.config_groups={bounded_repr(groups)}; give at least one group."
            )
        self.schemes = {str(n): self.parse_scheme(str(n), g, config.get("format")) for n, g in groups.items()}
        ignore = config.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise ConfigurationError(
                f"quantization_config.ignore={bounded_repr(ignore)}; give a list of strings."
            )
        self.ignore = tuple(ignore)
        self.config = copy.deepcopy(dict(config))
        self.classes: dict[str, tuple[str, ...]] = {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Any:
        """Build from a ``quantization_config`` dict (or a whole ``config.json`` dict holding one)."""
        inner = config.get("quantization_config") if isinstance(config, Mapping) else None
        return cls(inner if isinstance(inner, Mapping) and "quant_method" not in config else config)

    def __repr__(self) -> str:
        formats = tuple(sorted({s.format for s in self.schemes.values()}))
        return f"{type(self).__name__}(formats={formats})"

    def quantization_config(self) -> dict[str, Any]:
        """The source ``quantization_config``, unchanged: an ``as_loaded`` save writes the same tensors."""
        return copy.deepcopy(self.config)

    def prepare(self, model: nn.Module) -> None:
        """Note each module's class names, for config groups that target classes (``"Linear"``).

        The names of its base classes count too: an FSDP2-wrapped ``Linear`` is an ``FSDPLinear``.
        """
        self.classes = {
            path: tuple(c.__name__ for c in type(m).__mro__ if issubclass(c, nn.Module))
            for path, m in model.named_modules()
        }

    def scheme_of(self, module: str) -> Any:
        """The scheme of the module at path ``module`` (``None``: ignored, or no group targets it).

        A path the model does not have (the load renames or fuses it: ``gate_proj`` into
        ``gate_up_proj``) has no class to match: the groups that target classes decide, when they
        all quantize the same way.

        Raises:
            ConversionError: such a path, and class-targeting groups that quantize differently.
        """
        classes = self.classes.get(module)
        if any(target_matches(p, module, classes or ()) for p in self.ignore):
            return None
        for scheme in self.schemes.values():
            if any(target_matches(t, module, classes or ()) for t in scheme.targets):
                return scheme
        if classes is not None:
            return None
        by_class = {
            dataclasses.replace(s, targets=()): s
            for s in self.schemes.values()
            if any(not t.startswith("re:") for t in s.targets)
        }
        if len(by_class) > 1:
            raise ConversionError(
                f"{module!r} is not a module of the model (the load renames or fuses it), and the config groups "
                f"that target module classes ({', '.join(sorted(self.schemes))}) quantize differently: which one "
                "stored it cannot be told. Load into a model that has the checkpoint's module paths."
            )
        return next(iter(by_class.values()), None)
