"""The benchmark scripts refuse bad flag values by name (benchmarks/cli_args.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_kernel
from benchmarks.cli_args import (
    check_head_groups,
    check_whole_pages,
    decode_grid,
    non_negative_int,
    positive_float,
    positive_int,
)


def test_positive_int_takes_ints_from_one_up():
    assert positive_int("3") == 3
    for text, match in (("0", "0 must be >= 1"), ("-2", "-2 must be >= 1"), ("1.5", "not an int")):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            positive_int(text)


def test_non_negative_int_takes_ints_from_zero_up():
    assert non_negative_int("0") == 0 and non_negative_int("7") == 7
    for text, match in (("-1", "-1 must be >= 0"), ("1.5", "not an int")):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            non_negative_int(text)


def test_positive_float_takes_finite_numbers_above_zero():
    assert positive_float("0.5") == 0.5
    for text, match in (("0", "must be a finite number > 0"), ("-1", "> 0"), ("inf", "> 0"),
                        ("nan", "> 0"), ("ten", "not a number")):  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            positive_float(text)


def test_gpu_kernel_refuses_a_time_limit_that_would_measure_nothing(tmp_path, capsys):
    # --max-seconds -1 ran the checks, skipped every cell and exited 0 with no figures.
    with pytest.raises(SystemExit):
        gpu_kernel.main(["--out", str(tmp_path), "--smoke", "--max-seconds", "-1"])
    assert "--max-seconds: -1.0 must be a finite number > 0" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_decode_grid_reads_cells_of_three_positive_ints():
    assert decode_grid("64,8192,128;8,1024,128") == [(64, 8192, 128), (8, 1024, 128)]
    for text in ("2,40", "2,40,16,1", "2,0,16", "a,b,c"):
        with pytest.raises(argparse.ArgumentTypeError):
            decode_grid(text)


@pytest.mark.parametrize("script", ["attention.py", "tpu_kernel.py"])
def test_query_heads_that_no_kv_head_count_divides_are_refused_by_flag(script):
    # Both died in AttentionShape with a traceback once the grid had started.
    run = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--q-heads", "8", "--kv-heads", "3"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert run.returncode == 2
    assert "--q-heads 8 must be a multiple of --kv-heads 3" in run.stderr
    check_head_groups(argparse.ArgumentParser(), 8, 2)


def test_a_prefix_that_is_not_whole_pages_is_refused_by_its_flag(capsys):
    parser = argparse.ArgumentParser()
    check_whole_pages(parser, [32, 64], 16, "--prefix")
    with pytest.raises(SystemExit):
        check_whole_pages(parser, [32, 40], 16, "--prefix")
    assert "--prefix [40]: each must be a multiple of the page size, 16" in capsys.readouterr().err


def test_gpu_kernel_refuses_a_ragged_prefix_before_it_measures_anything(tmp_path, capsys):
    # It used to run it: 3 pages for a 40-token prefix, 8 keys in no page, exit status 0.
    with pytest.raises(SystemExit):
        gpu_kernel.main(["--out", str(tmp_path), "--smoke", "--no-sweep", "--only", "2,40,16"])
    assert "--only [40]" in capsys.readouterr().err and not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--smoke", "--no-sweep", "--page-size", "64"], "the grid's prefixes [32]"),
        (["--page-size", "48"], "the grid's prefixes [1024, 8192]"),
        (["--smoke", "--only", "2,64,16", "--page-size", "64"], "the sweep's prefix"),
    ],
)
def test_gpu_kernel_refuses_a_page_size_its_own_cells_do_not_fill(tmp_path, capsys, argv, named):
    # The built-in grid and sweep cells were never checked: --smoke --page-size 64 gave a
    # 32-token prefix no shared page, and the run reported cascade bytes it never read.
    with pytest.raises(SystemExit):
        gpu_kernel.main(["--out", str(tmp_path), *argv])
    assert named in capsys.readouterr().err and not any(tmp_path.iterdir())
