"""benchmarks/tpu_kernel.py: its page tables share what they say; generation keys match
the tuning and peak-bandwidth tables."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from kernels_pallas.tpu import TUNED_BLOCK_SIZES, generation_from_device_kind

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "tpu_kernel.py"
_spec = importlib.util.spec_from_file_location("tpu_kernel_benchmark", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_decode_table_shares_the_prefix_pages_only():
    table, prefix_pages, num_pages = bench.decode_table(
        np.random.default_rng(0), 3, 64, 20, page_size=16
    )
    assert prefix_pages == 4 and table.shape == (3, 4 + 2) and num_pages == 1 + 4 + 3 * 2
    assert np.all(table[:, :4] == table[0, :4])  # 64 prefix tokens = 4 shared pages
    own = table[:, 4:]
    assert len(np.unique(own)) == own.size  # 20 own tokens = 2 pages, never shared
    assert not np.intersect1d(own, table[0, :4]).size
    assert table.min() >= 1 and table.max() < num_pages  # never the null page 0


@pytest.mark.parametrize(
    "kind,gen",
    [("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5", "v5p"), ("TPU v5p", "v5p"),
     ("TPU v6 lite", "v6e"), ("TPU7x", "7x"), ("cpu", None), ("NVIDIA H100", None)],
)  # fmt: skip
def test_generation_keys(kind, gen):
    assert generation_from_device_kind(kind) == gen
    if gen is not None:
        assert gen in bench.PEAK_HBM_BANDWIDTH
        assert gen in TUNED_BLOCK_SIZES or gen == "7x"


def test_peak_bandwidths_are_the_documented_per_chip_figures():
    # Google Cloud's TPU pages, GB/s per chip: v4 "32 GiB, 1200 GBps"; v5e 819; v5p 2765;
    # v6e 1638 and TPU7x 7380 ("HBM bandwidth per chip (GBps)"). v4's was 1228e9, which
    # put every v4 fraction of peak 2.3% low and vs_bound 2.3% high.
    assert bench.PEAK_HBM_BANDWIDTH == {
        "v4": 1200e9, "v5e": 819e9, "v5p": 2765e9, "v6e": 1638e9, "7x": 7380e9,
    }  # fmt: skip


def test_cascade_is_judged_against_flat_on_the_timed_inputs():
    # The benchmark timed both methods and reported the speedup without comparing their
    # outputs: its device checks never run the cascade composition on the grid's inputs.
    import jax.numpy as jnp

    from kernels_pallas import reference

    rng = np.random.default_rng(0)
    inputs, prefix_pages = bench.decode_inputs(
        rng, 3, 32, 16, page_size=16, heads=(4, 2, 64), dtype=jnp.float32
    )
    right = bench.methods(0.125, reference.ragged_paged_attention)
    got = bench.cascade_agreement(right, inputs, prefix_pages, jnp.float32)
    assert got["agrees"] and got["max_abs_diff"] < 1e-5

    def no_prefix_pass(q, *args, causal=True, **kw):  # drops the prefix's keys
        out, lse = reference.ragged_paged_attention(q, *args, causal=causal, **kw)
        return (out, lse) if causal else (out, jnp.full_like(lse, -jnp.inf))

    wrong = bench.methods(0.125, no_prefix_pass)
    assert not bench.cascade_agreement(wrong, inputs, prefix_pages, jnp.float32)["agrees"]


def test_smoke_lowers_the_full_size_calls_with_the_heads_the_flags_name(
    monkeypatch, tmp_path, capsys
):
    # --smoke lowered Llama-3-8B's 32 / 8 heads whatever --q-heads and --kv-heads said
    # (while it took --head-dim, --batch, --prefix and --suffix), and never checked them.
    import sys

    lowered = []
    meta = {"reference_errors": {}}
    monkeypatch.setattr(bench, "run", lambda args: ([], meta))
    monkeypatch.setattr(bench, "lower_full_size", lambda a: lowered.append((a.q_heads, a.kv_heads)))
    argv = ["tpu_kernel.py", "--smoke", "--out", str(tmp_path), "--q-heads", "16"]
    monkeypatch.setattr(sys, "argv", [*argv, "--kv-heads", "4"])
    assert bench.main() == 0
    assert lowered == [(16, 4)]
    monkeypatch.setattr(sys, "argv", [*argv, "--kv-heads", "3"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--q-heads 16 must be a multiple of --kv-heads 3" in capsys.readouterr().err


def test_without_a_tpu_a_full_run_says_so_and_measures_nothing(monkeypatch, tmp_path, capsys):
    # It ran its checks with the compiled kernel, which raised "Only interpret mode is
    # supported on CPU backend." in a traceback (gpu_kernel.py exits 2 without a GPU).
    import sys

    import jax

    if jax.default_backend() == "tpu":
        pytest.skip("a TPU is here")
    monkeypatch.setattr(sys, "argv", ["tpu_kernel.py", "--out", str(tmp_path)])
    assert bench.main() == 2
    assert "no TPU found: run with --smoke" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_every_figure_in_the_tpu_json_has_its_unit(monkeypatch, tmp_path):
    # Its bandwidths (bytes per second) and ratios (which way round) named no unit.
    import json
    import sys

    from kernels_pallas import reference

    def kernel(*args, interpret, tpu_generation, **kw):  # the reference, jitted: quick
        return reference.ragged_paged_attention(*args, **kw)

    monkeypatch.setattr(bench, "ragged_paged_attention", kernel)
    monkeypatch.setattr(bench, "lower_full_size", lambda args: None)
    monkeypatch.setattr(bench, "PEAK_HBM_BANDWIDTH", {None: 1e12})  # a peak off TPU too
    monkeypatch.setattr(sys, "argv", ["tpu_kernel.py", "--smoke", "--out", str(tmp_path)])
    assert bench.main() == 0
    report = json.loads((tmp_path / "tpu_kernel.json").read_text())
    (row,) = report["results"]
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    figures = {k for k, v in row.items() if number(v)}
    figures |= {"peak_hbm_bandwidth", "copy_bandwidth"}
    assert figures - set(report["units"]) == set()
    assert report["units"]["cascade_vs_bytes_bound"].startswith("cascade seconds /")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--head-dim", "96"], "--head-dim=96 (head_dim) must be one of (64, 128, 256)"),
        (["--page-size", "8"], "--page-size=8 (page_size) must be in [16, 256] and a multiple"),
        (["--page-size", "24", "--prefix", "48"], "--page-size=24 (page_size) must be in"),
        (["--page-size", "512", "--prefix", "1024"], "--page-size=512 (page_size) must be in"),
        (["--page-size", "8", "--dtype", "float32"], "a multiple of 8 (sublane tiling of float32)"),
    ],
)
def test_shapes_the_kernel_refuses_are_refused_by_flag_before_the_run(
    argv, message, monkeypatch, tmp_path, capsys
):
    # They reached the kernel's own ValueError in a traceback from the first check.
    monkeypatch.setattr(bench, "run", lambda args: pytest.fail("the run started"))
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--out", str(tmp_path), *argv])
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def _smoke_with_the_reference(monkeypatch, tmp_path, argv):
    """main(--smoke *argv) with the reference standing in for the kernel (quick); returns
    its JSON and the (q, kv_pages) dtypes of every kernel call."""
    import json

    from kernels_pallas import reference

    calls = set()

    def kernel(q, kv_pages, *args, interpret, tpu_generation, **kw):
        calls.add((q.dtype.name, kv_pages.dtype.name))
        return reference.ragged_paged_attention(q, kv_pages, *args, **kw)

    monkeypatch.setattr(bench, "ragged_paged_attention", kernel)
    monkeypatch.setattr(bench, "lower_full_size", lambda args: None)
    monkeypatch.setattr(bench, "PEAK_HBM_BANDWIDTH", {None: 1e12})  # a peak off TPU too
    assert bench.main(["--smoke", "--out", str(tmp_path), *argv]) == 0
    return json.loads((tmp_path / "tpu_kernel.json").read_text()), calls


def test_kv_dtype_sets_the_cache_and_the_bytes_apart_from_the_queries(
    monkeypatch, tmp_path, capsys
):
    # --dtype set queries and cache together: bfloat16 queries over a float32 cache (whose
    # dots run in float32) could not be timed, and the bytes bound took q's itemsize.
    from benchmarks.attention_bytes import decode_bytes

    argv = ["--dtype", "bfloat16", "--kv-dtype", "float32"]
    report, calls = _smoke_with_the_reference(monkeypatch, tmp_path, argv)
    assert calls == {("bfloat16", "float32"), ("bfloat16", "int8")}  # int8: its check
    assert report["meta"]["dtype"] == "bfloat16" and report["meta"]["kv_dtype"] == "float32"
    (row,) = report["results"]
    b, p, s, hq, hkv, d = row["batch"], row["prefix"], row["suffix"], 8, 2, 128  # --smoke's
    assert row["flat_kv_bytes"] == b * (p + s) * 2 * hkv * d * 4
    sizes = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, kv_itemsize=4, q_itemsize=2)
    assert row["flat_total_bytes"] == decode_bytes(b, p, s, **sizes, cascade=False)
    assert row["cascade_total_bytes"] == decode_bytes(b, p, s, **sizes, cascade=True)
    assert row["cascade_vs_bytes_bound"] == pytest.approx(
        row["cascade_s"] / (row["cascade_total_bytes"] / 1e12)
    )
    assert "queries bfloat16, KV cache float32" in capsys.readouterr().out


def test_kv_dtype_defaults_to_the_queries(monkeypatch, tmp_path):
    report, calls = _smoke_with_the_reference(monkeypatch, tmp_path, ["--dtype", "float32"])
    assert calls == {("float32", "float32"), ("float32", "int8")}
    assert report["meta"]["kv_dtype"] == "float32"
    (row,) = report["results"]
    assert row["flat_kv_bytes"] == row["batch"] * (row["prefix"] + row["suffix"]) * 2 * 2 * 128 * 4


def test_the_checks_take_bfloat16_queries_over_a_float32_cache_in_the_interpreter():
    import functools

    import jax.numpy as jnp

    from benchmarks.tpu_kernel_checks import check

    kernel = functools.partial(bench.ragged_paged_attention, interpret=True)
    errors = check(
        kernel, heads=(4, 2, 128), dtype=jnp.bfloat16, kv_dtype=jnp.float32, page_size=16,
        interpret=True,
    )  # fmt: skip
    assert set(errors) == {"mixed", "int8", "prefix_pass"}
    assert all(e["ok"] for e in errors.values()), errors


def test_smoke_lowers_bfloat16_queries_over_a_float32_cache_for_tpu(capsys):
    import argparse

    args = argparse.Namespace(
        full_batch=[4], full_prefix=[32], full_suffix=[16], page_size=16, q_heads=8,
        kv_heads=2, head_dim=128, dtype="bfloat16", kv_dtype="float32",
        tpu_generation="default",
    )  # fmt: skip
    bench.lower_full_size(args)
    out = capsys.readouterr().out
    assert out.count("bfloat16 queries over a float32 cache, for TPU") == 2  # flat, cascade


ROW = dict(batch=4, prefix=32, suffix=16, outputs_agree=True)


@pytest.mark.parametrize(
    "errors,rows,message",
    [
        ({"mixed": {"ok": True}, "int8": {"ok": False}}, [ROW],
         "FAIL: the kernel is outside tolerance of the reference in ['int8']"),
        ({"mixed": {"ok": True}}, [ROW, dict(ROW, batch=8, outputs_agree=False)],
         "FAIL: cascade's output disagrees with flat's at (B, P, S) [(8, 32, 16)]"),
    ],
)  # fmt: skip
def test_a_run_outside_tolerance_or_whose_cascade_disagrees_fails_by_name(
    errors, rows, message, monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(bench, "run", lambda args: (rows, {"reference_errors": errors}))
    monkeypatch.setattr(bench, "lower_full_size", lambda args: None)
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 1
    fails = [line for line in capsys.readouterr().out.splitlines() if "FAIL" in line]
    assert fails == [message]
    assert (tmp_path / "tpu_kernel.json").exists()  # the figures are still written


def test_a_full_run_times_the_flags_grid_and_lowers_nothing(monkeypatch, tmp_path):
    # Only --smoke, which runs a tiny case in the interpreter, lowers the full-size calls:
    # a run on a TPU has run them.
    timed = []

    def run(args):
        timed.append((args.batch, args.prefix, args.suffix, args.q_heads, args.kv_heads))
        return [ROW], {"reference_errors": {}}

    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(bench, "lower_full_size", lambda args: pytest.fail("lowered"))
    monkeypatch.setattr(bench.jax, "default_backend", lambda: "tpu")
    argv = ["--batch", "8", "--prefix", "64", "--suffix", "16", "--q-heads", "16"]
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    assert timed == [([8], [64], [16], 16, 8)]
