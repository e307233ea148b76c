"""The dtype a save writes a tensor in, and whether casting to it changed values.

A save writes each tensor in one dtype (:func:`surgery.save_checkpoint`): without ``dtype=``, the
dtype the checkpoint had at load (so load → save reproduces the input, whatever dtype the model
ran in), else the dtype the model holds; with ``dtype=``, that dtype for every floating tensor
that is not a quantized storage (integer, bool and FP8 codes, and the scales that decode them,
keep theirs: casting a scale would change every value it decodes).

Every cast a save makes is recorded as a :class:`Cast`, with whether it changed a value: a cast
the dtypes make exact (bfloat16 → float32) is not checked; a narrowing one (float32 → bfloat16)
is cast back and compared, a million values at a time, stopping at the first changed one (in
random weights, the first chunk), so ``lossy`` says whether *these* values changed, not whether
some could. :class:`SavedFiles` is what a save returns: the files written,
and its casts.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from .errors import ConfigurationError
from .load.plan import fold_indices
from .model_state import lossy_cast

__all__ = ["SAVE_DTYPES", "Cast", "SavedFiles", "cast_checked", "check_save_dtype", "is_castable"]

SAVE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
"""The dtypes ``save_checkpoint(dtype=...)`` writes floating tensors in, by name (``--dtype``)."""


class Cast(NamedTuple):
    """One tensor a save wrote in another dtype than the one it had in the model."""

    key: str
    source: torch.dtype
    written: torch.dtype
    lossy: bool  # a value changed (cast back, it differs)


def check_save_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a torch dtype a save can write floats in; ``None`` stays ``None``.

    Raises:
        ConfigurationError: not one of :data:`SAVE_DTYPES` (FP8 and integers are quantizations).

    Example:
        >>> check_save_dtype("bfloat16")
        torch.bfloat16
    """
    if dtype is None:
        return None
    found = SAVE_DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if found not in SAVE_DTYPES.values():
        raise ConfigurationError(
            f"save dtype {dtype!r}: a save casts floating tensors to one of {', '.join(SAVE_DTYPES)}; "
            "to store FP8 or int8 weights, load with a quantizer (docs/quantization.md)."
        )
    return found


def is_castable(dtype: torch.dtype) -> bool:
    """Whether ``save_checkpoint(dtype=...)`` casts a tensor of ``dtype``: floats of 16 bits or more."""
    return dtype.is_floating_point and dtype.itemsize >= 2


def cast_checked(key: str, t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Cast | None]:
    """``t`` in ``dtype``, and the :class:`Cast` made (``None``: it had that dtype).

    Example:
        >>> cast_checked("w", torch.tensor([1.0, 1.0001]), torch.bfloat16)[1].lossy
        True
    """
    if t.dtype == dtype:
        return t, None
    out = t.to(dtype)
    lossy = lossy_cast(t.dtype, dtype) and _changed(t, out)  # the dtypes allow a change: did one happen?
    return out, Cast(key, t.dtype, dtype, lossy)


_CHUNK = 1 << 20
"""Elements compared at a time: a changed value (in random weights, the first) ends the check early."""


def _changed(t: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out`` (``t`` cast) cast back differs from ``t`` anywhere (a NaN kept as NaN is no change)."""
    source, cast = t.reshape(-1), out.reshape(-1)
    for start in range(0, source.numel(), _CHUNK):
        a, back = source[start : start + _CHUNK], cast[start : start + _CHUNK].to(t.dtype)
        if torch.equal(back, a):
            continue
        if not t.dtype.is_floating_point or bool(((back != a) & ~(back.isnan() & a.isnan())).any()):
            return True
    return False


class SavedFiles(list[Path]):
    """The files a save wrote (a list of paths), with the dtype casts it made (:attr:`casts`) and the
    quantized weights it re-quantized (:attr:`requantized`).

    Example:
        >>> files = surgery.save_checkpoint(model, "out/", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> files.lossy_keys  # doctest: +SKIP
        ('model.layers.0.mlp.up_proj.weight', ...)
    """

    def __init__(
        self, files: Iterable[Path] = (), *, casts: Iterable[Cast] = (), requantized: Iterable[str] = ()
    ) -> None:
        super().__init__(files)
        self.casts: tuple[Cast, ...] = tuple(casts)
        self.requantized: tuple[str, ...] = tuple(requantized)
        """Keys written quantized as loaded that were re-quantized: with fresh scales, or as codes that
        no longer decode to the model's values (the weights changed since the load)."""

    @property
    def lossy_keys(self) -> tuple[str, ...]:
        """The keys whose written values differ from the model's (a lossy cast)."""
        return tuple(c.key for c in self.casts if c.lossy)

    def summary(self) -> str:
        """One line per kind of cast, e.g. ``cast 7 tensor(s) float32 → bfloat16 (lossy: 5 changed values)``."""
        kinds: dict[tuple[torch.dtype, torch.dtype], list[Cast]] = {}
        for c in self.casts:
            kinds.setdefault((c.source, c.written), []).append(c)
        lines = []
        for (source, written), casts in kinds.items():
            lossy = [c.key for c in casts if c.lossy]
            what = (
                f"lossy: {len(lossy)} changed values: {fold_indices(lossy)}"
                if lossy
                else "exact: no value changed"
            )
            lines.append(f"cast {len(casts)} tensor(s) {_name(source)} → {_name(written)} ({what})")
        if self.requantized:
            lines.append(
                f"re-quantized {len(self.requantized)} tensor(s) changed since the load (fresh scales or changed "
                f"codes): {fold_indices(list(self.requantized))}"
            )
        return "\n".join(lines)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
