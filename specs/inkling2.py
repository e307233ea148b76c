r"""Inkling2 and Inkling2Loop: the language model under ``model.llm``, a padded unembedding, looped layers.

Original layout (hub checkpoints)::

    model.llm.unembed.weight                    [vocab_size, H]  (padded past unpadded_vocab_size)
    model.llm.embed.weight / embed_norm.*       model.llm.layers.N.attn.{wq_du,wk_dv,...}
    model.llm.layers.N.mlp.experts.w13_weight   [E, 2I, H]  (gate and up rows interleaved)
    model.llm.attn_res.attn_queries.{N-1}       (the query of layer N, stored from layer 1 on)
    model.visual.backbone.* / model.visual.proj_{in,out}.*

* ``inkling2_text``/``inkling2``: ``w13`` experts de-interleaved (``Interleave``), the per-layer
  attention queries moved by one index (``surgery.transforms.IndexOffsetRenaming``).
* From transformers 5.24 the attention projections are modules of their own
  (``self_attn.q_proj.linear``, ``self_attn.relative_position_bias``, ...) and the runtime
  unembedding holds only the first ``unpadded_vocab_size`` rows (:class:`Inkling2UnpadVocab`).
  ``ENTRIES`` hold those lists; ``BEFORE`` the lists of the earlier releases' classes
  (:mod:`specs.releases`). The hub layout is the same for both.
* ``inkling2_loop_text``: the looped layers' message gates renamed, and the two stored query
  tables merged into one ``(num_loop_layers, 4, H)`` parameter
  (:class:`Inkling2LoopMergeMessageQueries`). Its original experts are stored NVFP4 or MXFP8:
  experts in floating point load and save exactly; quantized ones are refused by name
  (:class:`Inkling2LoopDequantizeExperts`; their scales, ``QUANTIZED_COMPANIONS``, are reported
  unexpected) until the quantized-formats work (issue 29) loads them and writes their bytes back.

Where transformers cannot reverse, we do: its ``Inkling2UnpadVocab`` pads back with zeros, ours
puts back the padding rows the load dropped (kept in the model's load record; zeros for a model
never loaded, as transformers writes); its dequantizing op saves dequantized experts, ours never
dequantizes.

**Adapted** (``ADAPTED_PATTERNS``): renames whose targets contain their sources
(``embed_norm``, ``weight_proj``, ``position_embedding``) skip names already renamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from surgery import ConversionError, WeightConverter, WeightRenaming, ops
from surgery.transforms import IndexOffsetRenaming, WeightTransform

from .releases import Before

__all__ = [
    "ADAPTED_PATTERNS",
    "ALIASES",
    "BEFORE",
    "ENTRIES",
    "QUANTIZED_COMPANIONS",
    "Inkling2LoopDequantizeExperts",
    "Inkling2LoopMergeMessageQueries",
    "Inkling2UnpadVocab",
]


def _error(op: ops.ConversionOp, ctx: ops.OpContext, message: str) -> ConversionError:
    where = ctx.where()
    return ConversionError(f"{op!r}{' ' + where if where else ''}: {message}")


def _one(op: ops.ConversionOp, slots: list[ops.Slot], ctx: ops.OpContext) -> torch.Tensor:
    if len(slots) != 1 or not isinstance(slots[0], torch.Tensor):
        raise _error(op, ctx, f"expects one tensor, got {len(slots)} slot(s).")
    return slots[0]


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


@dataclass(frozen=True)
class Inkling2UnpadVocab(ops.ConversionOp):
    """Keep the first rows of a padded unembedding; ``inverse=True`` pads it back.

    The row count is the target's shape (the model's parameter on load, the recorded checkpoint
    tensor on save), else the config's ``unpadded_vocab_size`` (load) or ``vocab_size`` (save).
    The rows dropped on load are handed to :attr:`~surgery.ops.OpContext.keep_residue`, and the
    padding put back is :attr:`~surgery.ops.OpContext.residue` when the load recorded it: a load
    then save gives back any padding bit for bit. Without one (a model never loaded, a checkpoint
    without padding rows) the padding is zero rows, which is what transformers writes.

    Example:
        >>> import torch
        >>> w, kept_rows = torch.randn(5, 2), []
        >>> (kept,) = Inkling2UnpadVocab().convert([w], ops.OpContext(target_shapes=((3, 2),), keep_residue=kept_rows.append))
        >>> (back,) = Inkling2UnpadVocab(inverse=True).convert([kept], ops.OpContext(target_shapes=((5, 2),), residue=kept_rows[0]))
        >>> tuple(kept.shape), tuple(kept_rows[0].shape), torch.equal(back, w)
        ((3, 2), (2, 2), True)
    """

    inverse: bool = False

    def _rows(self, ctx: ops.OpContext) -> int:
        shape = ctx.target_shapes[0] if ctx.target_shapes else None
        if shape is not None:
            return shape[0]
        attribute = "vocab_size" if self.inverse else "unpadded_vocab_size"
        rows = getattr(_text_config(ctx.config), attribute, None)
        if not isinstance(rows, int):
            raise _error(self, ctx, f"needs the target shape or the config's {attribute}; neither is known.")
        return rows

    def convert(self, slots: list[ops.Slot], ctx: ops.OpContext) -> list[ops.Slot]:
        t = _one(self, slots, ctx)
        rows = self._rows(ctx)
        if self.inverse:
            padding = self._padding(t, rows, ctx)
            # In the wider dtype: recorded float32 padding stays exact when the model runs in bfloat16.
            wide = torch.promote_types(t.dtype, padding.dtype)
            return [torch.cat([t.to(wide), padding.to(wide)])]
        if rows > t.shape[0]:
            raise _error(self, ctx, f"the checkpoint holds {t.shape[0]} rows, fewer than the {rows} kept.")
        if ctx.keep_residue is not None and rows < t.shape[0]:
            ctx.keep_residue(t[rows:].clone())  # only the padding rows, not a view of all of t
        return [t[:rows].contiguous()]

    def _padding(self, t: torch.Tensor, rows: int, ctx: ops.OpContext) -> torch.Tensor:
        if rows < t.shape[0]:
            raise _error(self, ctx, f"cannot pad {t.shape[0]} rows down to {rows}.")
        shape = (rows - t.shape[0], *t.shape[1:])
        if ctx.residue is None:
            return t.new_zeros(shape)
        if tuple(ctx.residue.shape) != shape:
            raise _error(
                self,
                ctx,
                f"the padding rows recorded at load have shape {tuple(ctx.residue.shape)}, but {shape} are "
                "needed: the unembedding changed shape since the load. Save it padded with zeros after "
                "surgery.load.record.clear_record(model), or reload the checkpoint.",
            )
        return ctx.residue.to(device=t.device)

    @property
    def reverse_op(self) -> ops.ConversionOp:
        return Inkling2UnpadVocab(inverse=not self.inverse)


@dataclass(frozen=True)
class Inkling2LoopMergeMessageQueries(ops.ConversionOp):
    """Two ``(2L, H)`` query tables → one ``(L, 4, H)``: per loop layer query, key, value, mlp.

    The first source holds ``[query, mlp]`` of each loop layer, the second ``[key, value]``;
    ``inverse=True`` splits them back.

    Example:
        >>> import torch
        >>> q, kv = torch.arange(4.0).view(4, 1), torch.arange(10.0, 14.0).view(4, 1)
        >>> (merged,) = Inkling2LoopMergeMessageQueries().convert([q, kv], ops.OpContext())
        >>> merged[1, :, 0].tolist()
        [2.0, 12.0, 13.0, 3.0]
    """

    inverse: bool = False

    def convert(self, slots: list[ops.Slot], ctx: ops.OpContext) -> list[ops.Slot]:
        if self.inverse:
            t = _one(self, slots, ctx)
            if t.ndim < 2 or t.shape[1] != 4:
                raise _error(self, ctx, f"expects (loop layers, 4, ...), got shape {tuple(t.shape)}.")
            return [t[:, [0, 3]].flatten(0, 1).contiguous(), t[:, 1:3].flatten(0, 1).contiguous()]
        if len(slots) != 2 or not all(isinstance(s, torch.Tensor) for s in slots):
            raise _error(self, ctx, f"expects two tensors (queries, kv queries), got {len(slots)} slot(s).")
        queries, kv = slots[0], slots[1]
        assert isinstance(queries, torch.Tensor) and isinstance(kv, torch.Tensor)  # checked above
        if queries.shape != kv.shape or queries.ndim < 1 or queries.shape[0] % 2:
            raise _error(
                self,
                ctx,
                f"expects two tables of one shape with an even row count, got {tuple(queries.shape)} "
                f"and {tuple(kv.shape)}.",
            )
        q, kv2 = queries.unflatten(0, (-1, 2)), kv.unflatten(0, (-1, 2))
        return [torch.cat([q[:, :1], kv2, q[:, 1:]], dim=1)]

    @property
    def reverse_op(self) -> ops.ConversionOp:
        return Inkling2LoopMergeMessageQueries(inverse=not self.inverse)


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Inkling2LoopDequantizeExperts(ops.ConversionOp):
    """Inkling2Loop experts in floating point pass through; NVFP4/MXFP8 codes are refused.

    transformers dequantizes the original NVFP4 (codes, block scales, amax, scale denominator) and
    MXFP8 (codes, block scales) experts on load and, unable to quantize them again, saves them
    dequantized. Here the quantization companions are left to a quantizer (issue 29, the
    quantized-formats work, will decode them and write the same bytes back), so a file holding
    them reports them unexpected and its packed codes are refused by name, never dequantized into
    a layout a save would then write. Its own inverse: exact.

    Example:
        >>> import torch
        >>> w = torch.randn(2, 4, 3)
        >>> torch.equal(Inkling2LoopDequantizeExperts().convert([w], ops.OpContext())[0], w)
        True
    """

    def convert(self, slots: list[ops.Slot], ctx: ops.OpContext) -> list[ops.Slot]:
        t = _one(self, slots, ctx)
        if not t.is_floating_point() or t.element_size() < 2:
            raise _error(
                self,
                ctx,
                f"the experts are stored quantized ({t.dtype}, NVFP4 or MXFP8 codes); loading them needs the "
                "quantized-formats support (issue 29), which keeps their bytes for the save. Dequantize "
                "the checkpoint first, or load with transformers.",
            )
        return [t]

    @property
    def reverse_op(self) -> ops.ConversionOp:
        return self


# --------------------------------------------------------------------------- transformers >= 5.24

_UNEMBED: list[WeightTransform] = [
    WeightRenaming(r"model\.llm\.unembed\.", "lm_head."),
    WeightConverter(r"lm_head\.weight", "lm_head.weight", [Inkling2UnpadVocab()]),
]

_VISION: list[WeightTransform] = [
    WeightRenaming(r"model\.visual\.", "model.vision_tower."),
    WeightRenaming(r"vision_tower\.backbone\.embeddings\.", "vision_tower.embeddings."),
    WeightRenaming(
        r"vision_tower\.embeddings\.position_embedding$", "vision_tower.embeddings.position_embedding.weight"
    ),
    WeightRenaming(r"vision_tower\.backbone\.ln_pre\.", "vision_tower.pre_layernorm."),
    WeightRenaming(r"vision_tower\.backbone\.layers\.", "vision_tower.layers."),
    WeightRenaming(r"vision_tower\.proj_in\.", "vision_tower.merger.linear_1."),
    WeightRenaming(r"vision_tower\.proj_out\.", "vision_tower.merger.linear_2."),
    WeightRenaming(r"(vision_tower\.layers\.\d+)\.ln_1\.", r"\1.layernorm_before."),
    WeightRenaming(r"(vision_tower\.layers\.\d+)\.ln_2\.", r"\1.layernorm_after."),
    WeightRenaming(r"(vision_tower\.layers\.\d+)\.mlp\.c_fc\.", r"\1.mlp.fc1."),
    WeightRenaming(r"(vision_tower\.layers\.\d+)\.mlp\.c_proj\.", r"\1.mlp.fc2."),
    WeightRenaming(r"(vision_tower\.layers\.\d+)\.ls_1\.gamma", r"\1.lambda_1"),
    WeightRenaming(r"(vision_tower\.layers\.\d+)\.ls_2\.gamma", r"\1.lambda_2"),
]

_TEXT_HEAD: list[WeightTransform] = [
    WeightRenaming(r"model\.llm\.", "model."),
    WeightRenaming(r"embed\.weight", "embed_tokens.weight"),
    WeightRenaming(r"(?<!embed_tokens\.)embed_norm\.", "embed_tokens.embed_norm."),
]

_EXPERTS: list[WeightTransform] = [
    WeightConverter(r"mlp\.experts\.w13_weight", "mlp.experts.gate_up_proj", [ops.Interleave(dim=1)]),
    WeightConverter(
        r"mlp\.experts\.w13_weight_scale", "mlp.experts.gate_up_proj_scale_inv", [ops.Interleave(dim=1)]
    ),
    WeightRenaming(r"mlp\.experts\.w2_weight", "mlp.experts.down_proj"),
    WeightRenaming(r"mlp\.experts\.w2_weight_scale", "mlp.experts.down_proj_scale_inv"),
]

_LAYERS: list[WeightTransform] = [
    WeightRenaming(r"mlp\.gate\.bias", "mlp.gate.e_score_correction_bias"),
    WeightRenaming(r"\.attn\.", ".self_attn."),
    WeightRenaming(r"self_attn\.wq_du", "self_attn.q_proj.linear"),
    WeightRenaming(r"self_attn\.wk_dv", "self_attn.k_proj.linear"),
    WeightRenaming(r"self_attn\.wv_dv", "self_attn.v_proj.linear"),
    WeightRenaming(r"self_attn\.k_sconv\.", "self_attn.k_proj.sconv."),
    WeightRenaming(r"self_attn\.v_sconv\.", "self_attn.v_proj.sconv."),
    WeightRenaming(r"self_attn\.rel_logits_proj\.", "self_attn.relative_position_bias."),
    WeightRenaming(r"self_attn\.wr_du", "self_attn.relative_position_bias.linear"),
    WeightRenaming(r"self_attn\.q_l2_clip\.", "self_attn.q_proj.norm."),
    WeightRenaming(r"self_attn\.rel_l2_clip\.", "self_attn.relative_position_bias.norm."),
    WeightRenaming(r"self_attn\.wo_ud", "self_attn.o_proj.linear"),
    WeightRenaming(r"self_attn\.gate_attn", "self_attn.o_proj.gate_proj"),
    WeightRenaming(r"self_attn\.attn_sink_proj", "self_attn.sink_proj"),
    WeightRenaming(r"attn_sconv\.", "post_attention_convolution."),
    WeightRenaming(r"mlp_sconv\.", "post_mlp_convolution."),
    WeightRenaming(r"(convolution|sconv)\.weight(?!_)", r"\1.conv1d.weight"),
    WeightRenaming(r"(convolution|sconv)\.static_w", r"\1.static_weight"),
    WeightRenaming(r"(convolution|sconv)\.weight_proj$", r"\1.weight_proj.weight"),
    WeightRenaming("mlp_norm", "post_attention_layernorm"),
    WeightRenaming("attn_norm", "input_layernorm"),
    WeightRenaming("(q|k|v)_input_norm", r"\1_input_layernorm"),
    IndexOffsetRenaming(r"attn_res\.attn_queries\.(\d+)", r"layers.\1.attention_input.query", offset=1),
    WeightRenaming(r"attn_res\.mlp_queries\.(\d+)", r"layers.\1.mlp_input.query"),
    WeightRenaming(r"attn_res\.output_query", "final_input.query"),
]

_LOOP: list[WeightTransform] = [
    WeightRenaming(r"controllers\.attn\.", "q_message_gate."),
    WeightRenaming(r"controllers\.k\.", "k_message_gate."),
    WeightRenaming(r"controllers\.v\.", "v_message_gate."),
    WeightRenaming(r"controllers\.mlp\.", "mlp_message_gate."),
    WeightRenaming(r"_message_gate\.down_weight", "_message_gate.down_proj.weight"),
    WeightRenaming(r"_message_gate\.gain_weight", "_message_gate.message_gate_proj.weight"),
    WeightRenaming(r"_message_gate\.forget_weight", "_message_gate.forget_gate_proj.weight"),
    WeightConverter(
        [r"middle_cycle_cross_pass_queries", r"middle_cycle_cross_pass_kv_queries"],
        "message_input.query",
        [Inkling2LoopMergeMessageQueries()],
    ),
    # transformers' converters also take the NVFP4/MXFP8 companions (QUANTIZED_COMPANIONS).
    WeightConverter(
        r"mlp\.experts\.w13_weight",
        "mlp.experts.gate_up_proj",
        [Inkling2LoopDequantizeExperts(), ops.Interleave(dim=1)],
    ),
    WeightConverter(r"mlp\.experts\.w2_weight", "mlp.experts.down_proj", [Inkling2LoopDequantizeExperts()]),
]

_INKLING2: list[WeightTransform] = [
    *_UNEMBED,
    WeightRenaming(r"model\.llm\.", "model.language_model."),
    *_VISION,
]

ENTRIES: dict[str, list[WeightTransform]] = {
    "inkling2": _INKLING2,
    "inkling2_text": [*_UNEMBED, *_TEXT_HEAD, *_EXPERTS, *_LAYERS],
    "inkling2_loop": list(_INKLING2),
    "inkling2_loop_text": [*_LOOP, *_UNEMBED, *_TEXT_HEAD, *_LAYERS],
}

ALIASES: dict[str, str] = {}

# --------------------------------------------------------------------------- transformers < 5.24

BEFORE: dict[str, Before] = {
    "inkling2": Before(
        "5.24.0",
        [
            WeightRenaming(r"model\.llm\.unembed\.weight", "lm_head.weight"),
            WeightRenaming(r"model\.llm\.", "model.language_model."),
            WeightRenaming(r"model\.visual\.backbone\.embeddings\.", "model.vision_tower.embeddings."),
            WeightRenaming(
                r"vision_tower\.embeddings\.position_embedding$",
                "vision_tower.embeddings.position_embedding.weight",
            ),
            WeightRenaming(r"model\.visual\.backbone\.ln_pre\.", "model.vision_tower.pre_layernorm."),
            WeightRenaming(r"model\.visual\.backbone\.layers\.", "model.vision_tower.layers."),
            WeightRenaming(r"model\.visual\.proj_in\.", "model.vision_tower.merger.linear_1."),
            WeightRenaming(r"model\.visual\.proj_out\.", "model.vision_tower.merger.linear_2."),
            WeightRenaming(r"(vision_tower\.layers\.\d+)\.ln_1\.", r"\1.layernorm_before."),
            WeightRenaming(r"(vision_tower\.layers\.\d+)\.ln_2\.", r"\1.layernorm_after."),
            WeightRenaming(r"(vision_tower\.layers\.\d+)\.mlp\.c_fc\.", r"\1.mlp.fc1."),
            WeightRenaming(r"(vision_tower\.layers\.\d+)\.mlp\.c_proj\.", r"\1.mlp.fc2."),
            WeightRenaming(r"(vision_tower\.layers\.\d+)\.ls_1\.gamma", r"\1.lambda_1"),
            WeightRenaming(r"(vision_tower\.layers\.\d+)\.ls_2\.gamma", r"\1.lambda_2"),
        ],
    ),
    "inkling2_text": Before(
        "5.24.0",
        [
            WeightRenaming(r"model\.llm\.unembed\.weight", "lm_head.weight"),
            WeightRenaming(r"model\.llm\.", "model."),
            WeightRenaming(r"embed\.weight", "embed_tokens.weight"),
            WeightRenaming(r"(?<!embed_tokens\.)embed_norm\.", "embed_tokens.embed_norm."),
            WeightConverter(r"mlp\.experts\.w13_weight", "mlp.experts.gate_up_proj", [ops.Interleave(dim=1)]),
            WeightConverter(
                r"mlp\.experts\.w13_weight_scale",
                "mlp.experts.gate_up_proj_scale_inv",
                [ops.Interleave(dim=1)],
            ),
            WeightRenaming(r"mlp\.experts\.w2_weight", "mlp.experts.down_proj"),
            WeightRenaming(r"mlp\.experts\.w2_weight_scale", "mlp.experts.down_proj_scale_inv"),
            WeightRenaming(r"mlp\.gate\.bias", "mlp.gate.e_score_correction_bias"),
            WeightRenaming(r"attn\.wq_du", "self_attn.q_proj"),
            WeightRenaming(r"attn\.wk_dv", "self_attn.k_proj"),
            WeightRenaming(r"attn\.wv_dv", "self_attn.v_proj"),
            WeightRenaming(r"attn\.wr_du", "self_attn.r_proj"),
            WeightRenaming(r"attn\.wo_ud", "self_attn.o_proj"),
            WeightRenaming(r"attn\.gate_attn", "self_attn.gate_proj"),
            WeightRenaming(r"attn\.attn_sink_proj", "self_attn.sink_proj"),
            WeightRenaming(
                r"\.attn\.(q_l2_clip|k_l2_clip|rel_l2_clip|k_sconv|v_sconv|rel_logits_proj)\.",
                r".self_attn.\1.",
            ),
            WeightRenaming(r"attn_sconv\.", "post_attention_convolution."),
            WeightRenaming(r"mlp_sconv\.", "post_mlp_convolution."),
            WeightRenaming(r"(convolution|sconv)\.weight(?!_)", r"\1.conv1d.weight"),
            WeightRenaming(r"(convolution|sconv)\.static_w", r"\1.static_weight"),
            WeightRenaming(r"(convolution|sconv)\.weight_proj$", r"\1.weight_proj.weight"),
            WeightRenaming("mlp_norm", "post_attention_layernorm"),
            WeightRenaming("attn_norm", "input_layernorm"),
            WeightRenaming("(q|k|v)_input_norm", r"\1_input_layernorm"),
            IndexOffsetRenaming(
                r"attn_res\.attn_queries\.(\d+)", r"layers.\1.attention_input.query", offset=1
            ),
            WeightRenaming(r"attn_res\.mlp_queries\.(\d+)", r"layers.\1.mlp_input.query"),
            WeightRenaming(r"attn_res\.output_query", "final_input.query"),
        ],
    ),
}
"""Key -> the list for the classes of transformers before 5.24 (their attention projections are
plain ``nn.Linear`` children of the attention, and the unembedding keeps the padded rows)."""

ADAPTED_PATTERNS: dict[str, dict[str, str]] = {
    key: {
        # The targets contain the sources: they skip names already renamed (transformers falls back
        # to the original key there, surgery never does).
        r"embed_norm\.": r"(?<!embed_tokens\.)embed_norm\.",
        r"(convolution|sconv)\.weight_proj": r"(convolution|sconv)\.weight_proj$",
        # The bare parameter only: its renamed ``position_embedding.weight`` starts with the source.
        r"vision_tower\.embeddings\.position_embedding": r"vision_tower\.embeddings\.position_embedding$",
    }
    for key in ("inkling2", "inkling2_text", "inkling2_loop", "inkling2_loop_text")
}
"""Key -> {transformers' source pattern: ours}, where ours deliberately differs."""

QUANTIZED_COMPANIONS: dict[str, list[str]] = {
    "inkling2_loop_text": [
        rf"mlp\.experts\.{w}_weight_{part}"
        for w in ("w13", "w2")
        for part in ("scale", "amax", "outer_scale_denominator")
    ],
}
"""Key -> source patterns of transformers' converters that read quantization companions (block
scales, amax): left to a quantizer (issue 29); a file holding them reports them unexpected."""
