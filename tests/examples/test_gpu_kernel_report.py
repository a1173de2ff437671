"""benchmarks/gpu_kernel_report.py: the GPU kernel benchmark's table, and the ratios it
prints held in the JSON's rows as well."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_kernel

# One cell's timings: flat over unique pages 200 us at 3e12 B/s, over shared pages 150 us,
# cascade 50 us, JAX's kernel 300 us; a copy bandwidth of 4e12 B/s.
TIMED = dict(
    B=64, P=8192, S=128, flat_unique_us=200.0, flat_unique_bytes_per_s=3e12,
    flat_shared_us=150.0, cascade_us=50.0, cascade_bytes_per_s=1e12, jax_paged_us=300.0,
    cascade_vs_flat_max_abs=1e-3, jax_vs_flat_max_abs=2e-3, cascade_agrees=True,
    jax_agrees=True,
)  # fmt: skip


def test_the_json_rows_hold_every_ratio_the_table_prints(tmp_path, monkeypatch, capsys):
    # The table printed % of copy, flat_shared / cascade and JAX / flat; the rows in
    # gpu_kernel.json held only the times, and the ratios only for the goals' cells.
    stubs = dict(
        device_checks=lambda **kw: [], copy_bandwidth=lambda *a, **kw: {"float32": 4e12},
        bench_config=lambda *a, **kw: dict(TIMED), lower_full_size=lambda **kw: {},
    )  # fmt: skip
    for name, stub in stubs.items():
        monkeypatch.setattr(gpu_kernel, name, stub)
    argv = ["--out", str(tmp_path), "--smoke", "--no-sweep"]
    assert gpu_kernel.main(argv) == 0
    (row,) = json.loads((tmp_path / "gpu_kernel.json").read_text())["rows"]
    assert row["flat_unique_fraction_of_copy"] == pytest.approx(0.75)
    assert row["flat_shared_over_cascade"] == pytest.approx(3.0)
    assert row["cascade_fraction_of_copy"] == pytest.approx(0.25)
    assert row["jax_paged_over_flat_unique"] == pytest.approx(1.5)
    printed = capsys.readouterr().out.splitlines()
    (line,) = [x for x in printed if x.split()[:3] == ["64", "8192", "128"]]
    (head,) = [x for x in printed if x.split()[:3] == ["B", "P", "S"]]
    cells = [c.split() for c in line.split("|")]
    assert cells[1] == ["200.0", "3000", "75"]  # us, GB/s, % of the copy bandwidth
    assert cells[3] == ["50.0", "1000", "25", "3.00"]  # us, GB/s, % of copy, shared / cascade
    assert cells[4] == ["300.0", "1.50"]  # us, JAX / flat_unique
    # The ratios' headers say which way round they are ("x flat" and "flat x" did not).
    assert head.split("|")[3].split() == ["cascade", "us", "GB/s", "%copy", "shr/casc"]
    assert head.split("|")[4].split() == ["jax", "us", "jax/flat"]


def test_a_run_that_measured_no_cell_fails(tmp_path, monkeypatch, capsys):
    # Checks that outlasted --max-seconds skipped every cell, and the run exited 0 with
    # an empty table: benchmarks/gpu_checks.sh's stage passed with no figure.
    stubs = dict(
        device_checks=lambda **kw: [], copy_bandwidth=lambda *a, **kw: {"float32": 4e12},
        bench_config=lambda *a, **kw: pytest.fail("no cell starts past --max-seconds"),
        lower_full_size=lambda **kw: {},
    )  # fmt: skip
    for name, stub in stubs.items():
        monkeypatch.setattr(gpu_kernel, name, stub)
    argv = ["--out", str(tmp_path), "--smoke", "--no-sweep", "--max-seconds", "1e-9"]
    assert gpu_kernel.main(argv) == 1
    assert "FAIL: no cell measured" in capsys.readouterr().out
    assert json.loads((tmp_path / "gpu_kernel.json").read_text())["rows"] == []
