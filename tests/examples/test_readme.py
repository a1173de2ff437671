"""The README's Python examples run as written (each ```python block, in order), and its
commands for the scripts in benchmarks/ and examples/ name flags those scripts take."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
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
def test_readme_example_runs(section, capsys, monkeypatch, tmp_path):
    # Outside the checkout: an installed jaxkv has no examples/ folder next to the
    # working directory (the Engine example read examples/checkpoints/tiny).
    monkeypatch.chdir(tmp_path)
    exec(compile(_python_blocks()[section], f"README.md: {section}", "exec"), {})
    out = capsys.readouterr().out
    if "Engine" in section:
        assert "prefix-cache hit rate" in out
        hit = int(re.search(r"prefix-cache hit rate (\d+)%", out)[1])
        assert hit > 0  # the second and third prompts find the system prompt cached
        # The line the README quotes below the example.
        (quoted,) = re.findall(r"^The example ends with `([^`]+)`", README.read_text(), re.M)
        assert quoted in out.splitlines()
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


def _readme_commands() -> list[list[str]]:
    """Each `python benchmarks/...` or `python examples/...` command of the README, as
    words: the indented ones (a trailing backslash joins the next line, a # starts a
    comment) and those in backticks."""
    text = README.read_text()
    joined = text.replace("\\\n", " ")
    indented = re.findall(r"^ {4}(python (?:benchmarks|examples)/.*)$", joined, flags=re.M)
    quoted = re.findall(r"`(python (?:benchmarks|examples)/[^`]*)`", text)
    return [shlex.split(line, comments=True) for line in indented + quoted]


class _Parsed(Exception):
    """Stops a script right after it parsed its arguments."""


def test_readme_commands_name_flags_their_scripts_take(monkeypatch, capsys):
    # Each script runs as __main__ up to its parse_args, which then stops it: a flag the
    # README gives that the script has renamed or dropped, or a value it refuses, exits
    # with status 2 instead.
    commands = _readme_commands()
    assert len(commands) >= 10 and ["python", "benchmarks/serve.py", "--samples", "8",
        "--configs", "cascade+prefix_cache,flat+prefix_cache"] in commands  # fmt: skip
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.chdir(README.parent)
    for python, script, *args in commands:
        assert python == "python" and (README.parent / script).is_file(), script
        with monkeypatch.context() as m:
            m.setattr(sys, "argv", [script, *args])
            m.syspath_prepend(str(README.parent / script.split("/")[0]))
            with pytest.raises(_Parsed):
                try:
                    runpy.run_path(script, run_name="__main__")
                except SystemExit as e:
                    pytest.fail(f"{shlex.join([script, *args])}: exit {e.code}: "
                                f"{capsys.readouterr().err}")  # fmt: skip
