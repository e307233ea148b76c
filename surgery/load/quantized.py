"""What a quantizer changes in a load plan (see :mod:`surgery.quantization` for the hooks).

Planning asks the quantizer, from headers alone: which checkpoint keys are companions of a
stored-quantized weight (taken out of routing, read with their weight), what each decoded source
looks like to the op chain (a ``meta`` run of ``decode``), and which targets ``quantize`` turns
into which runtime keys (a ``meta`` run of ``quantize``). A source stored quantized that nobody
decodes is an error here, never a cast, and so is a companion no stored-quantized key claims.

Values a file controls that headers cannot vouch for (NaN, zero or negative scales) are read and
checked here too (:func:`check_stored`), for the small tensors the quantizer names: a load whose
scales are unusable fails before any tensor is set.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..checkpoint import CheckpointReader, StoredTensor, open_checkpoint
from ..errors import ConversionError
from ..model_state import dtype_name
from ..parallel.regions import NOT_NEEDED, Region
from ..quantization import SMALL_COMPANION_BYTES, QuantizerHooks

__all__ = [
    "CompanionsOnDisk",
    "CompanionsRead",
    "broken_units",
    "check_stored",
    "claim_companions",
    "companion_bytes",
    "companion_part",
    "decoded_info",
    "plan_quantize",
    "prequantized_sources",
    "quantized_cast_problem",
    "read_companion",
]


def prequantized_sources(
    infos: list[StoredTensor], reader: CheckpointReader, hooks: QuantizerHooks | None
) -> str:
    """Why these sources cannot be cast as they are (``""`` when they can).

    A float8 tensor stored with a ``<key>_scale_inv`` companion holds quantized values
    (block-wise FP8, the DeepSeek-V3 layout): casting them to a float dtype ignores the scales
    and gives wrong numbers, so such a source is an error unless a quantizer decodes it.
    """
    for info in infos:
        if hooks is not None and hooks.keeps_packed(info.key):
            continue  # loads 1:1 into a module that decodes it with its scales
        if info.dtype.is_floating_point and info.dtype.itemsize == 1 and f"{info.key}_scale_inv" in reader:
            which = f"{hooks.name} does not decode it" if hooks is not None else "no quantizer was given"
            return (
                f"{info.key!r} is {dtype_name(info.dtype)} with the scales {info.key + '_scale_inv'!r}: the "
                f"checkpoint is pre-quantized, and casting its values without the scales would load wrong "
                f"weights ({which}). Pass quantizer=surgery.quantization.FP8BlockQuantizer() (block size "
                "from the config's weight_block_size, or FP8BlockQuantizer.from_config(config.json))."
            )
    return ""


def claim_companions(
    keys: list[str], reader: CheckpointReader, hooks: QuantizerHooks
) -> tuple[list[str], dict[str, tuple[str, ...]], dict[str, str]]:
    """Take the quantizer's companion keys out of ``keys``.

    Returns the keys left to route, ``key -> companions`` of every key to decode, and ``key ->
    message`` for keys that cannot be decoded (a missing companion, or a key the quantizer
    refuses) and for companions no key claims (their owner is missing or not stored quantized,
    and then the owner too: values stored next to scales may be codes cast to a wider dtype);
    those keys are still routed, so their entries fail with the message.
    """
    companions_of: dict[str, tuple[str, ...]] = {}
    errors: dict[str, str] = {}
    for key in keys:
        try:
            found = hooks.companions(key, reader.info(key))
        except ConversionError as exc:
            errors[key] = str(exc)
            continue
        if not found:
            continue
        missing = [c for c in found if c not in reader]
        if missing:
            errors[key] = (
                f"{key!r} is stored quantized ({dtype_name(reader.info(key).dtype)}), and {hooks.name} needs "
                f"{', '.join(repr(m) for m in missing)} to decode it, which the checkpoint lacks."
            )
        companions_of[key] = found
    claimed = {c for found in companions_of.values() for c in found}
    left = [k for k in keys if k not in claimed]
    for key in left:
        owner = hooks.companion_of(key)
        if owner is None or key in errors:
            continue
        if owner not in reader:
            why = f"the checkpoint has no {owner!r}"
        else:
            why = f"{owner!r} is stored as {dtype_name(reader.info(owner).dtype)}, which {hooks.name} does not decode"
        errors[key] = (
            f"{key!r} belongs with {owner!r} (its companion for {hooks.name}), but {why}: nothing decodes with it. "
            f"Remove {key!r} from the checkpoint, or load it with the quantizer that wrote it."
        )
        if owner in reader and owner not in errors:
            # values stored next to scales may be codes cast to a wider dtype: never load them as they are
            errors[owner] = errors[key]
    return left, companions_of, errors


def check_stored(
    hooks: QuantizerHooks,
    reader: CheckpointReader,
    source_keys: tuple[str, ...],
    decoded: dict[str, tuple[str, ...]],
    checked: dict[str, torch.Tensor],
    regions: Mapping[str, Any] | None = None,
    partial: set[str] | None = None,
    read: Mapping[str, torch.Tensor] | None = None,
) -> str:
    """Read and check the tensors ``hooks.checks`` names among ``source_keys`` and their companions.

    ``regions``: per source key, the part of its decoded values this rank reads (tensor
    parallelism); a companion is then read and checked only where it covers that part
    (:func:`read_companion`), and named in ``partial``; a source this rank does not read
    (``NOT_NEEDED``: an expert another rank owns) is not checked at all. Returns the first problem (``""`` when there is none). Companions
    that pass go into ``checked``, so that decoding uses what was checked instead of reading them
    again; ``read`` holds companions read whole already (values planning needed).
    """
    for key in source_keys:
        region = (regions or {}).get(key)
        if region is NOT_NEEDED:
            continue  # another rank's (an expert it owns): never read here
        for k in (*decoded.get(key, ()), key):
            if k in checked or not hooks.checks(k, reader.info(k)):
                continue
            if k in (read or {}):
                tensor, part = (read or {})[k], None
            elif k == key:
                tensor, part = reader.get_tensor(k), None
            else:
                tensor, part = read_companion(hooks, reader, key, k, region)
            try:
                hooks.check(k, tensor if part is None else part.take(tensor))
            except ConversionError as exc:
                return str(exc)
            if k != key:
                checked[k] = tensor
                if part is not None and partial is not None:
                    partial.add(k)
    return ""


def read_companion(
    hooks: QuantizerHooks, reader: CheckpointReader, key: str, companion: str, region: Any
) -> tuple[torch.Tensor, Region | None]:
    """``companion`` of ``key`` at its full shape, read only where it covers ``region`` of ``key``.

    Returns the tensor and the part read (``None``: all of it). Outside that part the tensor
    holds ones (a filler every scale check accepts, for a quantizer that checks what ``decode``
    is given) that decoding ``region`` never uses (the quantizer's ``companion_region`` says
    which rows or blocks it does use); a record of the load reads the rest when a save needs it
    (:class:`CompanionsRead`).
    """
    part = companion_part(hooks, reader, key, companion, region)
    if part is None:
        return reader.get_tensor(companion), None
    whole = reader.info(companion)
    out = torch.ones(whole.shape, dtype=whole.dtype)
    for a, e in part.intervals:
        out.narrow(part.dim, a, e - a).copy_(reader.read_region(companion, part.dim, [(a, e)]))
    return out, part


def companion_part(
    hooks: QuantizerHooks, reader: CheckpointReader, key: str, companion: str, region: Any
) -> Region | None:
    """The part of ``companion`` a rank reads for ``region`` of ``key`` (``None``: all of it)."""
    info = reader.info(key)
    part = hooks.companion_region(key, companion, region, info) if isinstance(region, Region) else None
    whole = reader.info(companion)
    if part is None or len(whole.shape) == 0:
        return None
    dim = part.dim % len(whole.shape)
    if sum(e - a for a, e in part.intervals) >= whole.shape[dim]:
        return None
    return Region.of(dim, part.intervals)


def companion_bytes(
    hooks: QuantizerHooks, reader: CheckpointReader, key: str, companions: tuple[str, ...], region: Any
) -> int:
    """The bytes of ``key``'s companions a rank reads for ``region`` of it (what :func:`read_companion` reads)."""
    total = 0
    for c in companions:
        whole = reader.info(c)
        part = companion_part(hooks, reader, key, c, region)
        if part is None:
            total += whole.nbytes
        else:
            total += whole.nbytes // whole.shape[part.dim] * sum(e - a for a, e in part.intervals)
    return total


