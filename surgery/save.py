"""Saving: export a model back to its original checkpoint layout (or its runtime layout).

Reversal runs in two stages, mirroring loading: first every converter's inverse (its op chain
reversed), then every renaming's inverse in reverse order. The original format is the family's
layout, however the weights arrived (see :func:`reverting_transforms`): the model's mapping is
always inverted; legacy renames and the base-model prefix only when they fired at load, since
nothing else says the checkpoint had them. Fusions are always inverted in the original format. Tensors loaded
with a dtype cast are cast back, so load → save reproduces the input bit for bit wherever the
load's cast was lossless (bfloat16 → float32); a lossy one (float32 → bfloat16, reported as such
by the load) comes back as the rounded values.

:class:`RevertedState` is the lazy view a save writes from: every output key, shape and dtype is
known up front (the reversed chains run on ``meta`` tensors), and values are computed one
converter group at a time, holding only the current group's outputs. :func:`save_checkpoint`
hands those specs to :func:`~surgery.checkpoint.write_checkpoint`, which plans the files from
them and writes each value as soon as it is computed, so a save holds at most one group's
outputs beyond the model itself. Where the reversed chain only slices
(``Split``/``Chunk``/``SplitModulelist``, e.g. fused experts back to per-expert weights) the
outputs are views of the parameter and cost no memory at all.

Quantized models: an original-layout save first turns every quantized module
(:class:`~surgery.quantization.QuantizedModule`, e.g. an int8 linear quantized on the fly) back
into floats, one group at a time, and writes them in the checkpoint's dtypes (lossy: the
quantization error stays). Weights that were *stored* quantized and decoded at load (FP8 block
scales) are re-encoded with the scales recorded at load (``quantization="as_loaded"``, bit for bit
when the weights are unchanged) or written as floats (``quantization="dequantized"``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from .casting import Cast, SavedFiles, cast_checked, check_save_dtype, is_castable
from .checkpoint import check_write_arguments, write_checkpoint, write_file_atomically
from .collective import Collective
from .converter import WeightConverter, split_transforms
from .errors import CheckpointError, ConfigurationError, ConversionError
from .fusion import fusion_config_of, fusion_transforms, persistable_fusion_config
from .load.model import config_lookup, tied_groups
from .load.placement import all_contiguous, flatten_slots, placement_views, shape_of
from .load.plan import FUSION_METADATA_KEY, FUSION_TAG, fold_indices
from .load.record import BASE_PREFIX_TAG, LoadRecord, load_record
from .ops import OpContext, run_chain
from .parallel import full_tensor, is_dtensor
from .quantization import QUANTIZER_ATTRIBUTE, QuantizerHooks
from .resolution import get_model_conversion_mapping
from .routing import SAVE_PRIORITY, route_keys
from .saved_config import SavedConfig, saved_config, write_config_json
from .transforms import PrefixChange, WeightRenaming, WeightTransform, legacy_renamings

__all__ = [
    "QUANTIZATION_MODES",
    "RevertedState",
    "TensorSpec",
    "iter_reverted",
    "revert_state_dict",
    "reverting_transforms",
    "save_checkpoint",
]


QUANTIZATION_MODES = ("as_loaded", "dequantized")
"""``save_checkpoint(quantization=...)``: re-encode weights decoded at load, or write them as floats."""


class TensorSpec(NamedTuple):
    """Shape and dtype of one tensor a save will write, known before any value is computed."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _dedup_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The runtime state dict with tied tensors kept once (the name the checkpoint used, if known)."""
    state = model.state_dict(keep_vars=True)
    record = load_record(model)
    groups = {id(keys): keys for keys in tied_groups(state).values()}  # one entry per tied group
    drop: set[str] = set()
    for keys in groups.values():
        preferred = [k for k in keys if record is not None and k in record.loaded_keys]
        chosen = preferred[0] if preferred else keys[0]
        drop.update(k for k in keys if k != chosen)
    return {k: t.detach() for k, t in state.items() if k not in drop}


class _Dequantized:
    """A float tensor an original-layout save computes from a quantized module, when its group is computed."""

    def __init__(self, module: nn.Module, name: str, meta: torch.Tensor, device: torch.device) -> None:
        self.module, self.name = module, name
        self.shape, self.dtype, self.device = meta.shape, meta.dtype, device

    def compute(self) -> torch.Tensor:
        return self.module.dequantized()[self.name]  # type: ignore[operator]

    def is_contiguous(self) -> bool:
        return True  # computed fresh


