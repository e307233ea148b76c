"""A small vision tower in pure torch, shaped like Qwen2-VL's, for tests, the demo and benchmarks.

Input: flattened patches ``(num_patches, C*T*P*P)`` (the processor's layout). The patch
embedding views them as ``(-1, C, T, P, P)``, runs ``proj = Conv3d(C, D, kernel=(T, P, P),
stride=(T, P, P))`` and views the result as ``(-1, D)``; then ``depth`` pre-norm transformer
blocks (LayerNorm, fused-qkv attention over the whole token sequence, GELU MLP) and a final norm.
Its checkpoint layout is the original one (``patch_embed.proj.weight`` of shape
``(D, C, T, P, P)``), which the ``patch_embeddings`` fusion turns into
``patch_embed.linear_proj.weight`` of shape ``(D, C*T*P*P)``.

Example:
    >>> tower = build_vision_tower(depth=1, embed_dim=32)
    >>> tower(example_pixel_values(tower.config, num_patches=8)).shape
    torch.Size([8, 32])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigurationError

__all__ = [
    "ExamplePatchEmbed",
    "ExampleVisionAttention",
    "ExampleVisionBlock",
    "ExampleVisionConfig",
    "ExampleVisionMLP",
    "ExampleVisionTower",
    "build_vision_tower",
    "example_pixel_values",
]


@dataclass
class ExampleVisionConfig:
    """Hyper-parameters of :class:`ExampleVisionTower` (``model_type = "example_vision"``)."""

    model_type: str = "example_vision"
    in_channels: int = 3
    temporal_patch_size: int = 2
    patch_size: int = 14
    embed_dim: int = 32
    depth: int = 2
    num_heads: int = 4
    mlp_ratio: float = 4.0
    patch_bias: bool = True
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("in_channels", "temporal_patch_size", "patch_size", "embed_dim", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigurationError(
                    f"ExampleVisionConfig.{name} must be a positive integer, got {value!r}."
                )
        if not isinstance(self.depth, int) or self.depth < 0:
            raise ConfigurationError(
                f"ExampleVisionConfig.depth must be a non-negative integer, got {self.depth!r}."
            )
        if self.embed_dim % self.num_heads:
            raise ConfigurationError(
                f"ExampleVisionConfig: embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}; "
                "pick an embed_dim that is a multiple of num_heads."
            )

    @property
    def patch_volume(self) -> int:
        """Values per flattened patch: ``C * T * P * P``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


class ExamplePatchEmbed(nn.Module):
    """``view(-1, C, T, P, P) -> Conv3d(kernel == stride) -> view(-1, D)``."""

    def __init__(
        self,
        *,
        in_channels: int = 3,
        temporal_patch_size: int = 2,
        patch_size: int = 14,
        embed_dim: int = 32,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.temporal_patch_size = temporal_patch_size
        self.patch_size = patch_size
        self.embed_dim = embed_dim
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = self.proj.weight.dtype
        patches = hidden_states.view(
            -1, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size
        )
        return self.proj(patches.to(dtype=dtype)).view(-1, self.embed_dim)


class ExampleVisionAttention(nn.Module):
    """Multi-head self-attention over one token sequence ``(N, D)``, with a fused qkv projection."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, dim = x.shape
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
        q, k, v = qkv.unbind(0)  # each (heads, N, head_dim)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(0, 1).reshape(n, dim))


class ExampleVisionMLP(nn.Module):
    """``fc2(gelu(fc1(x)))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class ExampleVisionBlock(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: ExampleVisionConfig) -> None:
        super().__init__()
        dim = config.embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.attn = ExampleVisionAttention(dim, config.num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.mlp = ExampleVisionMLP(dim, int(dim * config.mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ExampleVisionTower(nn.Module):
    """Patch embedding, ``depth`` blocks, final norm: ``(N, C*T*P*P) -> (N, D)``."""

    def __init__(self, config: ExampleVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = ExamplePatchEmbed(
            in_channels=config.in_channels,
            temporal_patch_size=config.temporal_patch_size,
            patch_size=config.patch_size,
            embed_dim=config.embed_dim,
            bias=config.patch_bias,
        )
        self.blocks = nn.ModuleList(ExampleVisionBlock(config) for _ in range(config.depth))
        self.norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixel_values)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build_vision_tower(
    *,
    depth: int = 2,
    embed_dim: int = 32,
    num_heads: int = 4,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    in_channels: int = 3,
    bias: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> ExampleVisionTower:
    """A deterministic :class:`ExampleVisionTower` (same ``seed``, same weights; global RNG untouched).

    Args:
        depth: number of transformer blocks.
        embed_dim: ``D``, the patch embedding width (a multiple of ``num_heads``).
        num_heads: attention heads.
        patch_size / temporal_patch_size / in_channels: ``P``, ``T``, ``C``.
        bias: whether the patch embedding's Conv3d has a bias.
        seed: initialisation seed.
        dtype / device: where the parameters live.
    """
    config = ExampleVisionConfig(
        in_channels=in_channels,
        temporal_patch_size=temporal_patch_size,
        patch_size=patch_size,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        patch_bias=bias,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tower = ExampleVisionTower(config)
        for module in tower.modules():  # non-trivial norms, so tests notice a swapped weight
            if isinstance(module, nn.LayerNorm):
                nn.init.normal_(module.weight, 1.0, 0.1)
                nn.init.normal_(module.bias, 0.0, 0.1)
    return tower.to(device=device, dtype=dtype).eval()


def example_pixel_values(
    config: ExampleVisionConfig,
    *,
    num_patches: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Random flattened patches ``(num_patches, C*T*P*P)`` for a tower built from ``config``."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(num_patches, config.patch_volume, generator=gen)
    return values.to(device=device, dtype=dtype)
