"""docs/catalog.md is what docs/make_catalog.py generates from the registry and a measured round trip."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("make_catalog", ROOT / "docs" / "make_catalog.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_catalog_doc_is_generated_from_the_registry(round_trips) -> None:
    gen = _generator()
    if transformers.__version__ not in (gen.PINNED, gen.NEWEST):
        pytest.skip(f"docs/catalog.md is counted against transformers {gen.PINNED} and {gen.NEWEST}")
    # Under either release: its own block is regenerated, the rest of the page must be unchanged.
    assert (ROOT / "docs" / "catalog.md").read_text() == gen.render(round_trips), (
        "stale: run python docs/make_catalog.py"
    )