class CompanionsOnDisk:
    """The companions of one load that a rank did not read whole, read from the checkpoint in one
    pass when a save first asks for one of them.

    Each weight's :class:`CompanionsRead` registers its missing companions here; the first one a
    save needs opens the checkpoint once and reads them all (scales: small next to their weights),
    instead of opening it once per companion (a header parse each: seconds at 500k keys).
    """

    def __init__(self, checkpoint: str) -> None:
        self.checkpoint = checkpoint
        self.names: set[str] = set()
        self.values: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor:
        if name not in self.values:
            with open_checkpoint(self.checkpoint) as reader:
                for n in sorted(self.names - self.values.keys() | {name}):
                    self.values[n] = reader.get_tensor(n)
        return self.values[name]


class CompanionsRead(Mapping[str, torch.Tensor]):
    """The companions a decode used, some read only in part or not at all: the rest comes from
    ``on_disk`` when first asked for.

    A tensor-parallel rank reads the scale rows covering its share, an expert-parallel rank none
    of the experts it does not own; a save that re-encodes the whole tensor needs all of them,
    and gets them from the checkpoint that was loaded.
    """

    def __init__(
        self, values: Mapping[str, torch.Tensor | None], partial: set[str], on_disk: CompanionsOnDisk
    ) -> None:
        self._values = dict(values)
        self._partial = set(partial) & set(values)
        self._on_disk = on_disk
        on_disk.names.update(self._partial)

    @classmethod
    def unread(cls, names: tuple[str, ...], on_disk: CompanionsOnDisk) -> CompanionsRead:
        """The companions of a weight this rank did not read (an expert another rank owns)."""
        return cls(dict.fromkeys(names), set(names), on_disk)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._partial:
            self._values[name] = self._on_disk.get(name)
            self._partial.discard(name)
        value = self._values[name]
        assert value is not None  # every name without a value is partial
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def broken_units(model: nn.Module, filled: set[str]) -> dict[str, str]:
    """Runtime keys of quantized modules that would load without the rest of their module, with why.

    ``filled``: the runtime keys the work list fills. A quantized module's tensors (its
    ``quantized_names``: int8 codes and their scales) mean something only together: codes loaded
    next to scales that failed, mismatched or are missing would be a model that runs and lies.
    Each such key is returned with the message its entry fails with.
    """
    out: dict[str, str] = {}
    seen: set[str] = set()
    for key in filled:
        path, _, name = key.rpartition(".")
        if path in seen:
            continue
        module = model.get_submodule(path) if path else model
        names = getattr(module, "quantized_names", None) or ()
        if name not in names:
            continue
        seen.add(path)
        prefix = f"{path}." if path else ""
        lacking = [prefix + n for n in names if prefix + n not in filled]
        if not lacking:
            continue
        for n in names:
            k = prefix + n
            if k in filled:
                out[k] = (
                    f"{k!r} is not loaded because "
                    f"{', '.join(repr(x) for x in lacking)} of the same quantized {type(module).__name__} is not "
                    "(failed, mismatched or missing; see the report): a quantized module's tensors load together "
                    "or not at all."
                )
    return out


