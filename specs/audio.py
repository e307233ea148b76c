r"""Speech and audio models: language models with an audio encoder, and the neural audio codecs.

Hub checkpoints of the audio-LLM families (``qwen2_audio`` and the five model types sharing its
layout, ``granite_speech``, ``vibevoice_asr``) keep the language model at the top level::

    language_model.model.X    language_model.lm_head.weight    audio_tower.X    multi_modal_projector.X

Runtime layout of ``*ForConditionalGeneration``::

    model.language_model.X    lm_head.weight                   model.audio_tower.X    model.multi_modal_projector.X

The base-model classes (``Qwen2AudioModel`` and its aliases, ``GraniteSpeechModel``,
``VibeVoiceAsrModel``) drop the inner ``model.`` of the language model. ``cohere_asr`` and
``nemo_speechlm`` rename NeMo module paths (pre-encode convolutions, transformer decoder,
diarization and timestamp heads); NeMo's fused MoE experts (``gate_and_up_projs``) are
transposed into the Nemotron-H experts. Mimi's encoder/decoder move their SEANet stacks
(``encoder.layers`` → ``encoder_seanet.layers``; the whole codec nests them under
``encoder.``/``decoder.``). ``gradium_phonon_tts`` renames its flow LM and flow head and splits
the fused ``in_proj`` of the attention into q/k/v, permuting q and k from interleaved RoPE pairs
(``PermuteForRope(..., slots=(0, 1))``: v is not permuted).

Inside NeMo's speech model both its own entry and the Nemotron-H entry of its language model
reverse onto the fused experts when saving: the converter that fired at load wins (a model
loaded from per-expert keys saves them again), else the whole model's, so a NeMo speech model
that was never loaded saves NeMo's fused ``gate_and_up_projs``. The save settles this before routing.
"""

from __future__ import annotations

from surgery import WeightConverter, WeightRenaming, ops
from surgery.transforms import WeightTransform

__all__ = ["ALIASES", "ENTRIES"]

