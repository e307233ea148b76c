"""The README's and docs' Python snippets run, so they cannot rot."""

from __future__ import annotations

import re
import subprocess
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


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_opens_with_the_demo_and_the_test_commands() -> None:
    commands = _readme_commands()
    assert "surgery demo" in commands[0]
    assert "python -m pytest" in commands[1]
    assert 'pip install -e ".[test,interop]"' in commands[1]


def test_ci_runs_the_readme_test_command_as_written(tmp_path: Path) -> None:
    """.ci/run takes the README's second bash block and runs it: the awk it uses extracts exactly it."""
    ci = (ROOT / ".ci" / "run").read_text()
    extract = re.search(r"readme_test=\$\((awk .*? README\.md)\)", ci)
    assert extract is not None, "CI must read the test command from README.md"
    assert 'bash -euo pipefail -c "$readme_test"' in ci
    got = subprocess.run(
        ["bash", "-c", extract.group(1)], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert got.stdout.strip() == _readme_commands()[1].strip()
    pinned_in_ci = re.findall(r"pip install[^\n]*==", ci)
    assert not pinned_in_ci, "CI installs nothing pinned that the README's command does not"


def test_the_interop_extra_pins_the_release_the_catalog_is_measured_against() -> None:
    """A fresh machine running the README gets the transformers the catalog and its tests are written for."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    interop = re.search(r"^interop = \[(.*?)\]", pyproject, re.M)
    assert interop is not None
    pinned = re.search(r'^PINNED = "(.+)"', (ROOT / "specs" / "releases.py").read_text(), re.M)
    assert pinned is not None
    assert interop.group(1) == f'"transformers=={pinned.group(1)}"'


def _architecture_map() -> str:
    text = (ROOT / "docs" / "concepts.md").read_text()
    return text.split("## Architecture", 1)[1].split("```", 2)[1]


def test_the_architecture_map_names_every_module_and_nothing_else() -> None:
    block = _architecture_map()
    package = ROOT / "surgery"
    for path in package.glob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            assert f"{path.name}" in block, path.name
    for sub in ("checkpoint", "load", "save", "parallel"):
        for path in (package / sub).glob("*.py"):
            if path.stem != "__init__":
                assert path.name in block, f"{sub}/{path.name}"
    for folder in ("checkpoint", "load", "save", "parallel", "fusion", "examples", "bench"):
        assert f"{folder}/" in block, folder
    named = set(re.findall(r"\b(\w+\.py)\b", block))
    existing = {p.name for p in package.rglob("*.py")}
    assert named <= existing, sorted(named - existing)
