"""The benchmark scripts refuse bad flag values by name (benchmarks/cli_args.py)."""

from __future__ import annotations

import argparse
import os
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


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--kv-dtype", "float32", "float32"], "--kv-dtype float32 float32: each dtype once"),
        (["--kv-dtype-cells", "2,32,16"], "--kv-dtype-cells needs a second --kv-dtype"),
        (["--kv-dtype", "bfloat16", "float32", "--kv-dtype-cells", "64,8192,128"],
         "--kv-dtype-cells [(64, 8192, 128)]: not cells of the grid [(2, 32, 16)]"),
        (["--kv-dtype", "int8"], "--kv-dtype: invalid choice: 'int8'"),
    ],
)  # fmt: skip
def test_gpu_kernel_refuses_kv_dtypes_it_cannot_time_before_the_run(
    tmp_path, capsys, argv, message
):
    with pytest.raises(SystemExit):
        gpu_kernel.main(["--out", str(tmp_path / "out"), "--smoke", "--no-sweep", *argv])
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


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


def test_out_paths_under_a_file_are_refused(tmp_path):
    # `--out results.json/x.json` (or a folder under a file) ran the whole benchmark,
    # then died in write_json's mkdir with FileExistsError or NotADirectoryError.
    from benchmarks.cli_args import out_dir, out_file

    file = tmp_path / "results.json"
    file.write_text("{}")
    for path_type, name in ((out_file, "x.json"), (out_dir, "sub")):
        for path in (file / name, file / "deeper" / name):
            with pytest.raises(argparse.ArgumentTypeError, match="is a file, not a folder"):
                path_type(str(path))
    assert file.read_text() == "{}"


def _unwritable_folder(kind: str, tmp_path: Path) -> Path:
    if kind == "proc":  # refuses new files to root too
        if not Path("/proc/self").is_dir():
            pytest.skip("no /proc")
        return Path("/proc")
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    folder = tmp_path / "read_only"
    folder.mkdir(mode=0o555)
    return folder


