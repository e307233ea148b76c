"""Preview and apply fusions on a model instance, and the record the loader and saver read.

:func:`preview_fusions` changes nothing; :func:`apply_fusions` swaps each matched candidate for
its fused replacement, on that instance only (no class is patched, no global state is kept), and
records on the model what it did (a :class:`FusionRecord` in the model's record,
:func:`surgery.record.record_of`):

* :func:`fusion_transforms` gives the loader fresh copies of the weight transforms (original →
  fused layout), each scoped to its module's path; the saver reverses them.
* :func:`fusion_config_of` gives the saver the canonical config to persist with a checkpoint
  saved in the runtime layout; loading that checkpoint applies it again.
* :func:`check_fusion_conflicts` tells the loader, before any I/O, whether another converter of
  the model's conversion mapping would claim a key a fusion converts.

Work is done on the side: every replacement is built before it is swapped in, and when anything
fails (a strict miss, a broken rewrite, an interrupt) every swap made so far is undone, so the
model is exactly as it was.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from ..converter import WeightConverter
from ..errors import FusionConflictError, FusionError
from ..graph import swap_module
from ..record import FusionEntry, FusionRecord, record_of, update_record
from ..transforms import WeightTransform
from .config import EnabledFusion, FusionConfig, exact_module_pattern, validate_fusion_config
from .plan import EXCLUDED, FUSED, SKIPPED, FusionCandidate, FusionPlan
from .rewrite import NO_MATCH, NOTHING_HERE, FusedModule, examine_candidate

__all__ = [
    "apply_fusions",
    "check_fusion_conflicts",
    "fusion_config_of",
    "fusion_transforms",
    "preview_fusions",
]


# ---------------------------------------------------------------------- public API
def preview_fusions(
    model: nn.Module,
    fusion_config: Mapping[str, Any] | FusionConfig | None,
    *,
    strict: bool = False,
) -> FusionPlan:
    """Show what :func:`apply_fusions` would do, without changing anything.

    Every candidate is traced, matched and rewritten on the side (new weights on the ``meta``
    device, so nothing is copied). With several fusions, each one is previewed on the model as
    it is now, not as the previous fusions would leave it.

    Args:
        model: the model to inspect.
        fusion_config: ``{"patch_embeddings": True}`` or ``{"name": {options}}``.
        strict: raise instead of reporting a candidate that cannot be fused, or a fusion that
            finds nothing compatible.

    Returns:
        A :class:`FusionPlan` (``str(plan)`` renders it).

    Raises:
        FusionError: the config is invalid, or (``strict``) a candidate was skipped.

    Example:
        >>> from surgery.examples import build_vision_tower
        >>> plan = preview_fusions(build_vision_tower(depth=1), {"patch_embeddings": True})
        >>> [(c.path, c.status) for c in plan.candidates]
        [('patch_embed', 'would fuse')]
    """
    return _run(model, fusion_config, strict=strict, apply=False)


def apply_fusions(
    model: nn.Module,
    fusion_config: Mapping[str, Any] | FusionConfig | None,
    *,
    strict: bool = False,
) -> FusionPlan:
    """Rewrite ``model`` in place: swap every matched candidate for its fused replacement.

    Only this instance changes: other instances of the same classes, and models built later,
    are untouched. The transforms and the config are recorded on the model for the loader and
    the saver (see :func:`fusion_transforms`, :func:`fusion_config_of`).

    Args:
        model: the model to rewrite.
        fusion_config: ``{"patch_embeddings": True}`` or ``{"name": {options}}``; enabled fusions
            run in the given order, ``False`` disables one.
        strict: raise (and leave the model unchanged) instead of skipping a candidate that cannot
            be fused, or a fusion that finds nothing compatible.

    Returns:
        The :class:`FusionPlan` of what was done.

    Raises:
        FusionError: the config is invalid, a rewrite failed, or (``strict``) a candidate was
            skipped; the model is then exactly as it was.

    Example:
        >>> from surgery.examples import build_vision_tower
        >>> tower = build_vision_tower(depth=1)
        >>> _ = apply_fusions(tower, {"patch_embeddings": True})
        >>> type(tower.patch_embed).__name__, fusion_config_of(tower)
        ('FusedExamplePatchEmbed', {'patch_embeddings': True})
    """
    return _run(model, fusion_config, strict=strict, apply=True)


def fusion_transforms(model: nn.Module) -> list[WeightTransform]:
    """Fresh copies of the weight transforms (original → fused layout) of every applied fusion.

    Each is scoped to the path of its fused module, so no registry lookup can shadow it. The
    loader appends them to the model's conversion mapping; reversing them saves the original
    layout. Empty when no fusion was applied.
    """
    record = record_of(model).fusions
    if record is None:
        return []
    return [t.copy() for e in record.entries for t in e.transforms]


def fusion_config_of(model: nn.Module) -> dict[str, Any] | None:
    """The canonical config of the fusions applied to ``model`` (a copy), or ``None``.

    Persist it with a checkpoint saved in the runtime layout; :func:`apply_fusions` with it on a
    fresh model reproduces the same module tree.
    """
    record = record_of(model).fusions
    return None if record is None else copy.deepcopy(record.config)


def check_fusion_conflicts(model: nn.Module, transforms: Sequence[WeightTransform]) -> None:
    """Fail fast when another converter would claim a key that an applied fusion converts.

    Args:
        model: a model fusions were applied to.
        transforms: the model's resolved conversion mapping, *without* the fusion transforms.

    Raises:
        FusionConflictError: (a ``FusionError`` and a ``ConfigurationError``) naming the fusion, the
            module path, the key and both transforms.
    """
    record = record_of(model).fusions
    if record is None:
        return
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    for entry in record.entries:
        for key in entry.source_keys:
            ours = next(
                (t for t in entry.transforms if isinstance(t, WeightConverter) and t.match(key)), None
            )
            if ours is None:
                continue
            for other in converters:
                if other.match(key) is not None:
                    raise FusionConflictError(
                        f"Fusion {entry.fusion!r} at {entry.path!r} converts {key!r} with {ours!r}, but the "
                        f"model's conversion mapping also claims it with {other!r}. Make that converter's source "
                        f"pattern skip {entry.path!r}, or leave the module unfused with "
                        f"{{{entry.fusion!r}: {{'exclude': [{exact_module_pattern(entry.path)!r}]}}}}."
                    )


# ---------------------------------------------------------------------- engine
def _candidates(model: nn.Module, fusion: EnabledFusion) -> Iterator[tuple[str, nn.Module, str | None]]:
    """``(path, module, exclude pattern that hit or None)`` for every module the fusion looks at."""
    patterns = [re.compile(p) for p in fusion.spec.candidate_patterns(fusion.options)]
    excludes = [re.compile(p) for p in fusion.options.get("exclude", ())]
    for path, module in list(model.named_modules()):
        if not any(p.search(path) for p in patterns):
            continue
        hit = next((e.pattern for e in excludes if e.search(path)), None)
        yield path, module, hit


class _Ties:
    """Every path of every module and parameter of the model, taken when a fusion starts
    (parameters on first use)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules: dict[int, list[str]] = {}
        for p, m in model.named_modules(remove_duplicate=False):
            self.modules.setdefault(id(m), []).append(p)
        self._params: dict[int, list[str]] | None = None

    @property
    def params(self) -> dict[int, list[str]]:
        if self._params is None:
            self._params = {}
            for n, t in self.model.named_parameters(remove_duplicate=False):
                self._params.setdefault(id(t), []).append(n)
        return self._params

    def untied_by_replacing(self, path: str, module: nn.Module) -> str | None:
        """Why replacing ``module`` at ``path`` would untie something (it, a child or a parameter
        is shared with the rest of the model), or ``None``."""
        all_paths = self.modules[id(module)]
        if len(all_paths) > 1:
            return f"the same instance is registered at {all_paths}; replacing it at one path would untie the others"
        if not path:
            return None  # the root: examine_candidate says it cannot be replaced
        inside = path + "."
        for sub_path, sub in module.named_modules(prefix=path):
            outside = [p for p in self.modules.get(id(sub), []) if p != sub_path and not p.startswith(inside)]
            if outside and sub is not module:
                return (
                    f"its child {sub_path!r} is also registered at {outside[0]!r} (shared); replacing this "
                    "module would untie them"
                )
        for name, t in module.named_parameters(prefix=path):
            outside = [n for n in self.params.get(id(t), []) if not n.startswith(inside)]
            if outside:
                return f"its parameter {name!r} is tied to {outside[0]!r}; a fused copy would untie them"
        return None


