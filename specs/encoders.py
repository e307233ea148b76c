r"""Encoders and embedding models: BERT-like (GTE, Jina v3, Nomic, Ultrabert), AltCLIP, ESM, T5Gemma2's encoder, TimesFM 2.5, JEV.

* GTE, Jina embeddings v3, Nomic BERT: ``encoder.layer(s)`` → ``layers``, fused ``Wqkv`` /
  ``qkv_proj`` chunked into q/k/v, fused ``up_gate_proj`` chunked (up first) or ``fc11``/``fc12``
  renamed, post-attention/post-MLP norms renamed. GTE's hub files name the base model ``new``
  (``new.*`` beside the head's ``lm_head.*``): renamed to ``gte.``, where transformers strips it
  (``RENAMED_PREFIXES``: stripped, its inverse wrote ``new.gte.*``, a layout no file has).
* Ultrabert: ``ultrabert.`` → ``model.`` in the heads, ``cls.`` → ``head.decoder.``; the base
  model drops ``ultrabert.`` (inside a head that ``PrefixChange`` is not inverted on save unless
  it fired: the head's renaming already places the keys).
* AltCLIP: ``layer.`` → ``layers.``; ESM: ``LayerNorm.gamma/beta`` and the rotary ``inv_freq``;
  T5Gemma2's encoder: the text model's names move under ``text_model.``; TimesFM 2.5:
  ``ff0``/``ff1`` → ``fc1``/``fc2``; JEV: ``weight`` → ``proj.weight``.
"""

from __future__ import annotations

from surgery import PrefixChange, WeightConverter, WeightRenaming, ops
from surgery.transforms import WeightTransform

__all__ = ["ALIASES", "ENTRIES", "RENAMED_PREFIXES"]

ENTRIES: dict[str, list[WeightTransform]] = {
    "altclip": [
        WeightRenaming(r"layer\.", "layers."),
    ],
    "esm": [
        WeightRenaming(
            r"encoder\.layer\.*\.attention\.self\.rotary_embeddings\.inv_freq", "rotary_embeddings.inv_freq"
        ),
        WeightRenaming(r"LayerNorm\.gamma", "LayerNorm.weight"),
        WeightRenaming(r"LayerNorm\.beta", "LayerNorm.bias"),
    ],
    "nomic_bert": [
        WeightRenaming(r"encoder\.layers", "layers"),
        WeightRenaming("emb_ln", "embeddings.LayerNorm"),
        WeightRenaming(r"attn\.out_proj", "self_attn.o_proj"),
        WeightRenaming("fc11", "up_proj"),
        WeightRenaming("fc12", "gate_proj"),
        WeightRenaming("fc2", "down_proj"),
        WeightRenaming("norm1", "post_attention_layernorm"),
        WeightRenaming("norm2", "post_mlp_layernorm"),
        WeightConverter(
            r"attn\.Wqkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], [ops.Chunk(dim=0)]
        ),
    ],
    "gte": [
        # transformers lists ``PrefixChange(prefix_to_remove="new")``: inverted, that adds ``new.`` to
        # every key of the head model (``new.gte.embeddings.*``, ``new.lm_head.*``), a layout no file
        # has. The hub files were written by the remote-code ``NewModel`` family, whose head models
        # hold the base model as ``self.new`` and the head beside it (``NewForMaskedLM``:
        # ``new.embeddings.*``, ``new.encoder.layer.*``, ``lm_head.*``; its tied-weights table names
        # ``new.embeddings.word_embeddings.weight``), and whose base model is saved bare. So ``new``
        # is the hub's name of the base model ``gte``: renamed, not stripped. A bare ``GteModel`` reads
        # ``new.*`` files through the base-model prefix (``gte.`` added, then stripped).
        # A file transformers wrote (``new.gte.*``, ``new.lm_head.*``: read as ``gte.gte.*`` and
        # ``gte.lm_head.*``, the base-model prefix stripped from every key) saves back exactly as
        # transformers wrote it, never half of each (``new.*`` beside ``new.lm_head.*``, which no
        # file holds): a loaded model saves what fired, so its own input comes back bit for bit and
        # both transformers releases reload it; the hub layout is what any other load (a hub file, a
        # runtime-layout file, none) saves. Tested in tests/interop/test_gte_hub_layout_interop.py.
        WeightRenaming(r"^new\.", "gte."),
        WeightRenaming(r"encoder\.layer", "layers"),
        WeightRenaming(r"attention\.o_proj", "self_attn.o_proj"),
        WeightRenaming("attn_ln", "post_attention_layernorm"),
        WeightRenaming("mlp_ln", "post_mlp_layernorm"),
        WeightRenaming(r"lm_head\.norm", "lm_head.layer_norm"),
        WeightConverter(
            r"attention\.qkv_proj",
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            [ops.Chunk(dim=0)],
        ),
        WeightConverter(r"mlp\.up_gate_proj", ["mlp.up_proj", "mlp.gate_proj"], [ops.Chunk(dim=0)]),
    ],
    "jina_embeddings_v3": [
        WeightRenaming("emb_ln", "embeddings.LayerNorm"),
        WeightRenaming(r"encoder\.layers", "layers"),
        WeightRenaming(r"mixer\.out_proj", "self_attn.o_proj"),
        WeightRenaming("norm1", "post_attention_layernorm"),
        WeightRenaming("norm2", "post_mlp_layernorm"),
        WeightConverter(
            r"mixer\.Wqkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], [ops.Chunk(dim=0)]
        ),
    ],
    "UltrabertModel": [
        PrefixChange(prefix_to_remove="ultrabert"),
    ],
    "UltrabertForMaskedLM": [
        WeightRenaming(r"^ultrabert\.", "model."),
        WeightRenaming(r"^cls\.", "head.decoder."),
    ],
    "UltrabertForSequenceClassification": [
        WeightRenaming(r"^ultrabert\.", "model."),
    ],
    "UltrabertForTokenClassification": [
        WeightRenaming(r"^ultrabert\.", "model."),
    ],
    "UltrabertForQuestionAnswering": [
        WeightRenaming(r"^ultrabert\.", "model."),
    ],
    "UltraVBertForMaskedLM": [
        WeightRenaming(r"^head\.decoder\.", "lm_head."),
        WeightRenaming(r"^head\.", "projection_head."),
    ],
    "t5gemma2_encoder": [
        WeightRenaming(r"(?<!decoder\.)(?<!text_model\.)embed_tokens\.", "text_model.embed_tokens."),
        WeightRenaming(r"(?<!decoder\.)(?<!text_model\.)(?<!layer)(?<!_)norm\.", "text_model.norm."),
        WeightRenaming(
            r"(?<!vision_model\.encoder\.)(?<!vision_tower\.encoder\.)(?<!decoder\.)(?<!text_model\.)layers\.",
            "text_model.layers.",
        ),
    ],
    "timesfm2_5": [
        WeightRenaming("ff0", "fc1"),
        WeightRenaming("ff1", "fc2"),
    ],
    "jev": [
        WeightRenaming("^weight", "proj.weight"),
    ],
}

ALIASES: dict[str, str] = {}

RENAMED_PREFIXES: dict[str, dict[str, str]] = {
    # key -> {prefix transformers' PrefixChange strips: the base-model prefix it is renamed to here}
    "gte": {"new": "gte"},
}
"""Where transformers strips a prefix that is the hub's name of the base model, and surgery renames it."""
