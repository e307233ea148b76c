"""Helpers shared by the test modules, as fixtures."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from surgery.checkpoint import write_checkpoint
from surgery.examples.moe import ExampleMoEConfig, build_moe_model, original_state_dict
from surgery.fusion import fusion_registry_snapshot

WriteOriginal = Callable[..., dict[str, torch.Tensor]]


@pytest.fixture
def isolated_fusion_registry() -> Iterator[None]:
    """Fusions registered by a test are gone after it (the built-in catalog provides patch_embeddings)."""
    with fusion_registry_snapshot():
        yield


def _write_original(
    path: Path, *, dtype: torch.dtype | None = None, **edits: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    sd = original_state_dict(build_moe_model(ExampleMoEConfig(), seed=0, dtype=dtype))
    for key, value in edits.items():
        key = key.replace("__", ".")
        if value is None:
            del sd[key]
        else:
            sd[key] = value
    write_checkpoint(sd, path)
    return sd


@pytest.fixture
def write_original() -> WriteOriginal:
    """``write_original(path, *, dtype=None, **edits)``: the example MoE's per-expert checkpoint.

    ``edits`` replace keys (``None`` drops one; ``__`` stands for ``.`` in the keyword name).
    Returns the state dict written.
    """
    return _write_original
