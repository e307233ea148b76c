"""Small pure-torch example models for tests, the demo and benchmarks.

* ``dense``: a Llama-style decoder whose runtime layout fuses ``gate_up_proj``.
* ``decoder``: a plain Llama-style decoder (separate q/k/v and gate/up: the sibling fusions' example).
* ``moe``: a Mixtral-style mixture-of-experts decoder in the fused-experts runtime layout.
* ``vision``: a Qwen2-VL-shaped vision tower (Conv3d patch embedding + transformer blocks).
* ``layers``: the blocks the decoders share (RMSNorm, grouped-query attention, the decoder stack).
"""

from .decoder import ExampleDecoderConfig, ExampleDecoderForCausalLM, build_decoder_model
from .dense import ExampleDenseConfig, ExampleDenseForCausalLM, build_dense_model
from .moe import ExampleMoEConfig, ExampleMoEForCausalLM, build_moe_model, original_state_dict
from .vision import ExampleVisionConfig, ExampleVisionTower, build_vision_tower, example_pixel_values

__all__ = [
    "ExampleDecoderConfig",
    "ExampleDecoderForCausalLM",
    "ExampleDenseConfig",
    "ExampleDenseForCausalLM",
    "ExampleMoEConfig",
    "ExampleMoEForCausalLM",
    "ExampleVisionConfig",
    "ExampleVisionTower",
    "build_decoder_model",
    "build_dense_model",
    "build_moe_model",
    "build_vision_tower",
    "example_pixel_values",
    "original_state_dict",
]