def decoded_info(
    hooks: QuantizerHooks,
    info: StoredTensor,
    decoded: dict[str, tuple[str, ...]],
    reader: CheckpointReader,
    cache: dict[Any, tuple[tuple[int, ...], torch.dtype]],
    read: dict[str, torch.Tensor],
) -> StoredTensor:
    """``info`` as the op chain sees it after decoding (checked by a ``meta`` run of ``decode``).

    A quantizer whose decoding changes shapes (``stored_region``) gets the values of the small
    companions (a stored ``weight_shape``; not the scales a rank reads in part, see
    :func:`read_companion`), kept in ``read`` for the checks; the memo then holds them too.
    """
    names = decoded.get(info.key)
    if not names:
        return info
    companions = {c: reader.info(c) for c in names}
    values = (
        {
            c: read[c] if c in read else read.setdefault(c, reader.get_tensor(c))
            for c, i in companions.items()
            if i.nbytes <= SMALL_COMPANION_BYTES and not _sliced(hooks, info, c)
        }
        if hooks.reshapes
        else {}
    )
    key = (
        info.shape,
        info.dtype,
        tuple((c.removeprefix(info.key), i.shape, i.dtype) for c, i in companions.items()),
        tuple((c.removeprefix(info.key), tuple(v.flatten().tolist())) for c, v in values.items()),
    )
    found = cache.get(key)
    if found is None:
        t = hooks.decode_meta(info.key, info, companions, values)
        found = cache[key] = (tuple(t.shape), t.dtype)
    shape, dtype = found  # built directly: dataclasses.replace costs ~3 us a key at 500k keys
    return StoredTensor(info.key, dtype, shape, info.file, info.offset, info.nbytes)


def _sliced(hooks: QuantizerHooks, info: StoredTensor, companion: str) -> bool:
    """Whether ``companion`` holds per-row or per-block values (a rank reads part of it), not a shape."""
    dims = {0, len(info.shape) - 1} if info.shape else set()
    return any(
        hooks.companion_region(info.key, companion, Region(d, ((0, 1),)), info) is not None for d in dims
    )


