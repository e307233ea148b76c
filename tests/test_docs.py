"""The README's and docs' Python snippets run, so they cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _snippets() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for i, code in enumerate(_BLOCK.findall(path.read_text())):
            out.append((f"{path.name}#{i}", code))
    return out


@pytest.mark.parametrize("code", [c for _, c in _snippets()], ids=[n for n, _ in _snippets()])
def test_documented_snippet_runs(code: str, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(code, "<doc snippet>", "exec"), {"__name__": "__doc_snippet__"})


def test_readme_opens_with_the_demo_and_the_test_commands() -> None:
    text = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert "surgery demo" in commands[0]
    assert "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest" in ci


def _architecture_map() -> str:
    text = (ROOT / "docs" / "concepts.md").read_text()
    return text.split("## Architecture", 1)[1].split("```", 2)[1]


def test_the_architecture_map_names_every_module_and_nothing_else() -> None:
    block = _architecture_map()
    package = ROOT / "surgery"
    for path in package.glob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            assert f"{path.name}" in block, path.name
    for sub in ("checkpoint", "load"):
        for path in (package / sub).glob("*.py"):
            if path.stem != "__init__":
                assert path.name in block, f"{sub}/{path.name}"
    for folder in ("checkpoint", "load", "fusion", "examples", "bench"):
        assert f"{folder}/" in block, folder
    named = set(re.findall(r"\b(\w+\.py)\b", block))
    existing = {p.name for p in package.rglob("*.py")}
    assert named <= existing, sorted(named - existing)
