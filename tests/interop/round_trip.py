"""One family's round trip through transformers and surgery, shared by the generated test and the survey.

:func:`round_trip` builds a tiny model (:mod:`tiny`), lets transformers write its original (hub)
checkpoint, loads it back with transformers (the reference), then loads it with surgery into a
fresh model and saves it again. Each step that can fail raises an :class:`Outcome` naming whose
step failed, so the generated test can tell "transformers cannot build or round-trip this family
itself" (listed with the reason) from "surgery gets it wrong" (a failure).
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tiny import Candidate, build, reseeded

from surgery.load.loader import load_checkpoint
from surgery.resolution import get_model_conversion_mapping as get_surgery_mapping
from surgery.save import save_checkpoint

__all__ = [
    "Measured",
    "NoSuchLayout",
    "NotBuilt",
    "NotSelfRoundTripped",
    "Outcome",
    "RoundTrips",
    "SurgeryMismatch",
    "impossible_keys",
    "round_trip",
]


class Outcome(Exception):
    """A round trip that stopped; ``str()`` is the reason."""


class NotBuilt(Outcome):
    """transformers cannot build a tiny model of this class (the reason names the error)."""


class NotSelfRoundTripped(Outcome):
    """transformers' own save + load of the tiny model does not give it back."""


class SurgeryMismatch(Outcome):
    """surgery's load or save differs from transformers'."""


class NoSuchLayout(Outcome):
    """transformers writes keys no layout of the family has, and the test records no hub layout for it."""


def impossible_keys(keys: Any, model: Any) -> list[str]:
    """The keys that no checkpoint of the family holds: the same name twice at the front.

    ``thinker.thinker.``, ``text_encoder.text_encoder.``, ``ultrabert.ultrabert.``: a reversed prefix
    change that fired inside the scope already holding its prefix (transformers 5.23 writes those),
    unless the family's own mapping reads that doubled name (TIPSv2-DPT's hub files hold
    ``depth_head.depth_head.``). A prefix put around another family's base model (GTE's
    ``new.gte.``) cannot be told from a real wrapper by its shape (a Qwen-Omni thinker's
    ``thinker.model.`` is the hub layout): those are established per family, with evidence, in
    ``HUB_LAYOUT``.
    """
    read_by_mapping = " ".join(
        p.replace("\\", "") for t in get_surgery_mapping(model) for p in t.source_patterns
    )
    return sorted(
        k
        for k in keys
        if len(parts := k.split(".")) > 2
        and parts[0] == parts[1]
        and f"{parts[0]}.{parts[1]}." not in read_by_mapping
    )


def read(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str | None:
    """``None`` when both hold the same keys, dtypes and values; else what differs first."""
    if sorted(got) != sorted(want):
        extra, lacking = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        return f"{len(extra)} extra keys {extra[:3]}, {len(lacking)} lacking keys {lacking[:3]}"
    for k, t in want.items():
        if got[k].dtype != t.dtype:
            return f"{k}: dtype {got[k].dtype}, want {t.dtype}"
        if got[k].shape != t.shape or not _same_bits(got[k], t):
            return f"{k}: values differ (shape {tuple(got[k].shape)}, want {tuple(t.shape)})"
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads and signed zeros included)."""
    if a.dtype.is_floating_point and a.element_size() in (2, 4, 8):
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
    return torch.equal(a, b)


def _state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


@dataclass(frozen=True)
class Measured:
    """One family's round trip: the note it returned (``None``: exact) or the :class:`Outcome` that
    stopped it, and the catalog keys resolved for the model's sub-models (class name or model type)."""

    note: str | None
    stopped: Outcome | None
    resolved: tuple[str, ...]


class RoundTrips:
    """Each family's round trip, measured once and kept: the every-family test and the catalog page's
    generator (``docs/make_catalog.py``, run by the doc test) ask for the same ones in one session.

    Each measurement writes under a temporary directory of ``root``, removed once it is measured.
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._measured: dict[tuple[Candidate, Any, bool], Measured] = {}

    def measured(
        self,
        candidate: Candidate,
        *,
        hub_layout: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
        check_never_loaded: bool = True,
    ) -> Measured:
        """The family's :class:`Measured`, measured on the first call with these options."""
        key = (candidate, hub_layout, check_never_loaded)
        if key not in self._measured:
            self._measured[key] = self._measure(candidate, hub_layout, check_never_loaded)
        return self._measured[key]

    def run(
        self,
        candidate: Candidate,
        *,
        hub_layout: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
        check_never_loaded: bool = True,
    ) -> str | None:
        """What :func:`round_trip` returns (or raises) for the family, measured once."""
        m = self.measured(candidate, hub_layout=hub_layout, check_never_loaded=check_never_loaded)
        if m.stopped is not None:
            raise m.stopped
        return m.note

    def _measure(
        self,
        candidate: Candidate,
        hub_layout: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None,
        check_never_loaded: bool,
    ) -> Measured:
        from surgery.resolution import explain_model_conversion_mapping

        try:
            writer = _build(candidate, seed=0)
        except NotBuilt as e:
            return Measured(None, e, ())
        resolved = tuple(
            r.key
            for r in explain_model_conversion_mapping(writer)
            if r.key is not None and r.outcome in ("class_name", "model_type")
        )
        with tempfile.TemporaryDirectory(dir=self._root) as tmp:
            try:
                note = round_trip(
                    candidate,
                    Path(tmp),
                    hub_layout=hub_layout,
                    check_never_loaded=check_never_loaded,
                    writer=writer,
                )
            except Outcome as e:
                return Measured(None, e, resolved)
        return Measured(note, None, resolved)