def plan_quantize(
    hooks: QuantizerHooks,
    model: nn.Module,
    out_keys: tuple[str, ...],
    out_shapes: list[tuple[int, ...]],
    out_dtypes: list[torch.dtype],
    runtime: dict[str, torch.Tensor],
    cache: dict[Any, dict[str, torch.Tensor]],
) -> dict[str, tuple[str, ...]]:
    """Per target the quantizer takes, the runtime keys its ``quantize`` produces (checked on ``meta``).

    ``cache`` (one per planning pass) keeps the meta run per module type, local name, shape and
    dtype, relative to the module's path: 500 linears of 3 shapes run ``quantize`` 3 times.

    A target whose checkpoint tensor already has the runtime's non-float dtype (a checkpoint
    saved quantized) is read as it is; one of another integer dtype is an error.
    """
    out: dict[str, tuple[str, ...]] = {}
    for key, shape, dtype in zip(out_keys, out_shapes, out_dtypes):
        path = key.rpartition(".")[0]
        module = model.get_submodule(path) if path else model
        if not hooks.quantizes(key, module):
            continue
        if not dtype.is_floating_point:
            if dtype == runtime[key].dtype:
                continue  # stored quantized already (a runtime-layout save): read as it is
            raise ConversionError(
                f"{key!r} is stored as {dtype_name(dtype)}: {hooks.name} quantizes floats and reads "
                f"{dtype_name(runtime[key].dtype)} codes as they are, and quantizing integer values as if they "
                "were weights would load garbage. The file was not written in this layout; load it with the "
                "quantizer that wrote it."
            )
        prefix, _, name = key.rpartition(".")
        prefix = f"{prefix}." if prefix else ""
        memo = (type(module), name, shape, dtype)
        relative = cache.get(memo)
        if relative is None:
            produced = hooks.quantize_meta(key, shape, dtype)
            if all(k.startswith(prefix) for k in produced):
                cache[memo] = {k.removeprefix(prefix): t for k, t in produced.items()}
        else:
            produced = {prefix + k: t for k, t in relative.items()}
        for k, t in produced.items():
            if k not in runtime:
                raise ConversionError(
                    f"{hooks.name}.quantize({key!r}) produced {k!r}, which the model does not have."
                )
            want = runtime[k]
            if (tuple(t.shape), t.dtype) != (tuple(want.shape), want.dtype):
                raise ConversionError(
                    f"{hooks.name}.quantize({key!r}) produced {k!r} as {tuple(t.shape)} {dtype_name(t.dtype)}; "
                    f"the model holds {tuple(want.shape)} {dtype_name(want.dtype)}."
                )
        out[key] = tuple(produced)
    return out


def quantized_cast_problem(
    model: nn.Module,
    reader: CheckpointReader,
    key: str,
    source_key: str,
    dtype: torch.dtype,
    runtime: dict[str, torch.Tensor],
) -> str:
    """Why casting ``source_key`` (``dtype``) into ``key`` would load garbage (``""`` when it would not).

    Two casts across a quantization boundary are refused: floats into a tensor of a quantized
    module (the values would be truncated to integers; the module needs its quantizer), and an
    int8 weight stored with its ``weight_scale`` into a float tensor (the values without the
    scale; the checkpoint needs the quantizer that wrote it).
    """
    target = runtime[key]
    path, _, name = key.rpartition(".")
    if dtype.is_floating_point and not target.is_floating_point():
        module = model.get_submodule(path) if path else model
        if name in (getattr(module, "quantized_names", None) or ()):
            return (
                f"{key!r} belongs to the quantized {type(module).__name__} and holds {dtype_name(target.dtype)}, but the "
                f"checkpoint's {source_key!r} is {dtype_name(dtype)}: pass the quantizer that quantizes it "
                "(e.g. quantizer=Int8WeightOnlyQuantizer(...)) instead of casting floats to integers."
            )
    if dtype in (torch.int8, torch.uint8) and target.is_floating_point() and name == "weight":
        scale = source_key.removesuffix("weight") + "weight_scale"
        if scale in reader:
            return (
                f"{source_key!r} is {dtype_name(dtype)} with the scales {scale!r}: it was saved quantized, and casting "
                f"it into the {dtype_name(target.dtype)} {key!r} would load the integers without their scales. Load it "
                "with the quantizer that wrote it (without quantizer=, one persisted in the checkpoint's metadata "
                "is rebuilt)."
            )
    return ""
