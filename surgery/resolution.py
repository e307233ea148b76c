"""Resolution: which registered conversion mappings apply to a model, and where.

:func:`get_model_conversion_mapping` walks the sub-models of a :class:`~surgery.graph.ModuleGraph`
(:func:`~surgery.graph.submodels_of` when no graph is given: the same walk without building one)
depth first, in ``named_modules()`` order, and for each one:

1. **Ancestor dedup (class name).** Skip it when an ancestor (or the root ``""``) already claimed
   its class name: the ancestor's transforms already cover this subtree.
2. **Class-name lookup**, then, when that finds nothing, **ancestor dedup (model_type)** and
   **model_type lookup**. A class-name hit wins over a ``model_type`` hit.
3. **Custom-code filter** on every lookup: a catalog entry applies only to classes its catalog
   declared with :func:`~surgery.registry.register_catalog_modules`; a user entry applies to any
   class. A filtered entry counts as no entry.
4. The hit's transforms are fresh copies scoped to the sub-model's full dotted path (``""`` for
   the root). The class name is marked claimed at that path; the ``model_type`` only when the hit
   came through the ``model_type`` (so ``DetrModel`` under a class-matched ``DetrForSegmentation``
   of the same ``model_type`` still gets its own mapping). Siblings never dedup each other.

The result starts with the built-in legacy renames (:func:`~surgery.transforms.legacy_renamings`)
and ends with what a quantizer's ``update_weight_conversions`` hook makes of the list.

Unlike transformers, the scope is the *full* path: ``base_model_prefix`` is handled when keys
are routed (:func:`~surgery.routing.route_keys`), not by shortening scopes here.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from .errors import ConfigurationError
from .graph import ModuleGraph, submodels_of
from .registry import RegistryEntry, entry_applies_to, lookup_entry
from .transforms import WeightTransform, legacy_renamings

__all__ = [
    "MappingExplanation",
    "Outcome",
    "SubmodelResolution",
    "explain_model_conversion_mapping",
    "get_model_conversion_mapping",
]

Outcome = Literal["class_name", "model_type", "no_mapping", "ancestor_claimed", "custom_code"]


@dataclass(frozen=True, slots=True)
class SubmodelResolution:
    """What resolution decided for one sub-model.

    Attributes:
        path: the sub-model's dotted path (``""`` is the root); also the transforms' scope.
        class_name: ``type(module).__name__``.
        model_type: ``module.config.model_type`` or ``None``.
        outcome: ``"class_name"`` / ``"model_type"`` (a hit through that identifier),
            ``"ancestor_claimed"`` (skipped: an ancestor claimed the identifier),
            ``"custom_code"`` (only catalog entries matched, and the class is not known to their
            catalog), or ``"no_mapping"``.
        key: the registry key that matched, or the identifier an ancestor claimed.
        provenance: ``"user"`` / ``"catalog:<name>"`` of the matched entry.
        claimed_by: for ``"ancestor_claimed"``, the ancestor's path.
        filtered: keys whose catalog entries the custom-code filter set aside.
        transforms: the scoped fresh copies this sub-model contributes (empty unless a hit).
    """

    path: str
    class_name: str
    model_type: str | None
    outcome: Outcome
    key: str | None = None
    provenance: str | None = None
    claimed_by: str | None = None
    filtered: tuple[str, ...] = ()
    transforms: tuple[WeightTransform, ...] = ()

    def __str__(self) -> str:
        where = repr(self.path) if self.path else "<root>"
        head = f"{where} {self.class_name}" + (f" [{self.model_type}]" if self.model_type else "")
        if self.outcome in ("class_name", "model_type"):
            why = f"{len(self.transforms)} transform(s) via {self.outcome} {self.key!r} ({self.provenance})"
        elif self.outcome == "ancestor_claimed":
            why = f"skipped: {self.key!r} already claimed by ancestor {self.claimed_by!r}"
        elif self.outcome == "custom_code":
            why = f"skipped: class not known to the catalog of {', '.join(map(repr, self.filtered))}"
        else:
            why = "no mapping"
        return f"{head}: {why}"


def _claimed_by(claims: list[str], path: str) -> str | None:
    for seen in claims:
        if seen == "" or path.startswith(seen + "."):
            return seen
    return None


def _lookup(key: str, cls: type, filtered: list[str]) -> tuple[RegistryEntry, list[WeightTransform]] | None:
    found = lookup_entry(key)
    if found is None:
        return None
    if not entry_applies_to(found[0], cls):
        filtered.append(key)
        return None
    return found


class MappingExplanation(list[SubmodelResolution]):
    """The list :func:`explain_model_conversion_mapping` returns; it prints as a table."""

    def render(self) -> str:
        """One row per sub-model: path, class, model type, outcome, registry key, transforms."""
        rows = [
            (
                r.path or "<root>",
                r.class_name,
                r.model_type or "-",
                r.outcome + (f" ({r.claimed_by or '<root>'})" if r.claimed_by is not None else ""),
                r.key or "-",
                str(len(r.transforms)),
            )
            for r in self
        ]
        head = ("sub-model", "class", "model_type", "outcome", "key", "transforms")
        widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
        line = "  ".join(f"{{:<{w}}}" for w in widths)
        out = [line.format(*head), line.format(*("-" * w for w in widths))]
        out.extend(line.format(*row) for row in rows)
        for r in self:
            out.extend(f"  {r.path or '<root>'}: {t!r}" for t in r.transforms)
        if not any(r.transforms for r in self):
            out.append("no conversion mapping applies: checkpoint keys are matched by name only")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()


def explain_model_conversion_mapping(
    model: nn.Module, *, graph: ModuleGraph | None = None
) -> list[SubmodelResolution]:
    """Resolve sub-model by sub-model and say why each one got what it got.

    Args:
        model: the module tree.
        graph: a :class:`ModuleGraph` of ``model`` already built (else one is built).

    Returns:
        One :class:`SubmodelResolution` per sub-model, in walk order: a list that prints as a
        table (``print(explain_model_conversion_mapping(model))``).

    Raises:
        RegistryError: a matched alias chain is broken (cycle, unknown target).
    """
    # Without a graph, walk the modules directly: building one imports networkx (a start-up cost
    # on the first load of a process, docs/benchmarks.md) for nothing more than this list.
    walk: list[tuple[str, nn.Module, str | None]] = (
        submodels_of(model)
        if graph is None
        else [(path, module, graph.nodes[path]["model_type"]) for path, module in graph.submodels()]
    )
    claimed_class: dict[str, list[str]] = {}
    claimed_type: dict[str, list[str]] = {}
    records = MappingExplanation()
    for path, module, model_type in walk:
        cls = _built_class(module)
        class_name = cls.__name__
        base: dict[str, Any] = {"path": path, "class_name": class_name, "model_type": model_type}

        ancestor = _claimed_by(claimed_class.get(class_name, []), path)
        if ancestor is not None:
            records.append(
                SubmodelResolution(**base, outcome="ancestor_claimed", key=class_name, claimed_by=ancestor)
            )
            continue
        filtered: list[str] = []
        found = _lookup(class_name, cls, filtered)
        via: Outcome = "class_name"
        if found is None and model_type is not None:
            ancestor = _claimed_by(claimed_type.get(model_type, []), path)
            if ancestor is not None:
                records.append(
                    SubmodelResolution(
                        **base, outcome="ancestor_claimed", key=model_type, claimed_by=ancestor
                    )
                )
                continue
            found = _lookup(model_type, cls, filtered)
            via = "model_type"
        if found is None:
            outcome: Outcome = "custom_code" if filtered else "no_mapping"
            records.append(SubmodelResolution(**base, outcome=outcome, filtered=tuple(filtered)))
            continue

        entry, transforms = found
        claimed_class.setdefault(class_name, []).append(path)
        if via == "model_type":
            claimed_type.setdefault(model_type, []).append(path)  # type: ignore[arg-type]
        records.append(
            SubmodelResolution(
                **base,
                outcome=via,
                key=entry.key,
                provenance=entry.provenance,
                filtered=tuple(filtered),
                transforms=tuple(t.scoped(path) for t in transforms),
            )
        )
    return records


def get_model_conversion_mapping(
    model: nn.Module,
    *,
    quantizer: object | None = None,
    include_legacy: bool = True,
    graph: ModuleGraph | None = None,
) -> list[WeightTransform]:
    r"""The resolved, scoped transform list for ``model`` (see the module docstring for the rules).

    Args:
        model: the module tree (possibly rewritten by fusions).
        quantizer: an object with ``update_weight_conversions(transforms[, model]) -> list``; its
            result replaces the list. Objects without the method are ignored.
        include_legacy: start with the built-in legacy renames (``LayerNorm.gamma/beta``). Saving
            a model that was never loaded through the engine passes ``False``.
        graph: a :class:`ModuleGraph` of ``model`` already built (else one is built).

    Returns:
        Fresh transform objects: two calls never share state, and the registry's prototypes are
        never handed out.

    Raises:
        RegistryError: a matched alias chain is broken (cycle, unknown target).
        ConfigurationError: the quantizer hook is not callable or returned something other than a
            list of transforms.

    Example:
        >>> import torch, types
        >>> from surgery import WeightRenaming
        >>> from surgery.registry import register_checkpoint_conversion_mapping, registry_snapshot
        >>> class Toy(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.config = types.SimpleNamespace(model_type="toy")
        >>> with registry_snapshot(clear=True):
        ...     register_checkpoint_conversion_mapping("toy", [WeightRenaming(r"\.gamma$", ".weight")])
        ...     get_model_conversion_mapping(Toy(), include_legacy=False)
        [WeightRenaming('\\.gamma$' -> '.weight', scope_prefix='')]
    """
    if not isinstance(include_legacy, bool):
        raise ConfigurationError(f"include_legacy must be True or False, got {include_legacy!r}.")
    transforms: list[WeightTransform] = legacy_renamings() if include_legacy else []
    for record in explain_model_conversion_mapping(model, graph=graph):
        transforms.extend(record.transforms)
    if quantizer is not None:
        transforms = _apply_quantizer(quantizer, transforms, model)
    return transforms


def _apply_quantizer(
    quantizer: object, transforms: list[WeightTransform], model: nn.Module
) -> list[WeightTransform]:
    hook: Any = getattr(quantizer, "update_weight_conversions", None)
    if hook is None:
        return transforms
    name = f"{type(quantizer).__name__}.update_weight_conversions"
    if not callable(hook):
        raise ConfigurationError(
            f"{name} is {hook!r}, not a method; define it as (transforms[, model]) -> list."
        )
    result = hook(transforms, model) if _accepts_two(hook) else hook(transforms)
    if not isinstance(result, (list, tuple)):
        raise ConfigurationError(
            f"{name} returned {type(result).__name__}, not a list of WeightTransform; return the list."
        )
    for i, t in enumerate(result):
        if not isinstance(t, WeightTransform):
            raise ConfigurationError(
                f"{name} returned {t!r} at position {i}, which is not a WeightTransform."
            )
    return list(result)


def _accepts_two(func: Callable[..., Any]) -> bool:
    """Whether ``func`` takes ``(transforms, model)`` (the transformers signature) or just ``(transforms)``."""
    try:
        inspect.signature(func).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # no signature available (a builtin): assume the one-argument form
        return False
    return True


def _built_class(module: nn.Module) -> type:
    """The class ``module`` was built as: FSDP2's ``fully_shard`` swaps a module's class for a
    subclass ``FSDP<Name>`` of ``FSDPModule`` and it; the mapping is registered for ``<Name>``."""
    cls = type(module)
    fsdp = sys.modules.get("torch.distributed.fsdp")
    marker = getattr(fsdp, "FSDPModule", None)
    if marker is None or not issubclass(cls, marker):
        return cls
    return next((b for b in cls.__bases__ if not issubclass(b, marker)), cls)
