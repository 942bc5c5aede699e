"""Every code sample of docs/passes.md runs (each block in a fresh namespace, in order)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "passes.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_page_has_samples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_sample_runs(i, capsys):
    exec(compile(BLOCKS[i], f"{DOC.name}[{i}]", "exec"), {"__name__": f"docs_passes_{i}"})