ENTRIES: dict[str, list[WeightTransform]] = {
    "qwen2_audio": [
        WeightRenaming(r"^language_model\.lm_head", "lm_head"),
        WeightRenaming("^language_model", "model.language_model"),
        WeightRenaming("^audio_tower", "model.audio_tower"),
        WeightRenaming("^multi_modal_projector", "model.multi_modal_projector"),
    ],
    "Qwen2AudioModel": [
        WeightRenaming(r"^language_model\.model", "language_model"),
    ],
    "granite_speech": [
        WeightRenaming(r"^language_model\.lm_head", "lm_head"),
        WeightRenaming("^language_model", "model.language_model"),
        WeightRenaming("^encoder", "model.encoder"),
        WeightRenaming("^projector", "model.projector"),
    ],
    "GraniteSpeechModel": [
        WeightRenaming(r"^language_model\.model", "language_model"),
    ],
    "vibevoice_asr": [
        WeightRenaming(r"^language_model\.lm_head", "lm_head"),
        WeightRenaming("^language_model", "model.language_model"),
        WeightRenaming("^acoustic_tokenizer_encoder", "model.acoustic_tokenizer_encoder"),
        WeightRenaming("^semantic_tokenizer_encoder", "model.semantic_tokenizer_encoder"),
        WeightRenaming("^multi_modal_projector", "model.multi_modal_projector"),
    ],
    "VibeVoiceAsrModel": [
        WeightRenaming(r"^language_model\.model", "language_model"),
    ],
    "cohere_asr": [
        WeightRenaming(r"encoder\.pre_encode\.conv\.", "encoder.subsampling.layers."),
        WeightRenaming(r"encoder\.pre_encode\.out\.", "encoder.subsampling.linear."),
        WeightRenaming(r"transf_decoder\._embedding\.position_embedding\.pos_enc", "decoder.pos_emb.weight"),
        WeightRenaming(r"transf_decoder\._embedding\.token_embedding", "decoder.embed_tokens"),
        WeightRenaming(r"transf_decoder\._embedding\.layer_norm", "decoder.embedding_layernorm"),
        WeightRenaming(r"transf_decoder\._decoder\.final_layer_norm", "decoder.norm"),
        WeightRenaming(r"transf_decoder\._decoder\.layers", "decoder.layers"),
        WeightRenaming(r"encoder_decoder_proj\.", "decoder.proj."),
        WeightRenaming(r"encoder\.(.+)\.self_attn\.linear_q", r"encoder.\1.self_attn.q_proj"),
        WeightRenaming(r"encoder\.(.+)\.self_attn\.linear_k", r"encoder.\1.self_attn.k_proj"),
        WeightRenaming(r"encoder\.(.+)\.self_attn\.linear_v", r"encoder.\1.self_attn.v_proj"),
        WeightRenaming(r"encoder\.(.+)\.self_attn\.linear_out", r"encoder.\1.self_attn.o_proj"),
        WeightRenaming(r"encoder\.(.+)\.self_attn\.linear_pos", r"encoder.\1.self_attn.relative_k_proj"),
        WeightRenaming(r"encoder\.(.+)\.self_attn\.pos_bias_u", r"encoder.\1.self_attn.bias_u"),
        WeightRenaming(r"encoder\.(.+)\.self_attn\.pos_bias_v", r"encoder.\1.self_attn.bias_v"),
        WeightRenaming(r"decoder\.(.+)\.first_sub_layer\.query_net", r"decoder.\1.self_attn.q_proj"),
        WeightRenaming(r"decoder\.(.+)\.first_sub_layer\.key_net", r"decoder.\1.self_attn.k_proj"),
        WeightRenaming(r"decoder\.(.+)\.first_sub_layer\.value_net", r"decoder.\1.self_attn.v_proj"),
        WeightRenaming(r"decoder\.(.+)\.first_sub_layer\.out_projection", r"decoder.\1.self_attn.o_proj"),
        WeightRenaming(r"\.second_sub_layer\.query_net", ".encoder_attn.q_proj"),
        WeightRenaming(r"\.second_sub_layer\.key_net", ".encoder_attn.k_proj"),
        WeightRenaming(r"\.second_sub_layer\.value_net", ".encoder_attn.v_proj"),
        WeightRenaming(r"\.second_sub_layer\.out_projection", ".encoder_attn.o_proj"),
        WeightRenaming(r"\.third_sub_layer\.dense_in", ".mlp.fc1"),
        WeightRenaming(r"\.third_sub_layer\.dense_out", ".mlp.fc2"),
        WeightRenaming(r"\.layer_norm_1\.", ".input_layernorm."),
        WeightRenaming(r"\.layer_norm_2\.", ".post_attention_layernorm."),
        WeightRenaming(r"\.layer_norm_3\.", ".final_layernorm."),
        WeightRenaming(r"\.conv\.batch_norm", ".conv.norm"),
        WeightRenaming(r"log_softmax\.mlp\.layer0", "proj_out"),
    ],
    "MimiEncoderModel": [
        WeightRenaming(r"^encoder\.layers", "encoder_seanet.layers"),
    ],
    "MimiDecoderModel": [
        WeightRenaming(r"^decoder\.layers", "decoder_seanet.layers"),
    ],
    "MimiModel": [
        WeightRenaming(r"^encoder\.layers", "encoder.encoder.layers"),
        WeightRenaming(r"^encoder_transformer\.", "encoder.encoder_transformer."),
        WeightRenaming(r"^downsample\.", "encoder.downsample."),
        WeightRenaming(r"^upsample\.", "decoder.upsample."),
        WeightRenaming(r"^decoder_transformer\.", "decoder.decoder_transformer."),
        WeightRenaming(r"^decoder\.layers", "decoder.decoder.layers"),
    ],
    "gradium_phonon_tts": [
        WeightRenaming(
            r"^flow_lm\.condition_provider\.conditioners\.transcript_in_segment\.embed\.",
            "model.embed_tokens.",
        ),
        WeightRenaming(
            r"^flow_lm\.condition_provider\.conditioners\.speaker_wavs\.output_proj\.",
            "model.audio_prompt_proj.",
        ),
        WeightRenaming(
            r"^flow_lm\.condition_provider\.conditioners\.num_speakers\.embed\.", "model.num_speakers_embed."
        ),
        WeightRenaming(
            r"^flow_lm\.condition_provider\.conditioners\.num_speakers\.output_proj\.",
            "model.num_speakers_proj.",
        ),
        WeightRenaming(
            r"^flow_lm\.condition_provider\.conditioners\.duration_delta\.output_proj\.",
            "model.duration_delta_proj.",
        ),
        WeightRenaming(r"^flow_lm\.input_linear\.", "model.audio_latent_proj."),
        WeightRenaming(r"^flow_lm\.bos_emb", "model.bos_latent"),
        WeightRenaming(r"^flow_lm\.emb_mean", "latent_mean"),
        WeightRenaming(r"^flow_lm\.emb_std", "latent_std"),
        WeightRenaming(r"^flow_lm\.out_norm\.", "model.norm."),
        WeightRenaming(r"^flow_lm\.out_eos\.", "eos_head."),
        WeightRenaming(
            r"^flow_lm\.transformer\.layers\.(\d+)\.self_attn\.in_proj\.",
            r"model.layers.\1.self_attn.in_proj.",
        ),
        WeightRenaming(
            r"^flow_lm\.transformer\.layers\.(\d+)\.self_attn\.out_proj\.",
            r"model.layers.\1.self_attn.o_proj.",
        ),
        WeightRenaming(r"^flow_lm\.transformer\.layers\.(\d+)\.linear1\.", r"model.layers.\1.mlp.fc1."),
        WeightRenaming(r"^flow_lm\.transformer\.layers\.(\d+)\.linear2\.", r"model.layers.\1.mlp.fc2."),
        WeightRenaming(r"^flow_lm\.transformer\.layers\.(\d+)\.norm1\.", r"model.layers.\1.input_layernorm."),
        WeightRenaming(
            r"^flow_lm\.transformer\.layers\.(\d+)\.norm2\.", r"model.layers.\1.post_attention_layernorm."
        ),
        WeightRenaming(
            r"^flow_lm\.flow_net\.time_embed\.(\d+)\.freqs", r"flow_head.timestep_embeddings.\1.freqs"
        ),
        WeightRenaming(
            r"^flow_lm\.flow_net\.time_embed\.(\d+)\.mlp\.0\.", r"flow_head.timestep_embeddings.\1.fc1."
        ),
        WeightRenaming(
            r"^flow_lm\.flow_net\.time_embed\.(\d+)\.mlp\.2\.", r"flow_head.timestep_embeddings.\1.fc2."
        ),
        WeightRenaming(
            r"^flow_lm\.flow_net\.time_embed\.(\d+)\.mlp\.3\.alpha",
            r"flow_head.timestep_embeddings.\1.norm.weight",
        ),
        WeightRenaming(r"^flow_lm\.flow_net\.cond_embed\.", "flow_head.cond_proj."),
        WeightRenaming(r"^flow_lm\.flow_net\.input_proj\.", "flow_head.input_proj."),
        WeightRenaming(r"^flow_lm\.flow_net\.res_blocks\.(\d+)\.in_ln\.", r"flow_head.layers.\1.norm."),
        WeightRenaming(r"^flow_lm\.flow_net\.res_blocks\.(\d+)\.mlp\.0\.", r"flow_head.layers.\1.fc1."),
        WeightRenaming(r"^flow_lm\.flow_net\.res_blocks\.(\d+)\.mlp\.2\.", r"flow_head.layers.\1.fc2."),
        WeightRenaming(
            r"^flow_lm\.flow_net\.res_blocks\.(\d+)\.adaLN_modulation\.1\.",
            r"flow_head.layers.\1.adaln_proj.",
        ),
        WeightRenaming(r"^flow_lm\.flow_net\.final_layer\.linear\.", "flow_head.final_layer.proj."),
        WeightRenaming(
            r"^flow_lm\.flow_net\.final_layer\.adaLN_modulation\.1\.", "flow_head.final_layer.adaln_proj."
        ),
        WeightConverter(
            r"self_attn\.in_proj\.weight",
            ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
            [ops.Chunk(dim=0), ops.PermuteForRope(config_attribute="num_attention_heads", slots=(0, 1))],
        ),
    ],
    "nemo_speechlm": [
        WeightRenaming(r"^perception\.encoder\.asr_encoder\.", "model.audio_tower.asr_encoder."),
        WeightRenaming(
            r"^perception\.encoder\.diarization_model\.encoder\.",
            "model.audio_tower.diarization_model.model.audio_tower.",
        ),
        WeightRenaming(r"^ctc_timestamp\.decoder\.transformer\.", "model.word_timestamp_encoder."),
        WeightRenaming(r"^ctc_timestamp\.decoder\.upsample\.", "model.word_timestamp_encoder.upsampler."),
        WeightRenaming(r"^ctc_timestamp\.decoder\.decoder_layers\.0\.", "word_timestamp_head."),
        WeightRenaming(
            r"^perception\.encoder\.diarization_model\.sortformer_modules\.encoder_proj\.",
            "model.audio_tower.diarization_model.model.proj.",
        ),
        WeightRenaming(
            r"^perception\.encoder\.diarization_model\.sortformer_modules\.subpixel_upsample\.",
            "model.audio_tower.diarization_model.model.upsampler.conv.",
        ),
        WeightRenaming(
            r"^perception\.encoder\.diarization_model\.sortformer_modules\.first_hidden_to_hidden\.",
            "model.audio_tower.diarization_model.classifier.dense.",
        ),
        WeightRenaming(
            r"^perception\.encoder\.diarization_model\.sortformer_modules\.single_hidden_to_spks\.",
            "model.audio_tower.diarization_model.classifier.out_proj.",
        ),
        WeightRenaming(
            r"^perception\.encoder\.diarization_model\.sortformer_modules\.learnable_sil_emb",
            "model.audio_tower.diarization_model.silence_embeds",
        ),
        WeightRenaming(r"^perception\.encoder\.asr_norm\.", "model.audio_tower.asr_norm."),
        WeightRenaming(r"^perception\.encoder\.diar_norm\.", "model.audio_tower.speaker_norm."),
        WeightRenaming(r"^perception\.proj\.", "model.multi_modal_projector."),
        WeightRenaming(r"^llm\.model\.embed_tokens\.", "model.language_model.embeddings."),
        WeightRenaming(r"^llm\.model\.norm\.", "model.language_model.norm_f."),
        WeightRenaming(r"^llm\.model\.layers\.", "model.language_model.layers."),
        WeightRenaming(r"^llm\.lm_head\.", "lm_head."),
        WeightRenaming(r"\.pre_encode\.proj\.", ".embedder.projection."),
        WeightRenaming(r"\.embed_norm\.", ".input_layer_norm."),
        WeightRenaming(r"\.final_norm\.", ".layer_norm."),
        WeightRenaming(r"\.norm1\.", ".layer_norm1."),
        WeightRenaming(r"\.norm2\.", ".layer_norm2."),
        WeightRenaming(r"\.attn\.out_proj\.", ".self_attn.o_proj."),
        WeightRenaming(r"\.attn\.q_norm\.", ".self_attn.q_norm."),
        WeightRenaming(r"\.attn\.k_norm\.", ".self_attn.k_norm."),
        WeightRenaming(r"\.ffn\.net\.0\.", ".mlp.fc1."),
        WeightRenaming(r"\.ffn\.net\.3\.", ".mlp.fc2."),
        WeightRenaming(r"\.mixer\._fp32_params\.A_log", ".mixer.A_log"),
        WeightRenaming(r"\.mixer\._fp32_params\.D", ".mixer.D"),
        WeightRenaming(r"\.mixer\._fp32_params\.dt_bias", ".mixer.dt_bias"),
        WeightConverter(
            r"\.attn\.w_qkv\.weight",
            [".self_attn.q_proj.weight", ".self_attn.k_proj.weight", ".self_attn.v_proj.weight"],
            [ops.Chunk(dim=0)],
        ),
        WeightConverter(
            r"\.mixer\.experts\.gate_and_up_projs", ".mixer.experts.up_proj", [ops.Transpose(dim0=1, dim1=2)]
        ),
        WeightConverter(
            r"\.mixer\.experts\.down_projs", ".mixer.experts.down_proj", [ops.Transpose(dim0=1, dim1=2)]
        ),
    ],
}

ALIASES: dict[str, str] = {
    "voxtral": "qwen2_audio",
    "voxtral_realtime": "qwen2_audio",
    "audioflamingo3": "qwen2_audio",
    "glmasr": "qwen2_audio",
    "musicflamingo": "qwen2_audio",
    "VoxtralModel": "Qwen2AudioModel",
    "VoxtralRealtimeModel": "Qwen2AudioModel",
    "AudioFlamingo3Model": "Qwen2AudioModel",
    "GlmAsrModel": "Qwen2AudioModel",
    "MusicFlamingoModel": "Qwen2AudioModel",
    "granite_speech_plus": "granite_speech",
    "GraniteSpeechPlusModel": "GraniteSpeechModel",
}
