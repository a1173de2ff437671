"""benchmarks/gpu_kernel_report.py: the GPU kernel benchmark's table, and the ratios it
prints held in the JSON's rows as well."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from benchmarks import gpu_kernel

# One cell's timings: flat over unique pages 200 us at 3e12 B/s, over shared pages 150 us,
# cascade 50 us, JAX's kernel 300 us; a copy bandwidth of 4e12 B/s.
TIMED = dict(
    B=64, P=8192, S=128, kv_dtype="bfloat16", flat_unique_us=200.0, flat_unique_bytes_per_s=3e12,
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


def _run_with_stub_cells(tmp_path, monkeypatch, argv, *, gpu: bool = False):
    """gpu_kernel.main(argv) with every measurement stubbed: each cell times flat 100 us
    over a bfloat16 cache and 250 us over a float32 one. Returns the (B, P, S, kv dtype)
    of the cells in the order they were timed, the kv_dtypes the checks were given, and
    the JSON."""
    timed, checked = [], []

    def bench_config(b, p, s, *, dtype, kv_dtype, **kw):
        assert jnp.dtype(dtype) == jnp.bfloat16
        timed.append((b, p, s, jnp.dtype(kv_dtype).name))
        us = 250.0 if jnp.dtype(kv_dtype) == jnp.float32 else 100.0
        return dict(TIMED, B=b, P=p, S=s, kv_dtype=jnp.dtype(kv_dtype).name,
                    flat_unique_us=us, flat_kv_bytes=us * 10)  # fmt: skip

    stubs = dict(
        device_checks=lambda **kw: checked.append(kw["kv_dtypes"]) or [],
        copy_bandwidth=lambda *a, **kw: {"float32": 4e12}, bench_config=bench_config,
        lower_full_size=lambda **kw: {}, sweep=lambda *a, **kw: [],
    )  # fmt: skip
    for name, stub in stubs.items():
        monkeypatch.setattr(gpu_kernel, name, stub)
    if gpu:  # a full run's grid and flags, on the CPU
        device = type("Device", (), {"platform": "gpu", "device_kind": "stub"})()
        monkeypatch.setattr(gpu_kernel.jax, "devices", lambda: [device])
    assert gpu_kernel.main(["--out", str(tmp_path), *argv]) == 0
    return timed, checked, json.loads((tmp_path / "gpu_kernel.json").read_text())


def test_kv_dtypes_after_the_first_are_timed_at_their_cells_right_after_the_first(
    tmp_path, monkeypatch, capsys
):
    # The benchmark timed bfloat16 queries over a bfloat16 cache only: what the float32
    # dots of a float32 cache cost (kernels_pallas.precision) was not measured.
    argv = ["--smoke", "--no-sweep", "--only", "8,1024,128;64,8192,128;128,8192,128"]
    argv += ["--kv-dtype", "bfloat16", "float32", "--kv-dtype-cells", "64,8192,128"]
    timed, checked, report = _run_with_stub_cells(tmp_path, monkeypatch, argv)
    assert timed == [
        (8, 1024, 128, "bfloat16"), (64, 8192, 128, "bfloat16"), (64, 8192, 128, "float32"),
        (128, 8192, 128, "bfloat16"),
    ]  # fmt: skip
    assert checked == [["bfloat16", "float32"]]
    assert report["dtype"] == "bfloat16" and report["kv_dtypes"] == ["bfloat16", "float32"]
    assert [r["kv_dtype"] for r in report["rows"]] == ["bfloat16"] * 2 + ["float32", "bfloat16"]
    (cost,) = report["kv_dtype_costs"]
    assert (cost["B"], cost["P"], cost["S"], cost["kv_dtype"]) == (64, 8192, 128, "float32")
    assert cost["flat_unique_time_ratio"] == pytest.approx(2.5)
    assert cost["flat_kv_bytes_ratio"] == pytest.approx(2.5)
    # The goals are the first cache's: 100 us flat at 3e12 B/s of a 4e12 copy.
    assert report["goals"]["flat_decode_fraction_of_copy_B64_P8192_S128"] == pytest.approx(0.75)
    lines = capsys.readouterr().out.splitlines()
    (f32_line,) = [x for x in lines if x.split()[:4] == ["64", "8192", "128", "float32"]]
    assert f32_line.split("|")[1].split()[0] == "250.0"
    (head,) = [x for x in lines if x.split()[:3] == ["B", "P", "S"]]
    assert head.split("|")[0].split() == ["B", "P", "S", "kv"]


def test_every_cell_is_timed_over_each_kv_dtype_without_kv_dtype_cells(tmp_path, monkeypatch):
    argv = ["--smoke", "--no-sweep", "--kv-dtype", "float32", "bfloat16"]
    timed, checked, report = _run_with_stub_cells(tmp_path, monkeypatch, argv)
    assert timed == [(2, 32, 16, "float32"), (2, 32, 16, "bfloat16")]
    (cost,) = report["kv_dtype_costs"]  # over the first, float32
    assert cost["kv_dtype"] == "bfloat16" and cost["flat_unique_time_ratio"] == pytest.approx(0.4)


def test_gpu_checks_sh_times_a_float32_cache_beside_the_bfloat16_one(tmp_path, monkeypatch):
    # The script a GPU run executes: its gpu_kernel stage, flags as written (shell
    # defaults taken), times B=64, P=8192, S=128 over a float32 cache right after the
    # bfloat16 one, and every other cell of the grid over bfloat16 only.
    import re
    import shlex
    from pathlib import Path

    script = (Path(__file__).parents[2] / "benchmarks" / "gpu_checks.sh").read_text()
    (stage,) = re.findall(r"^stage gpu_kernel .*?(?<!\\)\n", script, re.S | re.M)
    words = shlex.split(stage.replace("\\\n", " "))
    argv = words[words.index("benchmarks/gpu_kernel.py") + 1 :]
    argv = [re.sub(r"^\$\{\w+:-(.*)\}$", r"\1", w) for w in argv]
    argv = [str(tmp_path) if w == "$OUT" else w for w in argv]
    timed, _, _ = _run_with_stub_cells(tmp_path, monkeypatch, [*argv, "--no-sweep"], gpu=True)
    float32 = [cell for cell in timed if cell[3] == "float32"]
    assert float32 == [(64, 8192, 128, "float32")]
    assert timed[timed.index(float32[0]) - 1] == (64, 8192, 128, "bfloat16")
    assert len(timed) == len(gpu_kernel.GRID) + 1


def test_no_gpu_exits_before_making_the_out_folder(tmp_path, capsys):
    # The folder was made before the device check, so a run refused on the CPU left an
    # empty --out folder behind.
    out = tmp_path / "results"
    assert gpu_kernel.main(["--out", str(out), "--no-sweep"]) == 2
    assert "no GPU found" in capsys.readouterr().err
    assert not out.exists()


def test_a_run_whose_cascade_disagrees_with_flat_fails_and_names_the_cell(
    tmp_path, monkeypatch, capsys
):
    stubs = dict(
        device_checks=lambda **kw: [], copy_bandwidth=lambda *a, **kw: {"float32": 4e12},
        bench_config=lambda *a, **kw: dict(TIMED, cascade_agrees=False),
        lower_full_size=lambda **kw: {},
    )  # fmt: skip
    for name, stub in stubs.items():
        monkeypatch.setattr(gpu_kernel, name, stub)
    assert gpu_kernel.main(["--out", str(tmp_path), "--smoke", "--no-sweep"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: cascade or JAX's kernel disagrees with flat at (B, P, S) [(64, 8192, 128)]" in out
    (row,) = json.loads((tmp_path / "gpu_kernel.json").read_text())["rows"]
    assert row["cascade_agrees"] is False  # the figures are still written, marked


def test_the_sweep_runs_at_its_cell_over_the_first_kv_dtype_into_the_json(tmp_path, monkeypatch):
    swept = []

    def sweep(b, p, s, **kw):
        swept.append(((b, p, s), kw["tilings"], kw["kv_dtype"], kw["page_size"]))
        return [dict(block_k=16, num_kv_splits=2, kv_dtype="float32", us=12.5)]

    stubs = dict(
        device_checks=lambda **kw: [], copy_bandwidth=lambda *a, **kw: {"float32": 4e12},
        bench_config=lambda *a, **kw: dict(TIMED), lower_full_size=lambda **kw: {},
        sweep=sweep,
    )  # fmt: skip
    for name, stub in stubs.items():
        monkeypatch.setattr(gpu_kernel, name, stub)
    argv = ["--out", str(tmp_path), "--smoke", "--kv-dtype", "float32", "bfloat16"]
    assert gpu_kernel.main(argv) == 0
    assert swept == [(gpu_kernel.SMOKE_CELL, [dict(block_k=16, num_kv_splits=2)], "float32", 16)]
    report = json.loads((tmp_path / "gpu_kernel.json").read_text())
    assert report["sweep"] == [dict(block_k=16, num_kv_splits=2, kv_dtype="float32", us=12.5)]


def test_the_sweep_times_each_tiling_records_a_failing_one_and_stops_at_its_deadline(
    monkeypatch,
):
    # A tiling the kernel cannot take (e.g. out of shared memory) is a row with its error,
    # not the end of the run; no tiling starts past the deadline.
    import types

    from benchmarks.attention_bytes import decode_bytes

    clock, operands, failed = [0.0], set(), "out of shared memory"

    def flat_fn(q, kv, *args, sm_scale, interpret, **knobs):
        operands.add((q.dtype.name, kv.dtype.name, interpret))
        if knobs["num_warps"] == 8:
            raise RuntimeError(failed)
        return q

    def time_call(fn, args, repeats, *, flush_l2):
        assert flush_l2 and repeats == 3
        clock[0] += 1.0  # each tiling takes a second
        return 2e-4, fn(*args)  # 2 calls: 100 us each

    monkeypatch.setattr(gpu_kernel, "flat_fn", flat_fn)
    monkeypatch.setattr(gpu_kernel, "time_call", time_call)
    monkeypatch.setattr(gpu_kernel, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    tilings = [dict(block_k=16, num_warps=w) for w in (4, 8, 2, 1)]
    rows = gpu_kernel.sweep(
        2, 32, 16, page_size=16, reps=2, repeats=3, copy_bps=1e9, deadline=2.5,
        heads=(4, 2, 64), interpret=True, tilings=tilings, kv_dtype="float32",
    )  # fmt: skip
    assert operands == {("bfloat16", "float32", True)}
    sizes = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, kv_itemsize=4, q_itemsize=2)
    fraction = decode_bytes(2, 32, 16, **sizes, cascade=False) / 1e-4 / 1e9
    fractions = [r.pop("fraction_of_copy", None) for r in rows]
    assert fractions == [pytest.approx(fraction), None, pytest.approx(fraction)]
    assert rows == [
        dict(block_k=16, num_warps=4, kv_dtype="float32", us=pytest.approx(100.0)),
        dict(block_k=16, num_warps=8, kv_dtype="float32", error=f"RuntimeError: {failed}"),
        dict(block_k=16, num_warps=2, kv_dtype="float32", us=pytest.approx(100.0)),
    ]  # the fourth tiling would start at 3 s, past the deadline of 2.5 s
    clock[0] = 0.0
    rows = gpu_kernel.sweep(
        2, 32, 16, page_size=16, reps=2, repeats=3, copy_bps=1e9, deadline=10.0,
        heads=(4, 2, 64), interpret=True, tilings=tilings, kv_dtype="float32",
    )  # fmt: skip
    assert [r["num_warps"] for r in rows] == [4, 8, 2, 1]  # all started before the deadline
