"""Fusion configs: ``{"patch_embeddings": True}`` or ``{"name": {options}}``, validated.

Rules (the contract users rely on):

* keys are registered fusion names; an unknown name is an error listing the valid ones;
* a value is ``True`` (enable with default options), ``False`` (disable) or a mapping of options
  (enable with those options; ``{}`` enables with defaults); anything else is an error;
* options are checked against the fusion's declared options (unknown option, wrong type);
* enabled fusions run in the order the mapping lists them.

:class:`FusionConfig` is the validated result; :meth:`FusionConfig.to_dict` is its canonical,
JSON-serializable form (disabled fusions dropped), which is what a saved checkpoint persists.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..errors import FusionError
from .registry import find_fusion, list_fusions
from .spec import FusionSpec

__all__ = ["EnabledFusion", "FusionConfig", "exact_module_pattern", "validate_fusion_config"]


@dataclass(frozen=True)
class EnabledFusion:
    """One enabled fusion of a validated config.

    Attributes:
        name: the registered name.
        spec: the registered spec.
        options: every option of the spec, defaults filled in (read-only).
        given: what the user gave: ``True`` or the options mapping (for persistence).
    """

    name: str
    spec: FusionSpec
    options: Mapping[str, Any]
    given: bool | Mapping[str, Any]


@dataclass(frozen=True)
class FusionConfig:
    """A validated fusion config: the enabled fusions, in the order they run."""

    fusions: tuple[EnabledFusion, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fusions)

    def __bool__(self) -> bool:
        return bool(self.fusions)

    def to_dict(self) -> dict[str, Any]:
        """The canonical form: ``{name: True | {given options}}`` for the enabled fusions."""
        out: dict[str, Any] = {}
        for f in self.fusions:
            if isinstance(f.given, bool):
                out[f.name] = True
            else:
                out[f.name] = {
                    k: list(v) if isinstance(v, tuple) else copy.deepcopy(v) for k, v in f.given.items()
                }
        return out


def _unknown_name(name: object) -> FusionError:
    names = list_fusions()
    close = difflib.get_close_matches(str(name), names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    valid = ", ".join(map(repr, names)) if names else "none (register one with register_fusion)"
    return FusionError(f"Unknown fusion {name!r} in fusion_config.{hint} Valid names: {valid}.")


def _options(name: str, spec: FusionSpec, given: Mapping[str, Any]) -> dict[str, Any]:
    declared = spec.all_options()
    resolved = {k: opt.default for k, opt in declared.items()}
    for key, value in given.items():
        opt = declared.get(key) if isinstance(key, str) else None
        if opt is None:
            close = difflib.get_close_matches(str(key), list(declared), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            listed = "; ".join(f"{k!r}: {o.doc}" for k, o in declared.items())
            raise FusionError(f"Fusion {name!r} has no option {key!r}.{hint} Valid options: {listed}.")
        resolved[key] = opt.validate(name, key, value)
    return resolved


def validate_fusion_config(fusion_config: Mapping[str, Any] | FusionConfig | None) -> FusionConfig:
    """Validate a fusion config against the registered fusions.

    Args:
        fusion_config: ``{"name": True | False | {options}}`` (``None`` or ``{}``: no fusion), or an
            already validated :class:`FusionConfig`.

    Returns:
        The enabled fusions in the given order, with their options resolved.

    Raises:
        FusionError: not a mapping, an unknown fusion name (valid names listed), a value that is not
            ``True``/``False``/a mapping, or an invalid option.

    Example:
        >>> validate_fusion_config({"patch_embeddings": False}).to_dict()
        {}
    """
    if isinstance(fusion_config, FusionConfig):
        return fusion_config
    if fusion_config is None:
        return FusionConfig()
    if not isinstance(fusion_config, Mapping):
        raise FusionError(
            f"fusion_config must be a mapping like {{'patch_embeddings': True}}, got "
            f"{type(fusion_config).__name__}: {fusion_config!r}."
        )
    enabled: list[EnabledFusion] = []
    for name, value in fusion_config.items():
        if not isinstance(name, str):
            raise FusionError(f"fusion_config keys must be fusion names (strings), got {name!r}.")
        spec = find_fusion(name)
        if spec is None:
            raise _unknown_name(name)
        if value is False:
            continue
        if value is True:
            options = _options(name, spec, {})
            given: bool | Mapping[str, Any] = True
        elif isinstance(value, Mapping):
            options = _options(name, spec, value)
            given = MappingProxyType({k: options[k] for k in value})
        else:
            raise FusionError(
                f"Invalid fusion_config value for {name!r}: expected True, False or a mapping of options, "
                f"got {type(value).__name__}: {value!r}."
            )
        enabled.append(EnabledFusion(name, spec, MappingProxyType(options), given))
    return FusionConfig(tuple(enabled))


def exact_module_pattern(path: str) -> str:
    r"""The ``modules``/``exclude`` entry that names exactly the module at ``path``.

    Example:
        >>> exact_module_pattern("visual.patch_embed")
        '^visual\\.patch_embed$'
    """
    return "^" + re.escape(path) + "$"
