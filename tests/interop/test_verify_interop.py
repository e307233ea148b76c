"""Interop: ``surgery.verify`` passes a catalog sample saved by transformers (hub layout)."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from tiny import build, candidates  # noqa: E402

import surgery  # noqa: E402

pytestmark = pytest.mark.interop


@pytest.mark.parametrize("key", ["mixtral", "qwen2_moe"])
def test_a_transformers_checkpoint_of_a_catalog_family_round_trips_identically(
    key: str, tmp_path: Path
) -> None:
    (candidate,) = candidates(key)
    build(candidate, seed=0).save_pretrained(tmp_path)
    card = surgery.verify(lambda: build(candidate, seed=1), tmp_path)
    assert card.ok, card.render()
    assert card.tensors and {t.verdict for t in card.tensors} == {"identical"}
    assert card.versions["transformers"] == transformers.__version__
