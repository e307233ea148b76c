"""The model's tensors in the layout a save writes, computed lazily, one converter group at a time.

Reversal runs in two stages, mirroring loading: first every converter's inverse (its op chain
reversed), then every renaming's inverse in reverse order (:mod:`surgery.save.inverse` says which).
Tensors loaded with a dtype cast are cast back, so load → save reproduces the input bit for bit
wherever the load's cast was lossless (bfloat16 → float32); a lossy one (float32 → bfloat16,
reported as such by the load) comes back as the rounded values.

:class:`RevertedState` is the lazy view a save writes from: every output key, shape and dtype is
known up front (the reversed chains run on ``meta`` tensors), and values are computed one
converter group at a time, holding only the current group's outputs. Where the reversed chain only
slices (``Split``/``Chunk``/``SplitModulelist``, e.g. fused experts back to per-expert weights) the
outputs are views of the parameter and cost no memory at all. Weights that were *stored* quantized
and decoded at load (FP8 block scales) are re-encoded with the scales recorded at load
(``quantization="as_loaded"``, bit for bit when the weights are unchanged) or written as floats
(``quantization="dequantized"``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import nn

from ..casting import Cast, cast_checked, check_save_dtype, is_castable
from ..collective import Collective
from ..converter import Collector, WeightConverter, split_transforms
from ..errors import CheckpointError, ConfigurationError, ConversionError
from ..load.plan import fold_indices
from ..model_state import config_lookup, tied_groups
from ..ops import OpContext, run_chain
from ..parallel import full_tensor, is_dtensor
from ..placement import all_contiguous, flatten_slots, placement_views, shape_of
from ..quantization import QuantizerHooks
from ..record import record_of
from .inverse import (
    RecordedShapes,
    inverse_renamer,
    reversed_converters,
    reverting_transforms,
    route_by_precedence,
)
from .quantized import Dequantized, dequantize_stage, quantized_keys, value_of

__all__ = [
    "QUANTIZATION_MODES",
    "RevertedState",
    "TensorSpec",
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
    record = record_of(model).load
    groups = {id(keys): keys for keys in tied_groups(state).values()}  # one entry per tied group
    drop: set[str] = set()
    for keys in groups.values():
        preferred = [k for k in keys if record is not None and k in record.loaded_keys]
        chosen = preferred[0] if preferred else keys[0]
        drop.update(k for k in keys if k != chosen)
    return {k: t.detach() for k, t in state.items() if k not in drop}


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """A ``meta`` tensor of ``t``'s global shape and dtype (a DTensor's global shape, not its shard)."""
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


def _refuse_meta(state: dict[str, torch.Tensor]) -> None:
    on_meta = [k for k, t in state.items() if t.device.type == "meta"]
    if on_meta:
        raise CheckpointError(
            f"Cannot save: {len(on_meta)} tensor(s) are still on the meta device and hold no data: "
            f"{fold_indices(on_meta)}. They were not in the checkpoint the model was loaded from (see "
            "the load report's missing_keys); load them, or materialize them (e.g. model.to_empty(...) "
            "and initialize) before saving."
        )


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
    encoded: dict[str, Mapping[str, torch.Tensor]] | None = None  # name -> scales recorded at load
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
        self._requantized: set[str] = set()
        self._state: dict[str, Any] = _dedup_state(model)
        self._collective = collective or Collective.of_tensors(
            self._state.values(), what="computing the reverted state"
        )
        _refuse_meta(self._state)
        if original_format:
            self._state = dequantize_stage(model, self._state)
            if quantization == "dequantized":  # weights kept packed at runtime: floats too
                self._state = dequantize_stage(model, self._state, names_attribute="packed_names")
        self._quantization = quantization
        record = record_of(model).load
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
        codes = quantized_keys(model)  # a quantized module's codes and scales keep their dtypes
        for k, t in self._state.items():
            d = t.dtype if k in codes else self._cast(t.dtype)
            self._specs[k] = TensorSpec(tuple(t.shape), d)
            groups.append(_Group((k,), (k,), (k,), (d,)))
        record = record_of(model).load
        position = {k: i for i, k in enumerate(record.source_shapes)} if record is not None else {}
        self._specs = self._write_order(groups, record, position, {k: i for i, k in enumerate(self._state)})
        return groups

    def _plan(self, model: nn.Module) -> list[_Group]:
        record = record_of(model).load
        renamings, forward = split_transforms(reverting_transforms(model))
        self._converters, precedence = reversed_converters(forward, record)
        self._forward = forward
        rename = inverse_renamer(model, renamings, record, self._state.keys())
        stage1 = route_by_precedence(list(self._state), self._converters, precedence)
        # Recorded checkpoint shapes/dtypes, named as the reversed renamings will see them.
        dtypes: dict[str, torch.dtype] = {}
        position: dict[str, int] = {}
        shapes = RecordedShapes(record, rename)
        if record is not None:
            dtypes = dict(record.source_dtypes)
            position = {k: i for i, k in enumerate(record.source_shapes)}
        runtime_order = {k: i for i, k in enumerate(self._state)}
        groups: list[_Group] = []
        plain_names: dict[str, str] = {}
        self._routes = stage1.routes
        for converter, key, sources in stage1.groups:
            if converter is None:
                (src,) = sources
                metas = {src: self._state[src]}
                group = _Group((src,), (src,), (src,), ())
            else:
                group, metas = self._plan_converter(converter, key, sources, shapes)
            recorded = record.companions if record is not None else {}
            names = tuple(rename(k) for k in group.outputs)
            if self._quantization == "dequantized" and self._encoder is not None:  # floats: the float name
                names = tuple(self._encoder.dequantized_name(n) if n in recorded else n for n in names)
            group.names = names
            for o in group.outputs:  # a mapping whose plain inverse is not one-to-one stays refused
                if (p := rename.plain(o)) in plain_names:
                    raise ConversionError(
                        f"saving: two tensors would be written as {p!r} (one from {o!r}, one from "
                        f"{plain_names[p]!r}); the reversed mapping is not one-to-one. Check the "
                        "renamings of the model's mapping."
                    )
                plain_names[p] = o
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
                if group.encoded and n in group.encoded and record is not None and n in record.source_shapes:
                    self._specs[n] = TensorSpec(record.source_shapes[n], d)  # packed: the stored shape
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
        stored_quantized = not want.is_floating_point or want.itemsize == 1  # codes: int, FP8
        if stored_quantized and any(isinstance(self._state[k], Dequantized) for k in group.sources):
            return self._cast(computed)  # loaded from a quantized (or packed) layout: the export is float
        return self._cast(want)

    def _cast(self, dtype: torch.dtype) -> torch.dtype:
        """``dtype``, or the ``dtype=`` of the save where that is a float to cast."""
        override = self._dtype_override
        return override if override is not None and is_castable(dtype) else dtype

    def _plan_encoding(
        self,
        group: _Group,
        recorded: Mapping[str, Mapping[str, torch.Tensor]],
        metas: dict[str, torch.Tensor],
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
        self, index: int, key: str, sources: tuple[str, ...], shapes: RecordedShapes
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
        collector = Collector(conv)
        for k in sources:
            pat, idx = self._routes[k]
            collector.add_tensor(key, k, pat, _meta_like(self._state[k]), index=idx)
        metas = collector.convert(key, ctx)
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
        sources = {k: self._whole(self._state[k]) for k in g.sources}
        with self._collective.step():
            out = self._compute(g, sources)
        if last:
            self._collective.agree()
        return out

    def group_index(self, key: str) -> int:
        """The index of the group whose computation produces ``key`` (see :attr:`group_keys`).

        Raises:
            KeyError: ``key`` is not written by this save.
        """
        return self._group_of[key]

    def group_sources(self, index: int) -> tuple[str, ...]:
        """The runtime keys group ``index`` is computed from."""
        return self._groups[index].sources

    def source(self, key: str) -> Any:
        """The model's tensor under runtime ``key`` (a DTensor stays one), as a group is computed from it."""
        return self._state[key]

    def compute_group(self, index: int, sources: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Group ``index``'s outputs from its ``sources`` given whole (:meth:`source` values,
        DTensors assembled by the caller); runs no collective and keeps nothing."""
        return self._compute(self._groups[index], sources)

    def _whole(self, t: Any) -> Any:
        """A source gathered whole on every rank (a collective for a DTensor); torch's
        ``full_tensor()`` unless it misplaces the parts (FSDP2 over a packed TP placement)."""
        if not is_dtensor(t):
            return t
        from ..parallel.assemble import torch_misreads, whole_on_every_rank

        if torch_misreads(t.placements):
            return whole_on_every_rank(t, self._collective.group)
        return full_tensor(t)

    def _compute(self, g: _Group, sources: dict[str, Any]) -> dict[str, torch.Tensor]:
        if g.converter is None:
            (output,) = (
                o for o, n in zip(g.outputs, g.names) if not (g.companion_of and n in g.companion_of)
            )
            raw = {output: value_of(sources[g.sources[0]])}
        elif g.slot_shapes is not None:
            src = value_of(sources[g.sources[0]])
            ctx = OpContext(n_targets=1, target_shapes=(tuple(src.shape),))
            flat = flatten_slots(placement_views(self._forward[g.converter], src, g.slot_shapes, ctx) or [])
            if len(flat) != len(g.chain_order):
                raise ConversionError(
                    f"saving {g.sources[0]!r}: the planned views do not match; this is a bug."
                )
            raw = dict(zip(g.chain_order, flat))
        else:
            collector = Collector(self._converters[g.converter])
            for k in g.sources:
                pat, idx = self._routes[k]
                collector.add_tensor(g.key, k, pat, value_of(sources[k]), index=idx)
            residue = self._residues.get(min(g.sources))
            raw = collector.convert(g.key, g.ctx if g.ctx is None else replace(g.ctx, residue=residue))
        out: dict[str, torch.Tensor] = {}
        for o, n, d in zip(g.outputs, g.names, g.dtypes):
            if g.companion_of and n in g.companion_of:
                continue  # written by its weight's encode
            t = raw[o]
            if g.encoded and n in g.encoded:
                out.update(self._encode(n, t, dict(g.encoded[n])))
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
        out = {k: encoded[k] for k in (name, *recorded)}
        if not _encoded_as_loaded(self._encoder, name, t, out, recorded):
            self._requantized.add(name)
        return out

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
    def requantized(self) -> tuple[str, ...]:
        """Keys computed so far that were re-quantized: written with fresh scales (or zero points), or
        as codes that no longer decode to the model's values (the weights changed since the load)."""
        return tuple(k for k in self._specs if k in self._requantized)

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


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _encoded_as_loaded(
    encoder: QuantizerHooks,
    name: str,
    t: torch.Tensor,
    encoded: dict[str, torch.Tensor],
    recorded: dict[str, torch.Tensor],
) -> bool:
    """Whether ``encoded`` keeps the recorded companions and decodes back to the model's ``t`` exactly.

    One decode per re-encoded weight: a save that wrote codes of changed weights says so
    (:attr:`RevertedState.requantized`) instead of writing a lossy tensor silently.
    """
    if encoded[name].device.type == "meta":
        return True
    if not all(_same_bytes(encoded[c], recorded[c].to(encoded[c].device)) for c in recorded):
        return False
    companions = {c: encoded[c] for c in recorded}
    back = encoder.decode(name, encoded[name], companions)
    return back.shape == t.shape and torch.equal(back.to(t.dtype), t)