def _dequantize_stage(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every quantized module's tensors replaced by the float ones it stands for."""
    replaced: dict[str, list[tuple[str, Any]]] = {}
    dropped: set[str] = set()
    for path, module in model.named_modules():
        names = getattr(module, "quantized_names", None)
        dequantized = getattr(module, "dequantized", None)
        if names is None or not callable(dequantized):
            continue
        prefix = f"{path}." if path else ""
        keys = [prefix + n for n in names if prefix + n in state]
        if not keys:
            continue
        device = state[keys[0]].device
        floats = [(prefix + n, _Dequantized(module, n, m, device)) for n, m in dequantized(meta=True).items()]
        replaced[keys[0]] = floats
        dropped.update(keys)
    if not replaced:
        return state
    out: dict[str, Any] = {}
    for k, t in state.items():
        if k in replaced:
            out.update(replaced[k])
        elif k not in dropped:
            out[k] = t
    return out


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """A ``meta`` tensor of ``t``'s global shape and dtype (a DTensor's global shape, not its shard)."""
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


def _value(t: Any) -> torch.Tensor:
    """The whole tensor of a gathered source (a quantized module's floats are computed here)."""
    return t.compute() if isinstance(t, _Dequantized) else t


def _refuse_meta(state: dict[str, torch.Tensor]) -> None:
    on_meta = [k for k, t in state.items() if t.device.type == "meta"]
    if on_meta:
        raise CheckpointError(
            f"Cannot save: {len(on_meta)} tensor(s) are still on the meta device and hold no data: "
            f"{fold_indices(on_meta)}. They were not in the checkpoint the model was loaded from (see "
            "the load report's missing_keys); load them, or materialize them (e.g. model.to_empty(...) "
            "and initialize) before saving."
        )


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
    record = load_record(model) if loaded else None
    fired = [t for t in record.transforms if not t.__dict__.get(FUSION_TAG)] if record is not None else []
    fired_reprs = {repr(t) for t in fired}
    mapping = get_model_conversion_mapping(model, include_legacy=False)
    structural = [t for t in mapping if not _placed_at_its_prefix(t, mapping) or repr(t) in fired_reprs]
    known = {repr(t) for t in structural}
    fusion = list(fusion_transforms(model))
    legacy = {repr(t) for t in legacy_renamings()}
    first = [t for t in fired[:1] if t.__dict__.get(BASE_PREFIX_TAG) == "first"]
    last = [t for t in fired[-1:] if t.__dict__.get(BASE_PREFIX_TAG) == "last"]
    fired_legacy = [t for t in fired if repr(t) in legacy]
    # What the load's quantizer added to the mapping (update/get_weight_conversions) fired too.
    added = [
        t
        for t in fired
        if repr(t) not in known and repr(t) not in legacy and not t.__dict__.get(BASE_PREFIX_TAG)
    ]
    return first + fired_legacy + structural + added + last + fusion


def _placed_at_its_prefix(t: WeightTransform, mapping: list[WeightTransform]) -> bool:
    """A ``PrefixChange(prefix_to_remove=P)`` of a sub-model whose keys its parent already places.

    Such an entry exists for the sub-model loaded on its own from a checkpoint of its own (a
    Qwen-Omni thinker from ``thinker.*`` keys, an Ultrabert encoder from ``ultrabert.*``). Inside
    a parent whose scope for it already holds ``P``, which strips ``P`` itself, or whose mapping
    renames ``P`` to the sub-model's place (``^ultrabert.`` → ``model.``), the hub keys never
    hold ``P`` twice:
    inverting it would write ``thinker.thinker.*`` or ``ultrabert.ultrabert.*``, so it is
    inverted only when it fired. (A CLIP tower inside Llava keeps its ``vision_model.``: the
    parent renames ``vision_tower``, not ``vision_model``.)
    """
    if not isinstance(t, PrefixChange) or t.prefix_to_remove is None or t.model_prefix or not t.scope_prefix:
        return False
    scope, prefix = t.scope_prefix, t.prefix_to_remove
    if prefix in scope.split("."):  # the thinker, or a sub-model inside it (``thinker.model``)
        return True
    for other in mapping:
        if other is t:
            continue
        if isinstance(other, PrefixChange) and other.prefix_to_remove == prefix and not other.model_prefix:
            outer = other.scope_prefix or ""
            if outer == "" or scope.startswith(outer + "."):
                return True  # a parent already strips P (the thinker around its base model)
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


class _RecordedShapes:
    """The recorded checkpoint shapes, by the names the reversed renamings see, looked up per name.

    A save asks for a handful (one per converter target); renaming every recorded key up front
    cost a per-key routing pass (0.4 s for 100,000 keys). A name is resolved by renaming it back
    and checking that the forward renamings give it again; anything else falls back to routing
    every recorded key once.
    """

    def __init__(self, record: LoadRecord | None, rename: _InverseRenamer) -> None:
        self._record = record
        self._rename = rename
        self._forward = [t for t in record.transforms if not isinstance(t, WeightConverter)] if record else []
        self._renamed = _Renamer(self._forward)
        self._table: dict[str, tuple[int, ...]] | None = None

    def get(self, name: str) -> tuple[int, ...] | None:
        if self._record is None:
            return None
        source = self._record.source_shapes
        key = self._rename(name)
        if key in source and self._renamed(key) == name:
            return source[key]
        if self._table is None:
            fwd = route_keys(list(source), self._forward) if self._forward else None
            self._table = {(fwd.routes[k].target_key if fwd is not None else k): v for k, v in source.items()}
        return self._table.get(name)


class _Renamer:
    def __init__(self, renamings: list[WeightTransform]) -> None:
        self.renamings = renamings

    def __call__(self, key: str) -> str:
        for r in self.renamings:
            key, _ = r.rename_source_key(key)
        return key


class _InverseRenamer:
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
        hub: _InverseRenamer | None = None,
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


@dataclass
class _Group:
    """The runtime tensors that one reversed converter turns into a set of checkpoint tensors."""

    sources: tuple[str, ...]  # runtime keys
    outputs: tuple[str, ...]  # names the reversed converter gives (before the reversed renamings)
    names: tuple[str, ...]  # final checkpoint keys, aligned with outputs
    dtypes: tuple[torch.dtype, ...]  # dtype to write, aligned with outputs
    converter: int | None = None  # index into the reversed converters
    key: str = ""  # the routing group key
    ctx: OpContext | None = None
    slot_shapes: list[Any] | None = None  # set when the outputs can be taken as views of the source
    chain_order: tuple[str, ...] = ()  # outputs in the order the reversed chain produces them
    encoded: dict[str, dict[str, torch.Tensor]] | None = None  # name -> scales recorded at load
    companion_of: dict[str, str] | None = None  # companion name -> the name whose encode writes it


def _closing_key(keys: list[str], group_of: dict[str, int]) -> str | None:
    """The key whose lookup computes a group for the last time, when ``keys`` are looked up in order.

    The first key of the final run of one group's keys (a group may span shards, and is then
    computed once per run).
    """
    if not keys:
        return None
    i = len(keys) - 1
    while i and group_of[keys[i - 1]] == group_of[keys[-1]]:
        i -= 1
    return keys[i]


class RevertedState(Mapping[str, torch.Tensor]):
    """The model's tensors in the layout a save writes, computed lazily, one group at a time.

    Keys, shapes and dtypes (:meth:`spec`) are known on construction; nothing is computed until a
    value is looked up. A lookup computes the whole converter group the key belongs to (all
    experts of one layer, say) and keeps only that group's outputs, never two groups'. Iteration
    follows the loaded checkpoint's shard order (so a save with its ``max_shard_size`` rewrites
    the same shards) and keeps each group's keys together within a shard, so iterating computes
    every group once per shard it spans.

    Args:
        model: the module tree.
        original_format: reverse the transforms (``True``) or keep the runtime layout.
        quantization: for weights stored quantized and decoded at load, ``"as_loaded"`` re-encodes
            them with the recorded scales (original layout only), ``"dequantized"`` writes floats.
        collective: the ranks computing it together (a tensor-parallel model: every rank looks
            up the same keys in the same order); by default the mesh of the model's DTensors.
            Each group is computed after an agreement point of the ranks (:mod:`surgery.collective`),
            so a failure on one rank is raised on every rank instead of leaving them waiting.

    Raises:
        CheckpointError: a tensor is still on ``meta`` (never loaded).
        ConversionError: a reversed op chain fails, or two tensors would get one key.

    Example:
        >>> state = RevertedState(model)  # doctest: +SKIP
        >>> state.spec("model.layers.0.block_sparse_moe.experts.0.w1.weight")  # doctest: +SKIP
        TensorSpec(shape=(32, 16), dtype=torch.float32)
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        original_format: bool = True,
        quantization: str = "as_loaded",
        collective: Collective | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if quantization not in QUANTIZATION_MODES:
            raise ConfigurationError(
                f"quantization={quantization!r}; valid: {', '.join(QUANTIZATION_MODES)}."
            )
        self._dtype_override = check_save_dtype(dtype)
        self._casts: dict[str, Cast] = {}
        self._state: dict[str, Any] = _dedup_state(model)
        self._collective = collective or Collective.of_tensors(
            self._state.values(), what="computing the reverted state"
        )
        _refuse_meta(self._state)
        if original_format:
            self._state = _dequantize_stage(model, self._state)
        self._quantization = quantization
        record = load_record(model)
        self._encoder = (
            QuantizerHooks(record.quantizer)
            if record is not None and record.quantizer is not None and record.companions
            else None
        )
        # What ops dropped at load (padding rows), by runtime key: the reversed ops put it back.
        self._residues: dict[str, torch.Tensor] = record.residues if record is not None else {}
        self._converters: list[WeightConverter] = []
        self._forward: list[WeightConverter] = []
        self._routes: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._specs: dict[str, TensorSpec] = {}
        self._group_of: dict[str, int] = {}
        self._current: int | None = None
        self._cache: dict[str, torch.Tensor] = {}
        self._config_for = config_lookup(model)
        groups = self._plan(model) if original_format else self._identity(model)
        self._groups = groups
        for i, g in enumerate(groups):
            for name in g.names:
                self._group_of[name] = i
        self._closing_key = _closing_key(list(self._specs), self._group_of)

    # ------------------------------------------------------------------ construction
    def _identity(self, model: nn.Module) -> list[_Group]:
        groups = []
        codes = _quantized_keys(model)  # a quantized module's codes and scales keep their dtypes
        for k, t in self._state.items():
            d = t.dtype if k in codes else self._cast(t.dtype)
            self._specs[k] = TensorSpec(tuple(t.shape), d)
            groups.append(_Group((k,), (k,), (k,), (d,)))
        record = load_record(model)
        position = {k: i for i, k in enumerate(record.source_shapes)} if record is not None else {}
        self._specs = self._write_order(groups, record, position, {k: i for i, k in enumerate(self._state)})
        return groups

    def _plan(self, model: nn.Module) -> list[_Group]:
        record = load_record(model)
        renamings, forward = split_transforms(reverting_transforms(model))
        fired = {repr(t) for t in record.transforms} if record is not None else set()
        for c in forward:
            r = c.reverse_transform()
            if not isinstance(r, WeightConverter):
                raise ConfigurationError(f"the reverse of {c!r} is not a converter.")
            # Where a whole model's converter and a sub-model's both reverse onto one runtime key
            # (a sub-model entry for its own checkpoints), the one that fired at load wins, then
            # the outer one (the whole model's layout).
            depth = len((c.scope_prefix or "").split(".")) if c.scope_prefix else 0
            r.__dict__[SAVE_PRIORITY] = (repr(c) in fired, -depth)
            self._converters.append(r)
        self._forward = forward
        # The names the load read lead the way back, unless the file held runtime names only (a
        # runtime-layout checkpoint saves the hub layout, as a model never loaded does).
        read = record.source_shapes if record is not None else {}
        if read.keys() <= self._state.keys():
            rename = _InverseRenamer(renamings)
        else:  # the hub's name where the plain chain gives it, else one the load read, never a mix
            hub_renamings, _ = split_transforms(reverting_transforms(model, loaded=False))
            rename = _InverseRenamer(renamings, recorded=read, hub=_InverseRenamer(hub_renamings))
        stage1 = route_keys(list(self._state), self._converters)
        if stage1.conflicts:
            raise ConversionError(
                f"saving: {stage1.conflicts[0]}; the reversed converters collide. Check the mapping for two "
                "converters whose targets overlap."
            )
        # Recorded checkpoint shapes/dtypes, named as the reversed renamings will see them.
        dtypes: dict[str, torch.dtype] = {}
        position: dict[str, int] = {}
        shapes = _RecordedShapes(record, rename)
        if record is not None:
            dtypes = dict(record.source_dtypes)
            position = {k: i for i, k in enumerate(record.source_shapes)}
        runtime_order = {k: i for i, k in enumerate(self._state)}
        groups: list[_Group] = []
        plain_names: dict[str, str] = {}
        for tg in stage1.groups.values():
            for k in tg.source_keys:
                route = stage1.routes[k]
                self._routes[k] = (route.pattern_index or 0, route.index)
            if tg.converter is None:
                (src,) = tg.source_keys
                metas = {src: self._state[src]}
                group = _Group((src,), (src,), (src,), ())
            else:
                group, metas = self._plan_converter(tg.converter, tg.key, tuple(tg.source_keys), shapes)
            names = tuple(rename(k) for k in group.outputs)
            group.names = names
            for o in group.outputs:  # a mapping whose plain inverse is not one-to-one stays refused
                if (p := rename.plain(o)) in plain_names:
                    raise ConversionError(
                        f"saving: two tensors would be written as {p!r} (one from {o!r}, one from "
                        f"{plain_names[p]!r}); the reversed mapping is not one-to-one. Check the "
                        "renamings of the model's mapping."
                    )
                plain_names[p] = o
            recorded = record.companions if record is not None else {}
            group.dtypes = tuple(
                self._dtype(group, n, metas[o].dtype, dtypes, recorded) for n, o in zip(names, group.outputs)
            )
            if self._quantization == "as_loaded" and any(n in recorded for n in names):
                self._plan_encoding(group, recorded, metas)
            for n, o, d in zip(group.names, group.outputs, group.dtypes):
                if n in self._specs:
                    raise ConversionError(
                        f"saving: two tensors would be written as {n!r} (one from {o!r}); the reversed "
                        "mapping is not one-to-one. Check the renamings of the model's mapping."
                    )
                self._specs[n] = TensorSpec(tuple(metas[o].shape), d)
                if group.companion_of and n in group.companion_of:
                    scale = recorded[group.companion_of[n]][n]
                    self._specs[n] = TensorSpec(tuple(scale.shape), scale.dtype)
            groups.append(group)
        self._specs = self._write_order(groups, record, position, runtime_order)
        return groups

    def _dtype(
        self,
        group: _Group,
        name: str,
        computed: torch.dtype,
        dtypes: dict[str, torch.dtype],
        recorded: dict[str, Any],
    ) -> torch.dtype:
        """The dtype to write ``name`` in: the checkpoint's, except where that was a quantized storage dtype.

        ``save_checkpoint(dtype=...)`` replaces it for floats (never for codes re-encoded as loaded).
        """
        want = dtypes.get(name, computed)
        if name in recorded:  # stored quantized: re-encoded in its stored dtype, or written as floats
            return want if self._quantization == "as_loaded" else self._cast(computed)
        if not want.is_floating_point and any(
            isinstance(self._state[k], _Dequantized) for k in group.sources
        ):
            return self._cast(computed)  # loaded from a quantized runtime layout: the export is float
        return self._cast(want)

    def _cast(self, dtype: torch.dtype) -> torch.dtype:
        """``dtype``, or the ``dtype=`` of the save where that is a float to cast."""
        override = self._dtype_override
        return override if override is not None and is_castable(dtype) else dtype

    def _plan_encoding(
        self, group: _Group, recorded: dict[str, dict[str, torch.Tensor]], metas: dict[str, torch.Tensor]
    ) -> None:
        """Weights decoded at load get their recorded companions back: encode writes both."""
        group.encoded, group.companion_of = {}, {}
        extra: list[str] = []
        for n in group.names:
            if n in recorded:
                group.encoded[n] = recorded[n]
                for c in recorded[n]:
                    group.companion_of[c] = n
                    extra.append(c)
                    metas[c] = torch.empty(0, device="meta")  # its spec is the recorded tensor's
        group.outputs += tuple(extra)
        group.names += tuple(extra)
        group.dtypes += tuple(recorded[group.companion_of[c]][c].dtype for c in extra)

    def _write_order(
        self,
        groups: list[_Group],
        record: Any,
        position: dict[str, int],
        runtime_order: dict[str, int],
    ) -> dict[str, TensorSpec]:
        """Order the keys: the order write_checkpoint shards in, and reads values in.

        Keys the checkpoint had go back in its shard order, the largest of each shard first: with
        the checkpoint's ``max_shard_size``, greedy sharding then closes every shard exactly where
        the checkpoint's closed (the first key that did not fit there is no larger than the
        largest), so the files come out identical. Within a shard each group's keys stay together,
        so each group is computed once per shard it spans. Keys the checkpoint did not have (all of
        them, for a model never loaded) follow in runtime order.
        """
        last = len(position)
        for g in groups:
            order = sorted(range(len(g.names)), key=lambda i: position.get(g.names[i], last))
            g.outputs = tuple(g.outputs[i] for i in order)
            g.names = tuple(g.names[i] for i in order)
            g.dtypes = tuple(g.dtypes[i] for i in order)
        groups.sort(key=lambda g: (min(position.get(n, last) for n in g.names), runtime_order[g.sources[0]]))
        shard_of = record.source_shards if record is not None else {}
        unknown = max(shard_of.values(), default=-1) + 1  # keys the checkpoint did not have
        segments: dict[int, list[str]] = {}
        for g in groups:
            for n in g.names:
                segments.setdefault(shard_of.get(n, unknown), []).append(n)
        ordered: list[str] = []
        for shard in sorted(segments):
            keys = segments[shard]
            if shard != unknown:
                largest = max(
                    keys, key=lambda n: math.prod(self._specs[n].shape) * self._specs[n].dtype.itemsize
                )
                keys = [largest, *(n for n in keys if n != largest)]
            ordered.extend(keys)
        return {n: self._specs[n] for n in ordered}

    def _plan_converter(
        self, index: int, key: str, sources: tuple[str, ...], shapes: _RecordedShapes
    ) -> tuple[_Group, dict[str, torch.Tensor]]:
        conv = self._converters[index]
        targets = conv.expand_target_keys(key)
        residue = self._residues.get(min(sources))
        ctx = OpContext(
            n_targets=len(targets),
            target_shapes=tuple(shapes.get(t.replace("*", "0")) for t in targets),
            config=self._config_for(sources[0]),
            residue=None if residue is None else _meta_like(residue),
        )
        for k in sources:
            pat, idx = self._routes[k]
            conv.add_tensor(key, k, pat, _meta_like(self._state[k]), index=idx)
        metas = conv.convert(key, ctx)
        group = _Group(sources, tuple(metas), (), (), index, key, ctx, chain_order=tuple(metas))
        if len(sources) == 1:
            group.slot_shapes = self._view_slots(index, self._state[sources[0]], ctx)
        return group, metas

    def _view_slots(self, index: int, source: torch.Tensor, ctx: OpContext) -> list[Any] | None:
        """Output slot shapes, when the reversed chain's outputs are contiguous views of ``source``."""
        forward = self._forward[index]
        meta = torch.empty(source.shape, dtype=source.dtype, device="meta")
        try:
            slot_shapes = [shape_of(s) for s in run_chain(self._converters[index].operations, [meta], ctx)]
        except ConversionError:
            return None
        views = placement_views(
            forward, meta, slot_shapes, OpContext(n_targets=1, target_shapes=(tuple(source.shape),))
        )
        if views is None or not all_contiguous(views) or not (is_dtensor(source) or source.is_contiguous()):
            return None  # a DTensor is gathered into a fresh contiguous tensor
        return slot_shapes

    # ------------------------------------------------------------------ values
    def _computed(self, g: _Group, *, last: bool) -> dict[str, torch.Tensor]:
        """``g``'s outputs, computed after an agreement point of the ranks (one process: just computed).

        The agreement point comes first: a rank that failed since the previous group (rank 0
        writing its values) says so before anyone gathers. Every DTensor of the group is then
        gathered before anything that can fail, so a rank whose computation fails has entered
        every collective the others did, and shares its error at the agreement point they reach
        next: the next group's, or, after the ``last`` computation, one more, so that rank 0
        writes the last values and commits only once every rank has computed everything.
        """
        self._collective.agree()
        sources = {k: full_tensor(self._state[k]) for k in g.sources}
        with self._collective.step():
            out = self._compute(g, sources)
        if last:
            self._collective.agree()
        return out

    def _compute(self, g: _Group, sources: dict[str, Any]) -> dict[str, torch.Tensor]:
        if g.converter is None:
            (output,) = (
                o for o, n in zip(g.outputs, g.names) if not (g.companion_of and n in g.companion_of)
            )
            raw = {output: _value(sources[g.sources[0]])}
        elif g.slot_shapes is not None:
            src = _value(sources[g.sources[0]])
            ctx = OpContext(n_targets=1, target_shapes=(tuple(src.shape),))
            flat = flatten_slots(placement_views(self._forward[g.converter], src, g.slot_shapes, ctx) or [])
            if len(flat) != len(g.chain_order):
                raise ConversionError(
                    f"saving {g.sources[0]!r}: the planned views do not match; this is a bug."
                )
            raw = dict(zip(g.chain_order, flat))
        else:
            conv = self._converters[g.converter]
            for k in g.sources:
                pat, idx = self._routes[k]
                conv.add_tensor(g.key, k, pat, _value(sources[k]), index=idx)
            residue = self._residues.get(min(g.sources))
            raw = conv.convert(g.key, g.ctx if g.ctx is None else replace(g.ctx, residue=residue))
        out: dict[str, torch.Tensor] = {}
        for o, n, d in zip(g.outputs, g.names, g.dtypes):
            if g.companion_of and n in g.companion_of:
                continue  # written by its weight's encode
            t = raw[o]
            if g.encoded and n in g.encoded:
                out.update(self._encode(n, t, g.encoded[n]))
                continue
            out[n], cast = cast_checked(n, t, d)
            if cast is not None:
                self._casts[n] = cast
        return out

    def _encode(
        self, name: str, t: torch.Tensor, recorded: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        if self._encoder is None:
            raise ConversionError(
                f"saving {name!r}: the load recorded its companions but no quantizer; this is a bug."
            )
        encoded = self._encoder.encode(name, t, recorded)
        for k in (name, *recorded):
            spec = self._specs[k]
            got = encoded.get(k)
            if got is None or (tuple(got.shape), got.dtype) != (spec.shape, spec.dtype):
                found = "nothing" if got is None else f"{tuple(got.shape)} {got.dtype}"
                raise ConversionError(
                    f"saving {name!r}: {self._encoder.name}.encode gave {found} for {k!r}, but the checkpoint "
                    f"had {spec.shape} {spec.dtype}; save with quantization='dequantized' to write floats."
                )
        return {k: encoded[k] for k in (name, *recorded)}

    def __getitem__(self, key: str) -> torch.Tensor:
        i = self._group_of.get(key)
        if i is None:
            raise KeyError(key)
        if i != self._current:
            self._cache = {}  # drop the previous group's outputs before computing the next
            self._cache = self._computed(self._groups[i], last=key == self._closing_key)
            self._current = i
        return self._cache[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, key: object) -> bool:
        return key in self._specs

    # ------------------------------------------------------------------ introspection
    def spec(self, key: str) -> TensorSpec:
        """Shape and dtype ``key`` will have, without computing it.

        Raises:
            KeyError: ``key`` is not written by this save.
        """
        return self._specs[key]

    @property
    def specs(self) -> dict[str, TensorSpec]:
        """Every key's :class:`TensorSpec`, in write order."""
        return dict(self._specs)

    @property
    def group_keys(self) -> list[tuple[str, ...]]:
        """The keys of each group, in write order: what one computation produces."""
        return [g.names for g in self._groups]

    @property
    def encoded_keys(self) -> tuple[str, ...]:
        """The keys written re-encoded as stored at load (``quantization="as_loaded"``), companions excluded."""
        return tuple(n for g in self._groups if g.encoded for n in g.encoded)

    @property
    def casts(self) -> tuple[Cast, ...]:
        """The dtype casts of the values computed so far, in write order, each saying if it was lossy."""
        return tuple(self._casts[k] for k in self._specs if k in self._casts)

    @property
    def cached_keys(self) -> tuple[str, ...]:
        """The keys whose values the mapping holds right now (one group's at most)."""
        return tuple(self._cache)

    def groups(self) -> Iterator[dict[str, torch.Tensor]]:
        """Yield each group's ``{key: tensor}`` once, in write order (nothing is kept between groups)."""
        for i, g in enumerate(self._groups):
            self._cache, self._current = {}, None
            yield self._computed(g, last=i == len(self._groups) - 1)


def iter_reverted(
    model: nn.Module, *, original_format: bool = True, quantization: str = "as_loaded"
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the model's tensors in the requested layout, one converter group at a time.

    Raises:
        CheckpointError: a tensor is still on ``meta``.
        ConversionError: a reversed op chain failed, or two tensors would be written under one key.
    """
    collective = Collective.of_tensors(_model_tensors(model), what="revert_state_dict")
    with collective.step():
        state = RevertedState(
            model, original_format=original_format, quantization=quantization, collective=collective
        )
    collective.agree()
    yield from state.groups()


def _model_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def revert_state_dict(
    model: nn.Module, *, original_format: bool = True, quantization: str = "as_loaded"
) -> dict[str, torch.Tensor]:
    """The model's tensors in the original checkpoint layout, in memory (every group at once).

    Tensors that need no computation (plain keys, experts cut out of a fused parameter) share
    memory with the model's parameters; ``.clone()`` them before modifying them. For a
    tensor-parallel model the call is collective (every rank calls it) and every rank gets the
    whole tensors; a failure on one rank is raised on every rank (see :func:`save_checkpoint`).

    Example:
        >>> sd = surgery.revert_state_dict(model)  # doctest: +SKIP
    """
    out: dict[str, torch.Tensor] = {}
    for part in iter_reverted(model, original_format=original_format, quantization=quantization):
        out.update(part)
    return out


def save_checkpoint(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    original_format: bool = True,
    max_shard_size: int | str = "5GB",
    metadata: dict[str, str] | None = None,
    quantization: str = "as_loaded",
    dtype: torch.dtype | None = None,
) -> SavedFiles:
    """Save ``model`` as safetensors, atomically.

    Args:
        model: the module tree. For a tensor-parallel model (DTensor parameters) the save is
            collective: every rank calls it; each group's DTensors are gathered when the group is
            computed (``full_tensor()``), rank 0 writes, and the other ranks return ``[]`` once
            rank 0's files are in place. The files equal a single-process save's. Per-rank shard
            files are not offered: an original-layout key (one expert's ``w1``) is a slice of
            every rank's shard. Every rank checks the arguments before the first collective, and
            a failure on any rank (a refused path, rank 0's write, a rank's reversed chain) is
            raised on every rank, within the step it happened in (:mod:`surgery.collective`).
        path: a directory (``model.safetensors`` or shards plus an index) or a ``.safetensors`` file.
        original_format: write the checkpoint layout the model was loaded from (inverting exactly
            the transforms that fired, and every fusion); ``False`` writes the runtime layout and
            persists the fusion config so a later load re-applies the fusions.
        max_shard_size: e.g. ``"5GB"``, ``"500MiB"`` or a byte count.
        metadata: extra safetensors metadata (string to string).
        quantization: weights that were stored quantized and decoded at load (FP8 with block
            scales): ``"as_loaded"`` (default) re-encodes them with the scales recorded at load, so
            an unchanged model writes its FP8 files back bit for bit (a block whose values
            outgrew its scale gets a fresh one); ``"dequantized"`` writes floats. Applies to the
            original layout; a runtime-layout save writes the decoded floats. A model quantized
            on the fly writes its quantized layout with ``original_format=False`` (and the
            quantizer's metadata, so a later load rebuilds it) and dequantized floats with
            ``original_format=True`` (lossy).
        dtype: write every floating tensor in this dtype (``torch.float16``, ``bfloat16``,
            ``float32`` or ``float64``). Without it, the original layout writes each tensor in
            the dtype the checkpoint had at load (so ``model.to(torch.bfloat16)`` then a save of a
            float32 checkpoint writes float32: load → save reproduces the input), and a tensor
            that was not loaded, or a runtime-layout save, in the dtype the model holds.
            Quantized storage is never cast: integer and bool tensors, FP8 codes re-encoded as
            loaded and their scales (which keep their stored dtype, float32 in DeepSeek-V3
            checkpoints), int8 codes and scales of a runtime layout. ``config.json``'s ``dtype``
            (and ``torch_dtype``) names the dtype most floating values were written in.

    The ``config.json`` and ``generation_config.json`` of the checkpoint the model was loaded from
    are copied into a directory that has none, and ``config.json`` is made to describe the tensors
    written (:mod:`surgery.saved_config`): its ``quantization_config`` matches the quantized
    tensors (none after writing floats), its ``fusion_config`` holds only fusions transformers
    performs, and a layout transformers cannot read (an int8 runtime layout, a ``gate_up``
    fusion) makes transformers refuse it with a message saying so, instead of loading it wrong.

    Returns:
        The files written (:class:`~surgery.casting.SavedFiles`, a list of paths), with the dtype
        casts made (``casts``; ``lossy_keys``: the tensors whose values the cast changed).

    Raises:
        CheckpointError: ``path`` cannot be written (a file where the directory goes, under a
            file, not writable), a tensor is still on ``meta``, or writing failed (the previous
            checkpoint at ``path`` is then left as it was).
        ConfigurationError: ``max_shard_size``, ``quantization`` or ``dtype`` is not valid.
        ConversionError: a reversed op chain failed.

        A collective save raises the same error on every rank: the failed rank's class, its
        message prefixed with ``save_checkpoint to '<path>' failed on rank R of N``.

    Example:
        >>> surgery.save_checkpoint(model, "out/")  # doctest: +SKIP
    """
    collective = Collective.of_tensors(_model_tensors(model), what=f"save_checkpoint to '{path}'")
    with collective.step():  # every rank checks everything before the first collective
        check_write_arguments(path, max_shard_size=max_shard_size, metadata=metadata)
        meta = dict(metadata or {})
        fusion = persistable_fusion_config(model)  # pinned to the exact module paths it rewrote
        if not original_format and fusion:
            meta[FUSION_METADATA_KEY] = json.dumps(fusion, sort_keys=True)
        state = RevertedState(
            model,
            original_format=original_format,
            quantization=quantization,
            collective=collective,
            dtype=dtype,
        )
        written_quantized = _quantized_on_the_fly(model) if not original_format else None
        if written_quantized is not None:
            meta.update(written_quantized.metadata())
        described = _describe_written(model, state, written_quantized, original_format=original_format)
        described = replace(described, dtype=_written_dtype(state), dtype_requested=dtype is not None)
    collective.agree()
    if collective.rank != 0:
        with collective.step():  # the groups rank 0's writes compute, in its order, for the gathers
            for key in state.specs:
                state[key]
        collective.agree()  # rank 0 has written (or failed): the files are there when this returns
        return SavedFiles(casts=state.casts)
    with collective.step():
        files = write_checkpoint(state, path, max_shard_size=max_shard_size, metadata=meta, specs=state.specs)
        _carry_configs(model, Path(path))
        target = Path(path)
        write_config_json(target if target.is_dir() else target.parent, described)
    collective.agree()
    return SavedFiles(files, casts=state.casts)


_CARRIED_CONFIGS = ("config.json", "generation_config.json")


def _carry_configs(model: nn.Module, path: Path) -> None:
    """Copy ``config.json``/``generation_config.json`` of the checkpoint the model was loaded from.

    Only into a directory that has none yet, so the output loads in transformers with its own
    config (without one, transformers builds a default config silently). Written atomically.
    """
    record = load_record(model)
    if record is None or not record.checkpoint:
        return
    source = Path(record.checkpoint)
    source_dir = source if source.is_dir() else source.parent
    target_dir = path if path.is_dir() else path.parent
    if source_dir.resolve() == target_dir.resolve():
        return
    for name in _CARRIED_CONFIGS:
        src, dst = source_dir / name, target_dir / name
        if not src.is_file() or dst.exists():
            continue
        try:
            data = src.read_bytes()
        except OSError:
            continue
        write_file_atomically(dst, data)


def _model_quantizer(model: nn.Module) -> Any:
    """The quantizer of the model's last load, else the one that prepared it, else ``None``."""
    record = load_record(model)
    if record is not None and record.quantizer is not None:
        return record.quantizer
    return model.__dict__.get(QUANTIZER_ATTRIBUTE)


def _written_dtype(state: RevertedState) -> str | None:
    """The dtype most floating values are written in (what ``config.json`` calls the model's dtype)."""
    numel: dict[torch.dtype, int] = {}
    for spec in state.specs.values():
        if is_castable(spec.dtype):
            numel[spec.dtype] = numel.get(spec.dtype, 0) + math.prod(spec.shape)
    return str(max(numel, key=numel.__getitem__)).removeprefix("torch.") if numel else None


def _quantized_keys(model: nn.Module) -> set[str]:
    """The runtime keys of quantized modules' stored tensors (codes and scales)."""
    keys: set[str] = set()
    for path, module in model.named_modules():
        for name in getattr(module, "quantized_names", None) or ():
            keys.add(f"{path}.{name}" if path else name)
    return keys


def _quantized_on_the_fly(model: nn.Module) -> QuantizerHooks | None:
    """The hooks of the quantizer whose modules the model holds (a runtime-layout save writes their codes)."""
    quantizer = _model_quantizer(model)
    if quantizer is None or not any(getattr(m, "quantized_names", None) is not None for m in model.modules()):
        return None
    return QuantizerHooks(quantizer)


def _describe_written(
    model: nn.Module, state: RevertedState, written_quantized: QuantizerHooks | None, *, original_format: bool
) -> SavedConfig:
    """What the ``config.json`` of this save must say: the fusions and the quantization written.

    ``written_quantized``: the quantizer whose codes a runtime-layout save writes (``None``: none).
    """
    fusions = None if original_format else fusion_config_of(model)
    record = load_record(model)
    encoded = set(state.encoded_keys)
    if encoded and record is not None and record.quantizer is not None:  # FP8 re-encoded as loaded
        hooks = QuantizerHooks(record.quantizer)
        unquantized = tuple(
            sorted(
                k.removesuffix(".weight")
                for k, spec in state.specs.items()
                if k.endswith(".weight")
                and len(spec.shape) >= 2
                and spec.dtype.is_floating_point
                and k not in encoded
            )
        )
        return saved_config(
            fusions=fusions,
            quantization=hooks.quantization_config(),
            quantization_loads_in_transformers=hooks.loads_in_transformers,
            unquantized_modules=unquantized,
            original_format=original_format,
        )
    if written_quantized is not None:  # int8 codes and scales
        return saved_config(
            fusions=fusions,
            quantization=written_quantized.quantization_config(),
            quantization_loads_in_transformers=written_quantized.loads_in_transformers,
        )
    return saved_config(fusions=fusions)  # floats only
