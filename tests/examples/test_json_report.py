"""Benchmark JSON is strict: NaN and infinities become null, as JSON.stringify writes them."""

from __future__ import annotations

import json
import platform

import jax
import numpy as np
import pytest

from benchmarks.json_report import finite_json, machine_fields


def _strict(text: str):
    """json.loads refusing NaN, Infinity and -Infinity, as jq and JSON.parse do."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_figures_are_written_as_null_at_any_depth():
    report = {
        "p50": float("nan"),
        "rows": [{"err": float("inf"), "lse": -np.inf, "ms": 1.5}, (np.float64("nan"), 2)],
        "ok": True,
        "name": "NaN",
    }
    assert _strict(finite_json(report, indent=2)) == {
        "p50": None,
        "rows": [{"err": None, "lse": None, "ms": 1.5}, [None, 2]],
        "ok": True,
        "name": "NaN",
    }
    with pytest.raises(ValueError, match="not JSON: NaN"):
        _strict(json.dumps(report))  # what the benchmarks wrote before


def test_finite_values_are_written_as_json_dumps_writes_them():
    report = {"a": [1, 2.25, None, "x"], "b": {"c": 0.0, "d": -3}}
    assert finite_json(report, indent=1) == json.dumps(report, indent=1)


def test_write_json_makes_the_folder_and_writes_paths_as_text(tmp_path):
    from pathlib import Path

    from benchmarks.json_report import write_json

    out = tmp_path / "new" / "deeper" / "r.json"
    write_json(out, {"out": out, "rows": [Path("a/b"), float("nan")]}, indent=2)
    assert _strict(out.read_text()) == {"out": str(out), "rows": ["a/b", None]}


def test_a_nan_that_a_default_hook_makes_is_refused_not_written():
    """finite_json nulls the NaNs it reaches; one json.dumps makes later (through a
    `default` hook) raises ValueError instead of being written as NaN."""
    with pytest.raises(ValueError):
        finite_json({"x": np.float32("nan")}, default=float)


def test_write_json_indents_by_one_space_unless_told(tmp_path):
    from benchmarks.json_report import write_json

    out = tmp_path / "r.json"
    write_json(out, {"a": [1, 2]})
    assert out.read_text() == json.dumps({"a": [1, 2]}, indent=1)


def test_a_path_used_as_a_key_is_written_as_its_text(tmp_path):
    """Every Path in the report is its str, a dict's key too (json.dumps refuses a Path
    key with TypeError, which at the end of a run lost its figures)."""
    from pathlib import Path

    from benchmarks.json_report import write_json

    out = tmp_path / "r.json"
    write_json(out, {"by_file": {Path("a/b.txt"): 1.5, Path("c"): float("nan")}})
    assert _strict(out.read_text()) == {"by_file": {"a/b.txt": 1.5, "c": None}}


def test_a_write_cut_midway_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    # gpu_kernel.py rewrites its JSON after every row under gpu_checks.sh's time limit:
    # written in place, a SIGTERM mid-write left a cut file and lost the rows before it.
    from pathlib import Path

    from benchmarks.json_report import write_json

    out = tmp_path / "r.json"
    write_json(out, {"rows": [1, 2]})
    real_write_text = Path.write_text

    def cut_midway(self, text, *args, **kwargs):
        real_write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", cut_midway)
    with pytest.raises(KeyboardInterrupt):
        write_json(out, {"rows": [1, 2, 3]})
    assert json.loads(out.read_text()) == {"rows": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_machine_fields_name_the_backend_device_os_and_versions():
    # The fields benchmarks/serve.py and engine_host.py each wrote out by hand.
    assert machine_fields() == {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }
