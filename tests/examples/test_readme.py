"""The README's Python examples run as written (each ```python block, in order)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> dict[str, str]:
    """The README's ```python blocks, keyed by the heading of the section each is in."""
    blocks, heading = {}, None
    for part in re.split(
        r"(^## [^\n]*$|^```python\n.*?^```$)", README.read_text(), flags=re.M | re.S
    ):
        if part.startswith("## "):
            heading = part[3:].strip()
        elif part.startswith("```python"):
            blocks[heading] = part.removeprefix("```python\n").removesuffix("```")
    return blocks


def test_readme_has_both_examples():
    assert set(_python_blocks()) == {
        "Serving loop with `Engine`",
        "`paged_attention` in your own model",
    }


@pytest.mark.parametrize("section", sorted(_python_blocks()))
def test_readme_example_runs(section, capsys, monkeypatch):
    monkeypatch.chdir(README.parent)  # the examples use paths relative to the repository
    exec(compile(_python_blocks()[section], f"README.md: {section}", "exec"), {})
    out = capsys.readouterr().out
    if "Engine" in section:
        assert "prefix-cache hit rate" in out
        hit = int(re.search(r"prefix-cache hit rate (\d+)%", out)[1])
        assert hit > 0  # the second and third prompts find the system prompt cached
    else:
        # The text the README quotes below the example.
        assert "16 requests, 544 tokens, levels ['groups'], shared blocks 32" in out
        assert "16 requests, 16 tokens, levels ['global'], shared blocks 32" in out
