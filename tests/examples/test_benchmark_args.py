"""The benchmark scripts refuse bad flag values by name (benchmarks/cli_args.py).

The checks that need a script run as `python SCRIPT ...` take their runs from one process
per environment (tests/examples/script_runs.py runs each script as a fresh interpreter
would, importing JAX once for all of them): `script_runs` without PYTHONPATH from the
checkout, `uninstalled_runs` with site skipped (-S) from the filesystem's root.
"""

from __future__ import annotations

import argparse
import json
import os
import site
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


ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("script_runs.py")
BENCHMARKS = ["attention.py", "gpu_compile_report.py", "gpu_kernel.py", "host_overhead.py",
              "prompt_logprobs.py", "serve.py", "stop_strings.py", "tpu_kernel.py"]  # fmt: skip
QUERY_HEADS = ["attention.py", "tpu_kernel.py"]
EXAMPLES = ["demo_cascade.py", "serve_shared_prefix.py", "train_tiny_lm.py"]
NEGATIVE_SEEDS = [
    ("benchmarks/host_overhead.py", "--seed: -1 must be >= 0"),
    ("examples/demo_cascade.py", "--seed must be >= 0, not -1"),
]
HOST_OVERHEAD_OUT = "<a folder>"  # script_runs puts an existing folder's path here


def _runs(tmp_path_factory, name, runs, *, env, cwd, flags=()) -> tuple[dict, str]:
    """({" ".join(run): result}, the log) of `runs` (lists: script, args...) as
    tests/examples/script_runs.py runs them in one `python *flags` process."""
    out = tmp_path_factory.mktemp(name) / "runs.json"
    argv = [sys.executable, *flags, str(DRIVER), str(out)]
    for run in runs:
        argv += [*run, "--"]
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    log = f"--- stdout\n{proc.stdout}\n--- stderr (tail)\n{proc.stderr[-4000:]}"
    if proc.returncode or not out.exists():
        pytest.fail(f"script_runs exited {proc.returncode}\n{log}")
    return json.loads(out.read_text()), log


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory):
    """Every run of a script from the checkout, as `python SCRIPT ARGS` runs it there with
    no PYTHONPATH; {"folder": an existing folder, run: result}."""
    folder = tmp_path_factory.mktemp("out_folder")
    runs = [[f"benchmarks/{script}", "--help"] for script in BENCHMARKS]
    runs += [[f"examples/{script}", "--help"] for script in EXAMPLES]
    runs += [[f"benchmarks/{s}", "--q-heads", "8", "--kv-heads", "3"] for s in QUERY_HEADS]
    runs += [["benchmarks/host_overhead.py", "--out", str(folder)]]
    runs += [["benchmarks/tpu_kernel.py", "--smoke", "--tpu-generation", "v9"]]
    runs += [[script, "--seed", "-1"] for script, _ in NEGATIVE_SEEDS]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    results, log = _runs(tmp_path_factory, "script_runs", runs, env=env, cwd=ROOT)
    return {"folder": folder, **results}, log


def _result(runs, *run) -> dict:
    results, log = runs
    result = results[" ".join(run)]
    result["log"] = f"--- its stderr\n{result['stderr'][-2000:]}\n{log}"
    return result


@pytest.mark.parametrize("script", QUERY_HEADS)
def test_query_heads_that_no_kv_head_count_divides_are_refused_by_flag(script, script_runs):
    # Both died in AttentionShape with a traceback once the grid had started.
    run = _result(script_runs, f"benchmarks/{script}", "--q-heads", "8", "--kv-heads", "3")
    assert run["code"] == 2, run["log"]
    assert "--q-heads 8 must be a multiple of --kv-heads 3" in run["stderr"]
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


