"""Decode benchmark of the Pallas TPU ragged paged attention kernel on a Cloud TPU VM.

One run:

1. checks the kernel against `kernels_pallas.reference` on the device
   (benchmarks/tpu_kernel_checks.py: mixed prefill and decode with GQA, the non-causal
   prefix pass, over --kv-dtype pages, and int8 KV), records the worst errors and
   judges them (benchmarks/reference_errors.py; a failed check makes the exit status 1);
2. measures the device's copy bandwidth (a large elementwise copy, read + write);
3. for B decode requests (B in {8, 32, 128}) that share a P-token prefix (P in {256, 1024,
   4096}) and own S more tokens each (S in {16, 128, 1024}), with Llama-3-8B heads (32
   query heads, 8 KV heads, head_dim 128), bfloat16 queries (--dtype) over a cache of
   --kv-dtype (default: the queries' dtype), page size 16, times
   - flat: one kernel call over each request's whole page table (B * (P + S) KV tokens),
   - cascade: prefix pass (one non-causal sequence holding all B queries over the shared
     pages) + suffix pass + LSE merge, i.e. `kernels_pallas.reference.cascade_attention`
     with this kernel as `attention_fn` (P + B * S KV tokens);
4. compares cascade's output with flat's on each configuration's timed inputs
   (benchmarks/output_agreement.py: a disagreement makes the exit status 1);
5. prints a table and writes `tpu_kernel.json` to --out.

Bandwidth is the bytes the method must move (benchmarks/attention_bytes.py: KV at the
cache's itemsize, queries and outputs at the queries', and cascade's float32 partial
results and merge) divided by its time, reported as a
fraction of the chip's peak HBM bandwidth (PEAK_HBM_BANDWIDTH, by TPU generation) and of
the measured copy bandwidth. The goals: flat decode at >= 80% of peak at large batch;
cascade within 1.3x of its bytes bound (cascade bytes / peak), the `vs_bound` column.
Queries narrower than the cache (bfloat16 over float32) compute in the cache's dtype
(kernels_pallas.precision): --dtype bfloat16 --kv-dtype float32 times that cost, against
a --kv-dtype bfloat16 run's.
Each timing runs --reps calls inside one jitted loop (queries perturbed per iteration so
XLA cannot hoist the call out of the loop), so dispatch overhead is amortised.

    python benchmarks/tpu_kernel.py --out results/            # on a TPU VM
    python benchmarks/tpu_kernel.py --out /tmp/smoke --smoke  # CPU: interpreter, tiny

Without --smoke on a machine without a TPU it exits with status 2 (as gpu_kernel.py does
without a GPU). --smoke runs the checks and one tiny configuration of both methods in the TPU
interpreter on the CPU, then lowers the largest flat and cascade calls of the grid the
flags name (--batch, --prefix, --suffix and the heads; Llama-3-8B's by default) for TPU
(no TPU needed): it shows the script is not broken, it measures nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_bytes import decode_bytes, kv_bytes  # noqa: E402
from benchmarks.cli_args import (  # noqa: E402
    RESULTS_DIR,
    add_decode_grid_args,
    check_head_groups,
    check_whole_pages,
    out_dir,
    positive_int,
)
from benchmarks.decode_units import units_of  # noqa: E402
from benchmarks.device_timing import median_s  # noqa: E402
from benchmarks.json_report import write_json  # noqa: E402
from benchmarks.output_agreement import agreement  # noqa: E402
from benchmarks.tpu_kernel_checks import check  # noqa: E402
from kernels_pallas import reference  # noqa: E402
from kernels_pallas.tpu import (  # noqa: E402
    TUNED_BLOCK_SIZES,
    check_shapes,
    detect_tpu_generation,
    ragged_paged_attention,
)

# Peak HBM bandwidth per chip, bytes/s: the GBps (10**9 bytes per second) of the Google
# Cloud TPU documentation's tables, keyed like kernels_pallas.tpu.tuning: device_kind
# lower-cased without "tpu", " lite" -> "e".
PEAK_HBM_BANDWIDTH = {
    "v4": 1200e9,
    "v5e": 819e9,
    "v5p": 2765e9,
    "v6e": 1638e9,
    "7x": 7380e9,
}


def copy_bandwidth(nbytes: int = 1 << 29) -> float:
    """Bytes per second of a device-side copy (read + write counted)."""
    x = jnp.ones(nbytes // 4, jnp.float32)
    return 2 * nbytes / median_s(jax.jit(lambda a: a + 1.0), x, reps=5)


def looped(fn, reps: int):
    """jit(q, *rest) running fn `reps` times in one program; returns a scalar to keep.

    The scalar sums every output and log-sum-exp: kept from one element only, XLA would
    compute one element of cascade's merge and drop the rest of it from the timing.
    """

    @jax.jit
    def run(q, *rest):
        def body(i, acc):
            q_i = q + i.astype(q.dtype) * jnp.asarray(1e-30, q.dtype)
            out, lse = fn(q_i, *rest)
            return acc + jnp.sum(out, dtype=jnp.float32) + jnp.sum(lse, dtype=jnp.float32)

        return lax.fori_loop(0, reps, body, jnp.float32(0))

    return run


def decode_table(rng, batch, prefix, suffix, *, page_size) -> tuple[np.ndarray, int, int]:
    """(page table i32[batch, pages], shared pages, total pages incl. the null page 0):
    every row starts with the same prefix // page_size pages, then pages of its own."""
    prefix_pages = prefix // page_size
    suffix_pages = -(-suffix // page_size)
    num_pages = 1 + prefix_pages + batch * suffix_pages
    ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    table = np.zeros((batch, prefix_pages + suffix_pages), np.int32)
    table[:, :prefix_pages] = ids[:prefix_pages]
    table[:, prefix_pages:] = ids[prefix_pages:].reshape(batch, suffix_pages)
    return table, prefix_pages, num_pages


def decode_inputs(rng, batch, prefix, suffix, *, page_size, heads, dtype, kv_dtype=None):
    """Decode batch over `decode_table` pages: (q, kv_pages, kv_lens, page_indices,
    cu_q_lens, num_seqs) and the number of shared pages; queries of `dtype`, pages of
    `kv_dtype` (default `dtype`). KV is drawn on the device so large caches never cross
    the host."""
    num_q_heads, num_kv_heads, head_dim = heads
    table, prefix_pages, num_pages = decode_table(rng, batch, prefix, suffix, page_size=page_size)
    key_kv, key_q = jax.random.split(jax.random.key(int(rng.integers(1 << 30))))
    kv_shape = (num_pages, page_size, 2 * num_kv_heads, head_dim)
    kv_pages = jax.random.normal(key_kv, kv_shape, jnp.float32).astype(kv_dtype or dtype)
    q = jax.random.normal(key_q, (batch, num_q_heads, head_dim), jnp.float32).astype(dtype)
    args = (
        q,
        kv_pages,
        jnp.full((batch,), prefix + suffix, jnp.int32),
        jnp.asarray(table),
        jnp.arange(batch + 1, dtype=jnp.int32),
        jnp.array([batch], jnp.int32),
    )
    return args, prefix_pages


def methods(sm_scale: float, kernel):
    """name -> fn(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, prefix_pages)."""

    def flat(q, kv, kv_lens, table, cu, n, prefix_pages):
        del prefix_pages
        return kernel(q, kv, kv_lens, table, cu, n, sm_scale=sm_scale)

    def cascade(q, kv, kv_lens, table, cu, n, prefix_pages):
        return reference.cascade_attention(
            q, kv, kv_lens, table, cu, n, prefix_pages, sm_scale=sm_scale, attention_fn=kernel
        )

    return {"flat": flat, "cascade": cascade}


def cascade_agreement(fns, inputs, prefix_pages: int, dtype) -> dict:
    """Cascade's output against flat's on one configuration's inputs (every query row
    is a request's decode token): benchmarks.output_agreement's worst difference and
    verdict."""
    outs = {
        name: jax.jit(functools.partial(fn, prefix_pages=prefix_pages))(*inputs)[0]
        for name, fn in fns.items()
    }
    return agreement(outs["cascade"], outs["flat"], dtype)


def run(args) -> tuple[list[dict], dict]:
    heads = (args.q_heads, args.kv_heads, args.head_dim)
    dtype, kv_dtype = jnp.dtype(args.dtype), jnp.dtype(args.kv_dtype)
    kernel = functools.partial(
        ragged_paged_attention, interpret=args.smoke, tpu_generation=args.tpu_generation
    )
    errors = check(
        kernel, heads=heads, dtype=dtype, kv_dtype=kv_dtype, page_size=args.page_size,
        interpret=args.smoke,
    )  # fmt: skip
    print("max |kernel - reference| on this device:", json.dumps(errors))
    peak = PEAK_HBM_BANDWIDTH.get(args.generation)
    copy_bw = copy_bandwidth(1 << 24 if args.smoke else 1 << 29)
    print(
        f"device {jax.devices()[0].device_kind} (generation {args.generation}), peak HBM "
        f"{peak / 1e9 if peak else float('nan'):.0f} GB/s, copy {copy_bw / 1e9:.1f} GB/s"
    )
    kv_bytes_per_token = 2 * args.kv_heads * args.head_dim * kv_dtype.itemsize
    sizes = dict(
        num_q_heads=args.q_heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        kv_itemsize=kv_dtype.itemsize, q_itemsize=dtype.itemsize,
    )  # fmt: skip
    sm_scale = args.head_dim**-0.5
    fns = methods(sm_scale, kernel)
    rng = np.random.default_rng(0)
    header = (
        f"{'B':>4} {'P':>5} {'S':>5} | {'flat us':>9} {'casc us':>9} {'speedup':>7} "
        f"{'KV x':>7} {'all x':>7} | {'flat GB/s':>9} {'%peak':>6} | {'casc GB/s':>9} "
        f"{'vs_bound':>8} | agree"
    )
    print(f"queries {dtype.name}, KV cache {kv_dtype.name}")
    print(header)
    print("-" * len(header))
    results = []
    for batch in args.batch:
        for prefix in args.prefix:
            for suffix in args.suffix:
                inputs, prefix_pages = decode_inputs(
                    rng, batch, prefix, suffix, page_size=args.page_size, heads=heads,
                    dtype=dtype, kv_dtype=kv_dtype,
                )  # fmt: skip
                times = {}
                for name, fn in fns.items():
                    bound = functools.partial(fn, prefix_pages=prefix_pages)
                    loop = looped(lambda q, *rest, f=bound: f(q, *rest), args.reps)
                    times[name] = median_s(loop, *inputs, reps=3) / args.reps
                agree = cascade_agreement(fns, inputs, prefix_pages, dtype)
                flat_bytes = decode_bytes(batch, prefix, suffix, **sizes, cascade=False)
                casc_bytes = decode_bytes(batch, prefix, suffix, **sizes, cascade=True)
                kv = dict(kv_per_token=kv_bytes_per_token)
                flat_kv = kv_bytes(batch, prefix, suffix, **kv, cascade=False)
                casc_kv = kv_bytes(batch, prefix, suffix, **kv, cascade=True)
                row = dict(
                    batch=batch, prefix=prefix, suffix=suffix,
                    flat_s=times["flat"], cascade_s=times["cascade"],
                    flat_total_bytes=flat_bytes, cascade_total_bytes=casc_bytes,
                    flat_kv_bytes=flat_kv, cascade_kv_bytes=casc_kv,
                    speedup=times["flat"] / times["cascade"], bytes_ratio=flat_kv / casc_kv,
                    total_bytes_ratio=flat_bytes / casc_bytes,
                    flat_bandwidth=flat_bytes / times["flat"],
                    cascade_bandwidth=casc_bytes / times["cascade"],
                    flat_fraction_of_peak=flat_bytes / times["flat"] / peak if peak else None,
                    cascade_vs_bytes_bound=times["cascade"] / (casc_bytes / peak) if peak else None,
                    flat_fraction_of_copy=flat_bytes / times["flat"] / copy_bw,
                    cascade_vs_flat_max_abs=agree["max_abs_diff"],
                    outputs_agree=agree["agrees"],
                )  # fmt: skip
                results.append(row)
                pct = f"{100 * row['flat_fraction_of_peak']:6.1f}" if peak else f"{'-':>6}"
                vsb = f"{row['cascade_vs_bytes_bound']:8.2f}" if peak else f"{'-':>8}"
                print(
                    f"{batch:>4} {prefix:>5} {suffix:>5} | {times['flat'] * 1e6:9.1f} "
                    f"{times['cascade'] * 1e6:9.1f} {row['speedup']:7.2f} "
                    f"{row['bytes_ratio']:7.1f} {row['total_bytes_ratio']:7.1f} | "
                    f"{row['flat_bandwidth'] / 1e9:9.2f} {pct} | "
                    f"{row['cascade_bandwidth'] / 1e9:9.2f} {vsb} | "
                    f"{'yes' if agree['agrees'] else 'NO'}"
                )
    meta = dict(
        machine=platform.machine(), jax=jax.__version__, backend=jax.default_backend(),
        device_kind=jax.devices()[0].device_kind, generation=args.generation,
        tuning_key=args.tpu_generation,
        block_sizes=TUNED_BLOCK_SIZES[args.tpu_generation].__dict__,
        peak_hbm_bandwidth=peak, copy_bandwidth=copy_bw, reference_errors=errors,
        q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        page_size=args.page_size, dtype=str(dtype), kv_dtype=str(kv_dtype), reps=args.reps,
        smoke=args.smoke,
    )  # fmt: skip
    return results, meta


def lower_full_size(args) -> None:
    """Lowers the largest flat and cascade calls of the grid for TPU, from any machine."""
    batch, prefix, suffix = max(args.full_batch), max(args.full_prefix), max(args.full_suffix)
    prefix_pages = prefix // args.page_size
    pages_per_seq = prefix_pages + -(-suffix // args.page_size)
    num_pages = 1 + prefix_pages + batch * (pages_per_seq - prefix_pages)
    dtype, kv_dtype = jnp.dtype(args.dtype), jnp.dtype(args.kv_dtype)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    kv_shape = (num_pages, args.page_size, 2 * args.kv_heads, args.head_dim)
    specs = (
        jax.ShapeDtypeStruct((batch, args.q_heads, args.head_dim), dtype),
        jax.ShapeDtypeStruct(kv_shape, kv_dtype),
        i32(batch),
        i32(batch, pages_per_seq),
        i32(batch + 1),
        i32(1),
    )
    kernel = functools.partial(ragged_paged_attention, tpu_generation=args.tpu_generation)
    for name, fn in methods(args.head_dim**-0.5, kernel).items():
        f = jax.jit(functools.partial(fn, prefix_pages=prefix_pages))
        text = f.trace(*specs).lower(lowering_platforms=("tpu",)).as_text()
        calls = text.count("tpu_custom_call")
        assert calls, f"{name}: no Mosaic call in the lowered module"
        print(
            f"lowered {name} B={batch} P={prefix} S={suffix}, {dtype.name} queries over a "
            f"{kv_dtype.name} cache, for TPU: {calls} Mosaic call(s)"
        )


def check_kernel_shapes(parser: argparse.ArgumentParser, args) -> None:
    """parser.error unless the kernel takes --head-dim and --page-size with --dtype
    queries (it raised ValueError mid-run, in a traceback from its first check): the
    kernel's own rule, kernels_pallas.tpu.check_shapes."""
    try:
        check_shapes(args.head_dim, args.page_size, args.dtype, names=("--head-dim", "--page-size"))
    except ValueError as e:
        parser.error(f"{e} (--dtype {args.dtype})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_grid_args(parser, heads=(32, 8, 128), page_flag="--page-size")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="the queries'"
    )
    parser.add_argument(
        "--kv-dtype", choices=["float32", "bfloat16"],
        help="the KV cache's (default: --dtype's); the bytes bound counts its itemsize",
    )  # fmt: skip
    parser.add_argument("--reps", type=positive_int, default=20)
    parser.add_argument(
        "--tpu-generation", default=None, choices=sorted(TUNED_BLOCK_SIZES),
        help="tuning-table key (default: detected from the device, 'default' off TPU)",
    )  # fmt: skip
    parser.add_argument(
        "--smoke", action="store_true",
        help="CPU: tiny case in the TPU interpreter, then lower the full-size calls for TPU",
    )  # fmt: skip
    parser.add_argument("--out", type=out_dir, default=RESULTS_DIR, help="folder (%(default)s)")
    args = parser.parse_args(argv)
    args.kv_dtype = args.kv_dtype or args.dtype
    args.generation = detect_tpu_generation()
    args.tpu_generation = args.tpu_generation or (
        args.generation if args.generation in TUNED_BLOCK_SIZES else "default"
    )
    args.full_batch, args.full_prefix, args.full_suffix = args.batch, args.prefix, args.suffix
    full_heads = args.q_heads, args.kv_heads
    check_head_groups(parser, *full_heads)
    check_kernel_shapes(parser, args)
    if args.smoke:
        args.batch, args.prefix, args.suffix, args.reps = [4], [32], [16], 2
        args.q_heads, args.kv_heads = 8, 2
    check_whole_pages(parser, {*args.full_prefix, *args.prefix}, args.page_size, "--prefix")
    if not args.smoke and jax.default_backend() != "tpu":  # the kernel raised mid-check
        print("no TPU found: run with --smoke on the CPU", file=sys.stderr)
        return 2
    results, meta = run(args)
    if args.smoke:
        args.q_heads, args.kv_heads = full_heads
        lower_full_size(args)
    path = args.out / "tpu_kernel.json"
    write_json(path, dict(meta=meta, units=units_of(meta, *results), results=results))
    print(f"wrote {path}")
    failed = [name for name, e in meta["reference_errors"].items() if not e["ok"]]
    if failed:
        print(f"FAIL: the kernel is outside tolerance of the reference in {failed}")
    wrong = [(r["batch"], r["prefix"], r["suffix"]) for r in results if not r["outputs_agree"]]
    if wrong:
        print(f"FAIL: cascade's output disagrees with flat's at (B, P, S) {wrong}")
    return 1 if failed or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
