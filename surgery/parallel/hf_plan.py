"""transformers' tensor-parallel style names, translated to this package's styles.

A transformers model declares its plan (``model.tp_plan``, built from the config's
``base_model_tp_plan`` and the class's ``_tp_plan``) in transformers' own vocabulary.
:func:`translate_hf_plan` turns such a plan into one :func:`~surgery.parallel.resolve_tp_plan`
accepts: each name maps to a style with the same parameter placements and forward results, or is
refused with a :class:`~surgery.ConfigurationError` naming the style and what to use instead.

=================================  ===================  ==============================================
transformers                       here                 semantics
=================================  ===================  ==============================================
``colwise``                        ``colwise``          weight/bias ``Shard(0)``, output stays sharded
``rowwise``                        ``rowwise``          weight ``Shard(1)``, output all-reduced
``colwise_gather_output``          ``colwise_gather``   ``Shard(0)``, output gathered (``lm_head``)
``embedding_rowwise``              ``rowwise``          vocab rows ``Shard(0)``, output all-reduced
``packed_colwise`` (Linear)        ``packed_colwise``   fused equal parts, ``_StridedShard(0, 2)``
``moe_tp_experts`` with            ``experts``          ``gate_up_proj (E, 2I, H)`` ``_StridedShard(1, 2)``,
``.gate_up_proj: packed_colwise``                       ``down_proj (E, H, I)`` ``Shard(2)``, output
``.down_proj: rowwise``                                 all-reduced
``replicate``                      ``replicate``        parameters whole on every rank
``replicated_with_grad_allreduce`` ``replicate``        whole on every rank (their gradient hook is for
                                                        sequence-parallel training; the forward is equal)
``sequence_parallel``              ``replicate``        a norm's weight whole; activations stay whole
                                                        here (no sequence sharding), the results equal
=================================  ===================  ==============================================

Expert parallelism: ``ep_dispatch_experts`` on an experts module is ``expert_parallel`` (whole
experts per rank, ``Shard(0)``), and the ``grouped_gemm`` entries of its parameters fold into it,
so a transformers ``base_model_ep_plan`` translates whole; ``grouped_gemm`` alone is refused.
Refused, each with the reason in :data:`REFUSED`, are also the names whose module
behaviour has no equal style here (``colwise_rep``, ``rowwise_rep``, ``rowwise_split_input``,
``packed_rowwise``, ``embedding_colwise``, ``local_params``, ``all_reduce``, ``mla_kv_a_proj``,
``moe_identity_expert``).

Example:
    >>> plan = {"lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise",
    ...         "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    ...         "model.layers.*.mlp.experts.down_proj": "rowwise",
    ...         "model.layers.*.mlp.experts": "moe_tp_experts"}
    >>> translate_hf_plan(plan)
    {'lm_head': 'colwise_gather', 'model.embed_tokens': 'rowwise', 'model.layers.*.mlp.experts': 'experts'}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigurationError

__all__ = ["HF_STYLES", "REFUSED", "translate_hf_plan"]

HF_STYLES: Mapping[str, str] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",
    "embedding_rowwise": "rowwise",
    "packed_colwise": "packed_colwise",
    "moe_tp_experts": "experts",
    "ep_dispatch_experts": "expert_parallel",
    "replicate": "replicate",
    "replicated_with_grad_allreduce": "replicate",
    "sequence_parallel": "replicate",
}
"""transformers' style name → this package's style name (same placements, equal forward)."""

REFUSED: Mapping[str, str] = {
    "grouped_gemm": "it shards an expert parameter on the expert dim only under an 'ep_dispatch_experts' module; "
    "use 'ep_dispatch_experts' on the experts module (this package's 'expert_parallel')",
    "colwise_rep": "its replicated-output layout has no equal style here; use 'colwise_gather'",
    "rowwise_rep": "its replicated-input layout has no equal style here; use 'rowwise'",
    "rowwise_split_input": "it splits a whole input inside the module; use 'rowwise' after a colwise module",
    "packed_rowwise": "a packed row-parallel split has no style here; keep the module 'replicate'",
    "embedding_colwise": "its gathered-output embedding has no equal style here; use 'rowwise' (vocab rows)",
    "local_params": "its local (non-DTensor) parameters have no style here; keep the module 'replicate'",
    "all_reduce": "an output all-reduce without sharding has no style here; keep the module 'replicate'",
    "mla_kv_a_proj": "the MLA kv_a split has no style here; keep the module 'replicate'",
    "moe_identity_expert": "identity experts have no style here; keep the module 'replicate'",
}
"""transformers' style names refused, with why and what to use instead."""

_EXPERT_PARTS = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}


def translate_hf_plan(plan: Mapping[str, Any]) -> dict[str, Any]:
    """``plan`` with transformers' style names replaced by this package's (see the module table).

    Names this package already uses with the same meaning, and ``ParallelStyle`` instances, pass
    through. The parameter entries ``X.gate_up_proj`` / ``X.down_proj`` of a ``X: moe_tp_experts``
    module fold into ``X: experts``; the ``grouped_gemm`` entries of a ``X: ep_dispatch_experts``
    module (transformers' ``base_model_ep_plan``) fold into ``X: expert_parallel``.

    Raises:
        ConfigurationError: a refused name (naming the key, the style and what to use instead), or
            expert parameter entries that do not match what ``moe_tp_experts`` shards.
    """
    experts = {k for k, v in plan.items() if v == "moe_tp_experts"}
    dispatched = {k for k, v in plan.items() if v == "ep_dispatch_experts"}
    out: dict[str, Any] = {}
    for key, style in plan.items():
        if style == "grouped_gemm" and key.rpartition(".")[0] in dispatched:
            continue  # the expert_parallel style shards the module's experts on their expert dim
        if isinstance(style, str) and style in REFUSED:
            raise ConfigurationError(
                f"tp_plan[{key!r}] = {style!r} (a transformers style) is refused: {REFUSED[style]}; or pass "
                "tp_plan as a dict of your own."
            )
        parent, _, leaf = key.rpartition(".")
        if parent in experts and leaf in _EXPERT_PARTS:
            if style != _EXPERT_PARTS[leaf]:
                raise ConfigurationError(
                    f"tp_plan[{key!r}] = {style!r}: under {parent!r} = 'moe_tp_experts' the 'experts' style "
                    f"shards {leaf} as {_EXPERT_PARTS[leaf]!r}; give the plan entry that, or a plan of your own."
                )
            continue
        out[key] = HF_STYLES.get(style, style) if isinstance(style, str) else style
    return out
