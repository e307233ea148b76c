"""Small pure-torch example models for tests, the demo and benchmarks.

* ``moe``: a Mixtral-style mixture-of-experts decoder in the fused-experts runtime layout.
* ``vision``: a Qwen2-VL-shaped vision tower (Conv3d patch embedding + transformer blocks).
"""

from .moe import ExampleMoEConfig, ExampleMoEForCausalLM, build_moe_model, original_state_dict
from .vision import ExampleVisionConfig, ExampleVisionTower, build_vision_tower, example_pixel_values

__all__ = [
    "ExampleMoEConfig",
    "ExampleMoEForCausalLM",
    "ExampleVisionConfig",
    "ExampleVisionTower",
    "build_moe_model",
    "build_vision_tower",
    "example_pixel_values",
    "original_state_dict",
]