def test_out_file_refuses_a_folder_and_out_dir_refuses_a_file(tmp_path):
    from benchmarks.cli_args import out_dir, out_file

    file = tmp_path / "x.json"
    file.write_text("{}")
    assert out_file(str(file)) == file and out_file(str(tmp_path / "new.json"))
    assert out_dir(str(tmp_path)) == tmp_path and out_dir(str(tmp_path / "new"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a folder"):
        out_file(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="is a file"):
        out_dir(str(file))
    for path_type in (out_file, out_dir):  # `--out "$UNSET"`: Path("") is the working folder
        with pytest.raises(argparse.ArgumentTypeError, match="is empty"):
            path_type("")


@pytest.mark.parametrize("module", ["stop_strings", "prompt_logprobs", "serve_args"])
def test_a_json_file_flag_given_a_folder_is_refused_before_the_run(module, tmp_path, capsys):
    # `--out benchmarks/results` (as attention.py takes it) ran the whole benchmark and
    # then died in write_text with IsADirectoryError, losing the run.
    import importlib

    parse_args = importlib.import_module(f"benchmarks.{module}").parse_args
    with pytest.raises(SystemExit):
        parse_args(["--out", str(tmp_path)])
    assert "--out" in (err := capsys.readouterr().err) and "is a folder" in err


def test_host_overhead_refuses_a_folder_for_its_json_file(script_runs):
    # Its default run takes minutes before the IsADirectoryError.
    folder = script_runs[0]["folder"]
    run = _result(script_runs, "benchmarks/host_overhead.py", "--out", str(folder))
    assert run["code"] == 2 and "is a folder" in run["stderr"], run["log"]
    assert not any(folder.iterdir())


def test_folder_flags_given_a_file_are_refused_before_the_run(tmp_path, capsys):
    # attention.py ran its grid, then died in mkdir with FileExistsError.
    from benchmarks import attention

    file = tmp_path / "results.json"
    file.write_text("{}")
    for main, argv in ((attention.main, []), (gpu_kernel.main, ["--smoke"])):
        with pytest.raises(SystemExit):
            main([*argv, "--out", str(file)])
        assert "is a file; give a folder" in capsys.readouterr().err
    assert file.read_text() == "{}"


def test_tpu_kernel_refuses_an_unknown_generation_by_flag(script_runs):
    # It ran into the kernel's ValueError with a traceback instead.
    run = _result(script_runs, "benchmarks/tpu_kernel.py", "--smoke", "--tpu-generation", "v9")
    assert run["code"] == 2, run["log"]
    assert "--tpu-generation: invalid choice: 'v9'" in run["stderr"]


@pytest.mark.parametrize("module", ["serve_args", "prompt_logprobs"])
def test_a_negative_seed_is_refused_by_its_flag(module, capsys):
    # It reached numpy's default_rng: "ValueError: expected non-negative integer", a
    # traceback naming no flag.
    import importlib

    parse_args = importlib.import_module(f"benchmarks.{module}").parse_args
    with pytest.raises(SystemExit):
        parse_args(["--seed", "-1"])
    assert "--seed: -1 must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("script,message", NEGATIVE_SEEDS)
def test_scripts_refuse_a_negative_seed_before_the_run(script, message, script_runs):
    run = _result(script_runs, script, "--seed", "-1")
    assert run["code"] == 2 and message in run["stderr"], run["log"]


@pytest.mark.parametrize("script", BENCHMARKS)
def test_every_benchmark_runs_as_a_script_without_pythonpath(script, script_runs):
    # `python benchmarks/gpu_compile_report.py`, as the README runs it, had only
    # benchmarks/ on sys.path and died on `from benchmarks.cli_args import out_dir`
    # (ModuleNotFoundError) unless the caller set PYTHONPATH.
    run = _result(script_runs, f"benchmarks/{script}", "--help")
    assert run["code"] == 0, run["log"]
    assert "--out" in run["stdout"]


@pytest.mark.parametrize("script", EXAMPLES)
def test_every_example_runs_from_this_checkout_without_pythonpath(script, script_runs):
    # `python examples/demo_cascade.py`, as the README runs it, imported kernels_pallas
    # from wherever jaxkv was installed (another checkout's code), or failed without one.
    run = _result(script_runs, f"examples/{script}", "--help")
    assert run["code"] == 0, run["log"]
    assert run["kernels_pallas"] is not None, run["log"]
    assert Path(run["kernels_pallas"]).is_relative_to(ROOT), run["kernels_pallas"]


def test_gpu_kernel_smoke_lowers_the_full_size_calls_with_the_flags_page_size(
    tmp_path, monkeypatch
):
    # The full-size lowering took pages of 16 and k_splits 16 whatever --page-size and
    # --jax-k-splits said, while the interpreted run used them.
    lowered = []
    stubs = dict(
        device_checks=lambda **kw: [], copy_bandwidth=lambda *a, **kw: {"float32": 1.0},
        bench_config=lambda *a, **kw: dict(B=2, P=32, S=16, cascade_agrees=True,
                                           jax_agrees=True),
        print_table=lambda *a: None, goals=lambda *a: {},
        lower_full_size=lambda **kw: lowered.append(kw) or {},
    )  # fmt: skip
    for name, stub in stubs.items():
        monkeypatch.setattr(gpu_kernel, name, stub)
    argv = ["--out", str(tmp_path), "--smoke", "--no-sweep", "--page-size", "8"]
    assert gpu_kernel.main([*argv, "--jax-k-splits", "4"]) == 0
    assert lowered == [{"page_size": 8, "k_splits": 4}]


def test_gpu_kernel_json_names_the_heads_its_rows_were_timed_with(tmp_path, monkeypatch):
    # A --smoke run timed 4 / 2 heads of 64 and wrote "heads": [32, 8, 128].
    import json

    timed = []
    stubs = dict(
        device_checks=lambda **kw: [], copy_bandwidth=lambda *a, **kw: {"float32": 1.0},
        bench_config=lambda *a, heads, **kw: timed.append(heads) or dict(
            B=2, P=32, S=16, cascade_agrees=True, jax_agrees=True),
        print_table=lambda *a: None, goals=lambda *a: {}, lower_full_size=lambda **kw: {},
    )  # fmt: skip
    for name, stub in stubs.items():
        monkeypatch.setattr(gpu_kernel, name, stub)
    assert gpu_kernel.main(["--out", str(tmp_path), "--smoke", "--no-sweep"]) == 0
    report = json.loads((tmp_path / "gpu_kernel.json").read_text())
    assert timed == [(4, 2, 64)] and report["heads"] == [4, 2, 64]


@pytest.fixture(scope="module")
def uninstalled_runs(tmp_path_factory):
    """Each example's --help run as `python -S examples/SCRIPT --help` runs it from "/": the
    installed packages are importable but jaxkv's install is not (-S skips site, and so
    the editable install's .pth finder; PYTHONPATH names the site-packages folders as
    plain paths)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(site.getsitepackages())
    runs = [[str(ROOT / "examples" / script), "--help"] for script in EXAMPLES]
    return _runs(tmp_path_factory, "uninstalled", runs, env=env, cwd="/", flags=["-S"])


@pytest.mark.parametrize("script", EXAMPLES)
def test_every_example_runs_from_a_checkout_without_installing(script, uninstalled_runs):
    # `python examples/demo_cascade.py`, as the README runs it, imported kernels_pallas
    # from wherever jaxkv was installed (another checkout's editable install), or died on
    # ModuleNotFoundError without an install, while the other examples put their checkout
    # first on sys.path.
    from tests.examples.script_runs import KERNELS_IMPORTABLE

    if uninstalled_runs[0][KERNELS_IMPORTABLE]:
        pytest.skip("kernels_pallas is installed as a plain package: nothing to check")
    run = _result(uninstalled_runs, str(ROOT / "examples" / script), "--help")
    assert run["code"] == 0, run["log"]
    assert "usage:" in run["stdout"]
