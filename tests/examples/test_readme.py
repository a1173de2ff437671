"""The README's Python examples run as written (each ```python block, in order)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sharding.host_devices import host_device_env

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


@pytest.mark.slow
def test_readme_several_devices_example_runs():
    """The ```py block continues the Engine example on 8 devices: both run, in that order,
    in a process of their own on 8 CPU host devices (JAX fixes the count when it starts)."""
    (devices,) = re.findall(r"^```py\n(.*?)^```$", README.read_text(), flags=re.M | re.S)
    code = _python_blocks()["Serving loop with `Engine`"] + devices
    code += "print('texts', [o.text is not None for o in outputs])\n"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=README.parent, env=host_device_env(8),
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert "texts [True, True]" in run.stdout