def _listed(paths: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(repr(p) for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _strict_failure(fusion: str, candidate: FusionCandidate) -> FusionError:
    return FusionError(
        f"Fusion {fusion!r} could not fuse {candidate.display_path!r} ({candidate.class_name}): "
        f"{candidate.reason}. The model was left unchanged. Pass strict=False to skip it, or exclude it "
        f"with {{{fusion!r}: {{'exclude': [{exact_module_pattern(candidate.path)!r}]}}}}."
    )


def _nothing_found(fusion: EnabledFusion, n_candidates: int) -> str:
    patterns = list(fusion.spec.candidate_patterns(fusion.options))
    where = (
        f"no module whose path matches {patterns} has the structure it looks for"
        if n_candidates == 0
        else f"none of the {n_candidates} candidate(s) matching {patterns} could be fused"
    )
    return (
        f"Nothing compatible found: {where}. {fusion.spec.no_match_message} To look elsewhere, pass "
        f"{{{fusion.name!r}: {{'modules': [<path regex>]}}}}."
    )


def _run(
    model: nn.Module,
    fusion_config: Mapping[str, Any] | FusionConfig | None,
    *,
    strict: bool,
    apply: bool,
) -> FusionPlan:
    if not isinstance(model, nn.Module):
        raise FusionError(f"Fusions rewrite torch.nn.Module instances, got {type(model).__name__}.")
    cfg = validate_fusion_config(fusion_config)
    plan = FusionPlan(config=cfg.to_dict(), applied=apply, fusions=cfg.names)
    swaps: list[tuple[str, nn.Module]] = []
    entries: list[FusionEntry] = []
    try:
        for fusion in cfg.fusions:
            ties = _Ties(model)  # taken again per fusion: the previous one swapped modules in
            fused_paths: list[str] = []
            already: list[str] = []
            seen = 0
            for path, module, excluded_by in _candidates(model, fusion):
                if any(path.startswith(f + ".") for f in fused_paths):
                    continue  # inside a module this fusion already replaced
                if isinstance(module, FusedModule) and fusion.name in module.fusion_names:
                    already.append(path)
                    continue
                if not fusion.spec.is_candidate(module):
                    continue
                seen += 1
                if excluded_by is not None:
                    plan.candidates.append(
                        FusionCandidate(
                            fusion.name,
                            path,
                            type(module).__name__,
                            EXCLUDED,
                            f"excluded by the 'exclude' pattern {excluded_by!r}",
                        )
                    )
                    continue
                tie = ties.untied_by_replacing(path, module)
                if tie is not None:
                    candidate = FusionCandidate(fusion.name, path, type(module).__name__, SKIPPED, tie)
                    replacement = None
                else:
                    candidate, replacement = examine_candidate(
                        fusion.name, fusion.spec, path, module, materialize=apply
                    )
                plan.candidates.append(candidate)
                if replacement is None:
                    quiet = fusion.spec.searches_everywhere and candidate.reason.startswith(
                        NO_MATCH + NOTHING_HERE
                    )
                    if strict and not quiet:
                        raise _strict_failure(fusion.name, candidate)
                    continue
                fused_paths.append(path)
                if apply:
                    swaps.append((path, swap_module(model, path, replacement)))
                    candidate.status = FUSED
                entries.append(
                    FusionEntry(
                        fusion.name,
                        path,
                        candidate.class_name,
                        candidate.fused_class_name or "",
                        candidate.transforms,
                        tuple(
                            f"{path}.{k}"
                            for k in candidate.params_before
                            if any(t.match(f"{path}.{k}") for t in candidate.transforms)
                        ),
                    )
                )
            if not fused_paths and already:
                plan.messages[fusion.name] = (
                    f"Already applied to {len(already)} module(s) ({_listed(already)}); nothing to do."
                )
            elif not fused_paths:
                plan.messages[fusion.name] = _nothing_found(fusion, seen)
                if strict:
                    raise FusionError(f"Fusion {fusion.name!r}: {plan.messages[fusion.name]}")
        if apply and entries:
            _record(model, cfg, entries)
    except BaseException:
        for path, old in reversed(swaps):
            swap_module(model, path, old)
        raise
    return plan


def _record(model: nn.Module, cfg: FusionConfig, entries: list[FusionEntry]) -> None:
    applied = {e.fusion for e in entries}
    new_config = {k: v for k, v in cfg.to_dict().items() if k in applied}
    old = record_of(model).fusions
    if old is None:
        update_record(model, fusions=FusionRecord(new_config, list(entries)))
        return
    all_entries = [*old.entries, *entries]
    merged = dict(old.config)
    for name, given in new_config.items():
        if name not in merged or merged[name] == given:
            merged[name] = given
            continue
        # Two applications with different options: pin the exact modules so a reload matches.
        options = {k: v for k, v in given.items() if k != "exclude"} if isinstance(given, dict) else {}
        options["modules"] = [exact_module_pattern(e.path) for e in all_entries if e.fusion == name]
        merged[name] = options
    old.config = merged
    old.entries = all_entries
