r"""DINOv2: attention renames and the SwiGLU ``weights_in`` split into gate and up projections.

Original layout (hub checkpoints)::

    encoder.layer.N.attention.attention.query.weight   encoder.layer.N.attention.output.dense.weight
    encoder.layer.N.mlp.weights_in.weight   [2F, H]    encoder.layer.N.mlp.weights_in.bias   [2F]
    encoder.layer.N.mlp.weights_out.weight  [H, F]

Runtime layout::

    encoder.layer.N.attention.q_proj.weight            encoder.layer.N.attention.o_proj.weight
    encoder.layer.N.mlp.gate_proj.weight    [F, H]     (weights_in[:F])
    encoder.layer.N.mlp.up_proj.weight      [F, H]     (weights_in[F:])
    encoder.layer.N.mlp.down_proj.weight    [H, F]

Layer paths keep ``encoder.layer.N`` (unlike ViT). Configurations without SwiGLU keep
``mlp.fc1``/``mlp.fc2``, which no rule touches.
"""

from __future__ import annotations

from surgery import WeightConverter, WeightRenaming, ops
from surgery.transforms import WeightTransform

__all__ = ["ALIASES", "ENTRIES"]

_DINOV2: list[WeightTransform] = [
    WeightRenaming(r"attention\.attention\.query", "attention.q_proj"),
    WeightRenaming(r"attention\.attention\.key", "attention.k_proj"),
    WeightRenaming(r"attention\.attention\.value", "attention.v_proj"),
    WeightRenaming(r"attention\.output\.dense", "attention.o_proj"),
    WeightRenaming(r"mlp\.weights_out", "mlp.down_proj"),
    WeightConverter(
        r"mlp\.weights_in\.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [ops.Chunk(dim=0)]
    ),
    WeightConverter(r"mlp\.weights_in\.bias", ["mlp.gate_proj.bias", "mlp.up_proj.bias"], [ops.Chunk(dim=0)]),
]

ENTRIES: dict[str, list[WeightTransform]] = {
    "Dinov2Model": [*_DINOV2],
    "Dinov2WithRegistersModel": [*_DINOV2],
}
"""Registry key → transform list (unscoped prototypes; the registry hands out copies)."""

ALIASES: dict[str, str] = {
    "Dinov2Backbone": "Dinov2Model",
    "Dinov2WithRegistersBackbone": "Dinov2WithRegistersModel",
}
"""Registry key → the key whose mapping it shares."""
