r"""Ernie 4.5 VL MoE: one routed-expert list split into text and vision experts, and back.

Original layout (hub checkpoints), per MoE layer with ``E`` experts per modality::

    model.layers.N.mlp.experts.{0..E-1}.{gate,up,down}_proj.weight     text experts
    model.layers.N.mlp.experts.{E..2E-1}.{gate,up,down}_proj.weight    vision experts
    model.layers.N.mlp.gate.weight     [H, E]   (text router)   mlp.gate.weight_1  [H, E]  (vision)
    model.layers.N.mlp.moe_statics.e_score_correction_bias  [2, E]
    model.embed_tokens / model.layers / model.norm / model.vision_model
    model.resampler_model.{spatial,temporal}_linear.{0,2,3}

Runtime layout::

    model.language_model.layers.N.mlp.text_moe.experts.gate_up_proj    [E, 2I_text, H]
    model.language_model.layers.N.mlp.text_moe.experts.down_proj       [E, H, I_text]
    model.language_model.layers.N.mlp.vision_moe.experts.gate_up_proj  [E, 2I_vision, H]
    model.language_model.layers.N.mlp.vision_moe.experts.down_proj     [E, H, I_vision]
    model.language_model.layers.N.mlp.{text,vision}_moe.gate.weight    [E, H]
    model.language_model.layers.N.mlp.{text,vision}_moe.gate.moe_statics.e_score_correction_bias [1, E]
    model.language_model.{embed_tokens,layers,norm}   model.vision_tower
    model.resampler_model.{spatial,temporal}_linear.{fc1,fc2,ln}

The expert split needs an op of its own, :class:`FuseAndSplitTextVisionExperts`, written here
with the public :mod:`surgery.ops` API exactly as a user extending the library would. Shared
experts (``mlp.shared_experts.*``) are not touched.

Adapted from the reference: the language-model ``norm.`` rename skips keys already under
``language_model.`` (as its ``embed_tokens``/``layers`` siblings do), so a runtime-layout
checkpoint loads unchanged instead of becoming ``language_model.language_model.norm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from surgery import ConversionError, WeightConverter, WeightRenaming, ops
from surgery.transforms import WeightTransform

__all__ = [
    "ALIASES",
    "ENTRIES",
    "FuseAndSplitTextVisionExperts",
    "SplitAndDecoupleTextVisionExperts",
]


def _error(op: ops.ConversionOp, ctx: ops.OpContext, message: str) -> ConversionError:
    return ConversionError(f"{op!r} {ctx.where()}: {message}")


@dataclass(frozen=True)
class FuseAndSplitTextVisionExperts(ops.ConversionOp):
    """Split every gathered expert list into equal parts (one per target) and fuse across sources.

    Input: one slot per source pattern (``experts.*.gate_proj.weight``, ``experts.*.up_proj.weight``),
    each a list of ``N`` expert tensors in index order. With ``T`` targets (text, vision), part
    ``i`` holds experts ``i*N/T .. (i+1)*N/T - 1``. Each part is stacked along ``stack_dim`` and
    the sources' stacks are concatenated along ``concat_dim``, so target ``i`` is
    ``cat([stack(gate part i), stack(up part i)], concat_dim)``.

    Args:
        stack_dim: the new expert dimension of each stack.
        concat_dim: the dimension (of the stacked tensor) along which sources are fused.

    Example:
        >>> import torch
        >>> gate = [torch.full((2, 3), float(e)) for e in range(4)]
        >>> up = [torch.full((2, 3), 10.0 + e) for e in range(4)]
        >>> op = FuseAndSplitTextVisionExperts()
        >>> text, vision = op.convert([gate, up], ops.OpContext(n_targets=2))
        >>> tuple(text.shape), text[1, 0, 0].item(), vision[0, 2, 0].item()
        ((2, 4, 3), 1.0, 12.0)
    """

    supports_many_to_many: ClassVar[bool] = True

    stack_dim: int = 0
    concat_dim: int = 1

    def convert(self, slots: list[ops.Slot], ctx: ops.OpContext) -> list[ops.Slot]:
        parts = ctx.n_targets
        fused: list[list[torch.Tensor]] = [[] for _ in range(parts)]
        for slot in slots:
            if not isinstance(slot, list):
                raise _error(
                    self,
                    ctx,
                    "expects expert lists gathered by '*' (experts.*.<name>.weight), got one tensor.",
                )
            if not slot or len(slot) % parts:
                raise _error(
                    self,
                    ctx,
                    f"cannot split {len(slot)} experts into {parts} equal groups (one per target); "
                    "text and vision must have the same number of experts.",
                )
            size = len(slot) // parts
            for i in range(parts):
                group = slot[i * size : (i + 1) * size]
                if len({tuple(t.shape) for t in group}) != 1:
                    raise _error(
                        self, ctx, f"experts of group {i} differ in shape: {[tuple(t.shape) for t in group]}."
                    )
                fused[i].append(torch.stack(group, dim=self.stack_dim))
        return [torch.cat(stacks, dim=self.concat_dim) for stacks in fused]

    @property
    def reverse_op(self) -> ops.ConversionOp:
        return SplitAndDecoupleTextVisionExperts(stack_dim=self.stack_dim, concat_dim=self.concat_dim)


@dataclass(frozen=True)
class SplitAndDecoupleTextVisionExperts(ops.ConversionOp):
    """Inverse of :class:`FuseAndSplitTextVisionExperts`: fused text/vision tensors → expert lists.

    Input: one fused tensor per part (text, vision). Each is cut into ``n_targets`` equal pieces
    along ``concat_dim`` (one per original list, e.g. gate and up) and every piece is unbound along
    ``stack_dim``; list ``j`` is the text experts of piece ``j`` followed by the vision experts.
    """

    supports_many_to_many: ClassVar[bool] = True

    stack_dim: int = 0
    concat_dim: int = 1

    def convert(self, slots: list[ops.Slot], ctx: ops.OpContext) -> list[ops.Slot]:
        lists = ctx.n_targets
        out: list[list[torch.Tensor]] = [[] for _ in range(lists)]
        for slot in slots:
            if isinstance(slot, list):
                raise _error(self, ctx, "expects fused expert tensors, got a list.")
            size = slot.shape[self.concat_dim]
            if size % lists:
                raise _error(
                    self,
                    ctx,
                    f"dim {self.concat_dim} of shape {tuple(slot.shape)} does not split into {lists} equal pieces.",
                )
            for j, piece in enumerate(torch.split(slot, size // lists, dim=self.concat_dim)):
                out[j].extend(t.contiguous() for t in torch.unbind(piece, dim=self.stack_dim))
        return list(out)

    @property
    def reverse_op(self) -> ops.ConversionOp:
        return FuseAndSplitTextVisionExperts(stack_dim=self.stack_dim, concat_dim=self.concat_dim)


ENTRIES: dict[str, list[WeightTransform]] = {
    "ernie4_5_vl_moe": [
        # vision tower and resampler
        WeightRenaming("vision_model", "vision_tower"),
        WeightRenaming(r"spatial_linear\.0", "spatial_linear.fc1"),
        WeightRenaming(r"spatial_linear\.2", "spatial_linear.fc2"),
        WeightRenaming(r"spatial_linear\.3", "spatial_linear.ln"),
        WeightRenaming(r"temporal_linear\.0", "temporal_linear.fc1"),
        WeightRenaming(r"temporal_linear\.2", "temporal_linear.fc2"),
        WeightRenaming(r"temporal_linear\.3", "temporal_linear.ln"),
        # language model
        WeightRenaming(r"(?<!language_model\.)embed_tokens", "language_model.embed_tokens"),
        WeightRenaming(r"(?<!language_model\.)layers", "language_model.layers"),
        WeightRenaming(r"(?<!language_model\.)(?<!\w)norm\.", "language_model.norm."),
        # routers, router bias and the routed experts
        WeightConverter(
            r"mlp\.gate\.weight_1", "mlp.vision_moe.gate.weight", [ops.Transpose(dim0=0, dim1=1)]
        ),
        WeightConverter(r"mlp\.gate\.weight", "mlp.text_moe.gate.weight", [ops.Transpose(dim0=0, dim1=1)]),
        WeightConverter(
            r"mlp\.moe_statics\.e_score_correction_bias",
            [
                "mlp.text_moe.gate.moe_statics.e_score_correction_bias",
                "mlp.vision_moe.gate.moe_statics.e_score_correction_bias",
            ],
            [ops.Chunk(dim=0)],
        ),
        WeightConverter(
            r"experts\.*\.down_proj\.weight",
            ["text_moe.experts.down_proj", "vision_moe.experts.down_proj"],
            [FuseAndSplitTextVisionExperts(stack_dim=0, concat_dim=1)],
        ),
        WeightConverter(
            [r"experts\.*\.gate_proj\.weight", r"experts\.*\.up_proj\.weight"],
            ["text_moe.experts.gate_up_proj", "vision_moe.experts.gate_up_proj"],
            [FuseAndSplitTextVisionExperts(stack_dim=0, concat_dim=1)],
        ),
    ],
}
"""Registry key → transform list (unscoped prototypes; the registry hands out copies)."""

ALIASES: dict[str, str] = {}
"""Registry key → the key whose mapping it shares (none for this family)."""


ADAPTED_PATTERNS: dict[str, dict[str, str]] = {
    "ernie4_5_vl_moe": {r"(?<!_)(?<!\w)norm\.": r"(?<!language_model\.)(?<!\w)norm\."},
}
"""Key -> {transformers' source pattern: ours}, where ours deliberately differs (see the module docstring)."""
