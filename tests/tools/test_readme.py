"""The README's "Using it" example runs as written (on the CPU, or wherever the suite runs)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[2] / "README.md"


def _using_it() -> str:
    text = README.read_text()
    section = text[text.index("## Using it\n") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"'Using it' should hold one python block, found {len(blocks)}"
    return blocks[0]


def test_using_it_runs_as_written():
    code = _using_it()
    assert "mok.MoELayer(" in code and "mok.moe(" in code and "mok.forward(" in code
    exec(compile(code, f"{README}:Using it", "exec"), {"__name__": "readme_example"})