def _build(candidate: Candidate, *, seed: int) -> Any:
    """:func:`tiny.build` with warnings silenced; :class:`NotBuilt` names why it cannot be built."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return build(candidate, seed=seed)
        except Exception as e:
            raise NotBuilt(f"{type(e).__name__}: {e}") from e


def round_trip(
    candidate: Candidate,
    root: Path,
    *,
    hub_layout: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    check_never_loaded: bool = True,
    writer: Any = None,
) -> str | None:
    """Raise an :class:`Outcome` unless surgery loads and saves the family exactly.

    ``hub_layout`` rewrites transformers' written file (keys, tensors) into the real hub layout where
    transformers' save gets it wrong (one of its defects). Returns ``None`` when transformers
    round-trips the file itself and surgery matches it; otherwise the return value says why, and
    surgery is checked against the model that wrote the file (transformers cannot load it) or
    against transformers' reading of the file (it holds other values than the model's). ``writer`` is
    the model that writes the file when the caller built it already (``tiny.build(candidate, seed=0)``).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping

    note = None
    model = writer if writer is not None else _build(candidate, seed=0)
    fresh = reseeded(model, seed=1)  # what _build(candidate, seed=1) builds, before anything touches model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = type(model)
        try:
            # The hub layout: what transformers writes after loading a hub checkpoint.
            model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False)
            model.save_pretrained(root / "original")
        except Exception as e:
            raise NotSelfRoundTripped(f"save_pretrained fails: {type(e).__name__}: {e}") from e
        written = read(root / "original")
        if hub_layout is not None:
            _rewrite(root / "original", hub_layout)
        elif bad := impossible_keys(written, model):
            raise NoSuchLayout(
                f"transformers writes {len(bad)} keys no checkpoint of the family holds ({bad[:3]}): "
                "establish the hub layout and record it (HUB_LAYOUT), or save transformers' layout"
            )
        want = _state(model)
        try:
            reference, info = cls.from_pretrained(root / "original", output_loading_info=True)
        except Exception as e:
            note = f"transformers' from_pretrained fails: {type(e).__name__}: {str(e)[:200]}"
        else:
            problems = {
                k: info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)
            }
            if problems:
                note = f"transformers' from_pretrained reports {_short(problems)}"
            elif (diff := differences(_state(reference), want)) is not None:
                # The file does not hold the model that wrote it (transformers' save wrote other
                # values): surgery must read what the file holds, as transformers' load does.
                note = f"transformers' from_pretrained gives another model: {diff}"
                want = _state(reference)
        original = read(root / "original")

    report = load_checkpoint(fresh, root / "original")
    if not report.ok:
        raise SurgeryMismatch(f"load reports problems: {str(report)[:600]}")
    if (diff := differences(_state(fresh), want)) is not None:
        raise SurgeryMismatch(f"load differs from what the file holds: {diff}")
    save_checkpoint(fresh, root / "saved")
    saved = read(root / "saved")
    if bad := impossible_keys(saved, fresh):
        raise SurgeryMismatch(f"save writes {len(bad)} keys no checkpoint of the family holds: {bad[:3]}")
    # Bit for bit the file transformers' from_pretrained was checked on above (note None: it gives
    # the writing model back exactly), so transformers reloads surgery's save exactly as well.
    if (diff := differences(saved, original)) is not None:
        raise SurgeryMismatch(f"save differs from the original file: {diff}")
    if check_never_loaded and note is None:
        # The model that wrote the file was never loaded through surgery: saving it in original
        # format must give the same file (the family's layout, not the layout a load recorded).
        save_checkpoint(model, root / "never-loaded")
        if (diff := differences(read(root / "never-loaded"), original)) is not None:
            raise SurgeryMismatch(
                f"saving a model that was never loaded differs from the original file: {diff}"
            )
    return note


def _rewrite(directory: Path, layout: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """Rewrite every safetensors file in ``directory`` in place through ``layout`` (metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            metadata = h.metadata()
        save_file({k: v.contiguous() for k, v in layout(load_file(f)).items()}, f, metadata=metadata)


def _short(problems: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {sorted(map(str, v))[:3]} ({len(v)})" for k, v in problems.items())
