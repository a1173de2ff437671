"""examples/cloud_tpu.sh installs what the scripts it runs import, and writes the serving
run's transcript whole or not at all."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {"jaxkv", "kernels_pallas", "benchmarks"}
DISTRIBUTION = {"jax": "jax", "flax": "flax", "numpy": "numpy", "rich": "rich"}  # module: pip


def _imports(path: Path, seen: set[Path]) -> set[str]:
    """Top-level modules `path` imports at module level, and its sibling modules' (the
    examples import each other from examples/, the benchmarks from benchmarks/)."""
    if path in seen or not path.exists():
        return set()
    seen.add(path)
    names = set()
    for node in ast.parse(path.read_text()).body:  # module level: what a run needs
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    found = set()
    for name in names:
        top = name.split(".")[0]
        if top == "benchmarks":
            found |= _imports(ROOT / (name.replace(".", "/") + ".py"), seen)
        elif (path.parent / f"{top}.py").exists():
            found |= _imports(path.parent / f"{top}.py", seen)
        elif top not in sys.stdlib_module_names and top not in OURS:
            found.add(top)
    return found


def test_the_tpu_vm_setup_installs_every_module_its_scripts_import():
    # It installed jaxkv with the bench extra alone, and examples/serve_shared_prefix.py
    # imports rich (in the test extra only): its first run on a TPU VM would have died on
    # ModuleNotFoundError before serving anything.
    script = (ROOT / "examples" / "cloud_tpu.sh").read_text()
    (extras,) = re.findall(r'pip install -e "\.\[([a-z,]+)\]"', script)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"]) + ["jax[tpu]"]
    for extra in extras.split(","):
        declared += project["optional-dependencies"][extra]
    installed = {re.match(r"[A-Za-z0-9_.-]+", d)[0].lower() for d in declared}
    ran = re.findall(r"^python ((?:examples|benchmarks)/\w+\.py)", script, flags=re.M)
    assert ran == ["examples/serve_shared_prefix.py", "benchmarks/tpu_kernel.py"]
    needed = set().union(*(_imports(ROOT / r, set()) for r in ran))
    assert needed == {"jax", "flax", "numpy", "rich"}
    assert {DISTRIBUTION[m] for m in needed} <= installed


def test_the_virtual_environments_the_setups_create_are_git_ignored():
    # cloud_tpu.sh made .venv-tpu/ in the checkout, which .gitignore did not name: git
    # status listed it, and `make lint` (ruff check ., which skips git-ignored paths)
    # linted every package installed there.
    makefile = (ROOT / "Makefile").read_text()
    (venv,) = re.findall(r"^VENV := (\S+)$", makefile, flags=re.M)
    made = set(re.findall(r"-m venv (\S+)", makefile.replace("$(VENV)", venv)))
    made |= set(re.findall(r"-m venv (\S+)", (ROOT / "examples" / "cloud_tpu.sh").read_text()))
    assert made == {".venv", ".venv-tpu"}
    ignored = set((ROOT / ".gitignore").read_text().splitlines())
    assert {f"{name}/" for name in made} <= ignored


@pytest.mark.parametrize("ending", ["exit 0", "exit 1", "kill -TERM $PPID"])
def test_a_serving_run_killed_or_failed_leaves_the_previous_transcript_whole(tmp_path, ending):
    # The run was tee'd into benchmarks/results/serve_tpu.txt: killed midway, it left a
    # cut transcript there, beside complete results, that read as a whole run's. Here a
    # stub `python` prints a line of the run, then ends well, fails, or kills the script.
    script = (ROOT / "examples" / "cloud_tpu.sh").read_text()
    start = script.index("mkdir -p benchmarks/results")
    serving = script[start : script.index("\n# 3.", start)]  # step 2 alone
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "serve_tpu.txt").write_text("the previous run\n")
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(f"#!/usr/bin/env bash\necho 'cascade on: 64/64 requests'\n{ending}\n")
    stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{stub.parent}{os.pathsep}{os.environ['PATH']}")
    run = subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{serving}"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    whole = ending == "exit 0"
    assert (run.returncode == 0) == whole, run.stderr
    written = {p.name: p.read_text() for p in results.iterdir()}
    if whole:
        assert written == {"serve_tpu.txt": "cascade on: 64/64 requests\n"}
    else:
        assert written == {
            "serve_tpu.txt": "the previous run\n",
            ".serve_tpu.tmp.txt": "cascade on: 64/64 requests\n",
        }