@pytest.mark.parametrize("kind", ["read_only", "proc"])
def test_out_paths_this_process_cannot_write_are_refused(kind, tmp_path):
    # `--out` in a folder the process cannot write in ran the whole benchmark, then died
    # in write_json with PermissionError (or FileNotFoundError under /proc) and lost it.
    from benchmarks.cli_args import out_dir, out_file

    folder = _unwritable_folder(kind, tmp_path)
    for path_type, path in (
        (out_file, folder / "x.json"),
        (out_file, folder / "sub" / "x.json"),
        (out_dir, folder),
        (out_dir, folder / "sub"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match="cannot write in"):
            path_type(str(path))
    assert not (folder / "sub").exists() and not (folder / "x.json").exists()


def test_out_paths_leave_no_file_behind_where_they_can_write(tmp_path):
    from benchmarks.cli_args import out_dir, out_file

    assert out_file(str(tmp_path / "sub" / "x.json")) and out_dir(str(tmp_path / "new"))
    assert out_dir(str(tmp_path)) == tmp_path
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("module", ["stop_strings", "prompt_logprobs", "serve_args"])
def test_a_json_file_flag_given_a_folder_is_refused_before_the_run(module, tmp_path, capsys):
    # `--out benchmarks/results` (as attention.py takes it) ran the whole benchmark and
    # then died in write_text with IsADirectoryError, losing the run.
    import importlib

    parse_args = importlib.import_module(f"benchmarks.{module}").parse_args
    with pytest.raises(SystemExit):
        parse_args(["--out", str(tmp_path)])
    assert "--out" in (err := capsys.readouterr().err) and "is a folder" in err


def test_host_overhead_refuses_a_folder_for_its_json_file(tmp_path):
    # Its default run takes minutes before the IsADirectoryError.
    run = subprocess.run(
        [sys.executable, "benchmarks/host_overhead.py", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert run.returncode == 2 and "is a folder" in run.stderr
    assert not any(tmp_path.iterdir())


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


def test_tpu_kernel_refuses_an_unknown_generation_by_flag():
    # It ran into the kernel's ValueError with a traceback instead.
    run = subprocess.run(
        [sys.executable, "benchmarks/tpu_kernel.py", "--smoke", "--tpu-generation", "v9"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert run.returncode == 2
    assert "--tpu-generation: invalid choice: 'v9'" in run.stderr


@pytest.mark.parametrize("module", ["serve_args", "prompt_logprobs"])
def test_a_negative_seed_is_refused_by_its_flag(module, capsys):
    # It reached numpy's default_rng: "ValueError: expected non-negative integer", a
    # traceback naming no flag.
    import importlib

    parse_args = importlib.import_module(f"benchmarks.{module}").parse_args
    with pytest.raises(SystemExit):
        parse_args(["--seed", "-1"])
    assert "--seed: -1 must be >= 0" in capsys.readouterr().err


def test_seed_takes_what_jax_random_key_takes():
    from benchmarks.cli_args import seed

    assert seed("0") == 0 and seed(str(2**63 - 1)) == 2**63 - 1
    for text, match in (("-1", "-1 must be >= 0"), (str(2**63), "must be < 2\\*\\*63")):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            seed(text)


@pytest.mark.parametrize("module", ["serve_args", "prompt_logprobs"])
def test_a_seed_past_int64_is_refused_by_its_flag(module, capsys):
    # It built the random weights' jax.random.key: OverflowError, a traceback mid-run.
    import importlib

    parse_args = importlib.import_module(f"benchmarks.{module}").parse_args
    with pytest.raises(SystemExit):
        parse_args(["--seed", str(2**63)])
    assert f"--seed: {2**63} must be < 2**63" in capsys.readouterr().err


@pytest.mark.parametrize(
    "script,message",
    [
        ("benchmarks/host_overhead.py", "--seed: -1 must be >= 0"),
        ("examples/demo_cascade.py", "--seed must be >= 0, not -1"),
    ],
)
def test_scripts_refuse_a_negative_seed_before_the_run(script, message, tmp_path):
    run = subprocess.run(
        [sys.executable, script, "--seed", "-1"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize(
    "script",
    ["attention.py", "engine_host.py", "gpu_compile_report.py", "gpu_kernel.py",
     "host_overhead.py", "prompt_logprobs.py", "serve.py", "stop_strings.py", "tpu_kernel.py"],
)  # fmt: skip
def test_every_benchmark_runs_as_a_script_without_pythonpath(script):
    # `python benchmarks/gpu_compile_report.py`, as the README runs it, had only
    # benchmarks/ on sys.path and died on `from benchmarks.cli_args import out_dir`
    # (ModuleNotFoundError) unless the caller set PYTHONPATH.
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--help"], env=env,
        cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--out" in run.stdout
    # Where it writes without --out (prompt_logprobs.py's help said nothing of it).
    assert script == "gpu_kernel.py" or "benchmarks/results" in run.stdout


@pytest.mark.parametrize(
    "script", ["demo_cascade.py", "serve_shared_prefix.py", "train_tiny_lm.py"]
)
def test_every_example_runs_from_this_checkout_without_pythonpath(script):
    # `python examples/demo_cascade.py`, as the README runs it, imported kernels_pallas
    # from wherever jaxkv was installed (another checkout's code), or failed without one.
    import os

    root = Path(__file__).parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    as_python_runs_it = (  # examples/ first on sys.path, as for `python examples/x.py`
        "import runpy, sys; sys.path[0] = 'examples'; sys.argv = [sys.argv[1], '--help']\n"
        "try: runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit: pass\n"
        "print(sys.modules['kernels_pallas'].__file__)"
    )
    run = subprocess.run(
        [sys.executable, "-c", as_python_runs_it, f"examples/{script}"], env=env, cwd=root,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert Path(run.stdout.splitlines()[-1]).is_relative_to(root.resolve()), run.stdout


def test_gpu_kernel_smoke_lowers_the_full_size_calls_with_the_flags_page_size(
    tmp_path, monkeypatch
):
    # The full-size lowering took pages of 16 and k_splits 16 whatever --page-size and
    # --jax-k-splits said, while the interpreted run used them.
    lowered = []
    stubs = dict(
        device_checks=lambda **kw: [], copy_bandwidth=lambda *a, **kw: {"float32": 1.0},
        bench_config=lambda *a, **kw: dict(B=2, P=32, S=16, kv_dtype="bfloat16",
                                           cascade_agrees=True, jax_agrees=True),
        print_table=lambda *a: None, goals=lambda *a: {}, ratios=lambda *a: {},
        lower_full_size=lambda **kw: lowered.append(kw) or {},
    )  # fmt: skip
    for name, stub in stubs.items():
        monkeypatch.setattr(gpu_kernel, name, stub)
    argv = ["--out", str(tmp_path), "--smoke", "--no-sweep", "--page-size", "8"]
    assert gpu_kernel.main([*argv, "--jax-k-splits", "4"]) == 0
    assert lowered == [{"page_size": 8, "k_splits": 4, "kv_dtype": "bfloat16"}]


def test_gpu_kernel_json_names_the_heads_its_rows_were_timed_with(tmp_path, monkeypatch):
    # A --smoke run timed 4 / 2 heads of 64 and wrote "heads": [32, 8, 128].
    import json

    timed = []
    stubs = dict(
        device_checks=lambda **kw: [], copy_bandwidth=lambda *a, **kw: {"float32": 1.0},
        bench_config=lambda *a, heads, **kw: timed.append(heads) or dict(
            B=2, P=32, S=16, kv_dtype="bfloat16", cascade_agrees=True, jax_agrees=True),
        print_table=lambda *a: None, goals=lambda *a: {}, ratios=lambda *a: {},
        lower_full_size=lambda **kw: {},
    )  # fmt: skip
    for name, stub in stubs.items():
        monkeypatch.setattr(gpu_kernel, name, stub)
    assert gpu_kernel.main(["--out", str(tmp_path), "--smoke", "--no-sweep"]) == 0
    report = json.loads((tmp_path / "gpu_kernel.json").read_text())
    assert timed == [(4, 2, 64)] and report["heads"] == [4, 2, 64]


@pytest.mark.parametrize(
    "script", ["demo_cascade.py", "serve_shared_prefix.py", "train_tiny_lm.py"]
)
def test_every_example_runs_from_a_checkout_without_installing(script):
    # `python examples/demo_cascade.py`, as the README runs it, imported kernels_pallas
    # from wherever jaxkv was installed (another checkout's editable install), or died on
    # ModuleNotFoundError without an install, while the other examples put their checkout
    # first on sys.path. Here the installed packages are importable but jaxkv's install is
    # not: -S skips site (and so the editable install's .pth finder), PYTHONPATH names the
    # site-packages folders as plain paths.
    import os
    import site

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(site.getsitepackages())
    repo = Path(__file__).parents[2]
    probe = subprocess.run(
        [sys.executable, "-S", "-c", "import kernels_pallas"], env=env, cwd="/",
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if probe.returncode == 0:
        pytest.skip("kernels_pallas is installed as a plain package: nothing to check")
    run = subprocess.run(
        [sys.executable, "-S", str(repo / "examples" / script), "--help"], env=env, cwd="/",
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout
