"""Decode benchmark of the Pallas GPU ragged paged attention kernel on an NVIDIA GPU.

One run (under 5 minutes on an H100/H200):

1. checks the kernel against `kernels_pallas.reference` on the device (decode, mixed
   prefill/decode, non-causal prefix pass over each --kv-dtype, int8 and float8 KV);
2. measures the device's copy bandwidth (large jnp elementwise copies, read + write, the
   best of bfloat16 and float32);
3. for B in {8, 64, 128} decode requests that share a P-token prefix (P in {1024, 8192})
   and own S more tokens each (S in {128, 1024}), Llama-3-8B heads (32 query heads, 8 KV
   heads, head_dim 128), bfloat16 queries over a cache of each --kv-dtype (default
   bfloat16; after the first, only at --kv-dtype-cells if given, each right after the
   first's row of its cell), page size 16, times
   - flat_unique: the kernel over page tables that share no page (every request has its
     own copy of the prefix): the kernel's DRAM roofline,
   - flat_shared: the kernel over page tables whose first P/16 pages are the same physical
     pages (prefix caching), so the prefix may be served from L2,
   - cascade: prefix pass + suffix pass + LSE merge
     (`kernels_pallas.reference.cascade_attention(attention_fn=kernel)`) on the shared
     tables,
   - jax_paged: `jax.experimental.pallas.ops.gpu.paged_attention` with its default tiling
     on the flat_unique inputs;
4. times the flat kernel per tiling of a sweep at B=64, P=8192, S=128 (--no-sweep skips);
5. writes `gpu_kernel.json` to --out and prints a table with achieved bandwidth, and each
   other cache's times over the first's at the same cell (`kv_dtype_costs`). It
   starts no configuration after --max-seconds (230 s; the sweep gets 40 s more), and
   exits 1 when a check fails, a method disagrees with flat on the inputs it timed, or
   no configuration started.

Bandwidth is the bytes the method must move divided by time (benchmarks/attention_bytes.py:
KV at the cache's itemsize, B*(P+S) tokens for the flat kernels and JAX's, P + B*S tokens
for cascade, plus queries, outputs, and cascade's partial results and merge); fractions
are of the measured copy bandwidth (benchmarks/gpu_timing.py). Each timed call runs
`--reps` kernel calls in one jitted program on distinct queries, and, when the KV of one
call would fit in L2, on distinct copies of the cache (a call never reads what an
earlier call of its program left in L2); before each timed program a buffer twice the
size of L2 is written, untimed, so no program starts warm.

    python benchmarks/gpu_kernel.py --out results/            # on the GPU
    python benchmarks/gpu_kernel.py --out /tmp/smoke --smoke  # CPU: interpret mode, tiny

Queries narrower than the cache compute in the cache's dtype (kernels_pallas.precision):
--kv-dtype bfloat16 float32 --kv-dtype-cells 64,8192,128 times what bfloat16 queries over
a float32 cache cost beside the bfloat16 cache, in one run.

--smoke runs every method in interpret mode on a tiny case and checks it, then lowers
one full-size configuration of every method for CUDA (B=64, P=8192, S=128, with the
flags' --page-size, --jax-k-splits and each --kv-dtype; no GPU needed). The methods and
their lowering are in gpu_kernel_methods.py, the correctness checks in gpu_kernel_checks.py,
the inputs in gpu_kernel_inputs.py.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.attention_bytes import decode_bytes  # noqa: E402
from benchmarks.cli_args import (  # noqa: E402
    check_whole_pages,
    decode_grid,
    out_dir,
    positive_float,
    positive_int,
)
from benchmarks.gpu_kernel_checks import (  # noqa: E402
    checks_passed,
    device_checks,
    disagreeing_cells,
    outputs_agreement,
)
from benchmarks.gpu_kernel_inputs import decode_tables, kv_pool  # noqa: E402
from benchmarks.gpu_kernel_methods import (  # noqa: E402
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_Q_HEADS,
    cascade_fn,
    flat_fn,
    jax_paged_fn,
    lower_full_size,
    split_kv,
)
from benchmarks.gpu_kernel_report import (  # noqa: E402
    goals,
    kv_dtype_costs,
    print_table,
    ratios,
)
from benchmarks.gpu_timing import cache_copies, copy_bandwidth, time_call  # noqa: E402
from benchmarks.json_report import write_json  # noqa: E402

GRID = [(b, p, s) for b in (8, 64, 128) for p in (1024, 8192) for s in (128, 1024)]
SMOKE_CELL = (2, 32, 16)  # (B, P, S) of --smoke's one cell and sweep
SWEEP_CELL = (64, 8192, 128)
Q_DTYPE = "bfloat16"
KV_DTYPES = ("bfloat16", "float16", "float32")  # the float caches the kernel reads


def bench_config(
    b, p, s, *, page_size, reps, repeats, interpret, heads, dtype, jax_k_splits, kv_dtype=None
):
    """One (B, P, S) cell: queries of `dtype` over a cache of `kv_dtype` (default
    `dtype`), each method's time and bandwidth (its bytes at the cache's itemsize for KV,
    q's for queries and outputs), and the methods' agreement with flat."""
    hq, hkv, d = heads
    sm_scale = d**-0.5
    kv_dtype = jnp.dtype(kv_dtype or dtype)
    token_bytes = 2 * hkv * d * kv_dtype.itemsize
    sizes = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, kv_itemsize=kv_dtype.itemsize,
                 q_itemsize=jnp.dtype(dtype).itemsize)  # fmt: skip
    flat_bytes = decode_bytes(b, p, s, **sizes, cascade=False)
    cascade_bytes = decode_bytes(b, p, s, **sizes, cascade=True)
    keys = jax.random.split(jax.random.key(b * 7 + p + s), 4)
    qs = jax.random.normal(keys[0], (reps, b, hq, d), jnp.float32).astype(dtype)
    kv_lens = jnp.full((b,), p + s, jnp.int32)
    cu = jnp.arange(b + 1, dtype=jnp.int32)
    num_seqs = jnp.array([b], jnp.int32)
    row = {"B": b, "P": p, "S": s, "kv_dtype": kv_dtype.name,
           "flat_total_bytes": flat_bytes, "cascade_total_bytes": cascade_bytes,
           "flat_kv_bytes": b * (p + s) * token_bytes,
           "cascade_kv_bytes": (p + b * s) * token_bytes}  # fmt: skip

    def timed(name, fn, args, nbytes):
        t, out = time_call(jax.jit(fn), args, repeats, flush_l2=True)
        row[f"{name}_us"] = t / reps * 1e6
        row[f"{name}_bytes_per_s"] = nbytes / (t / reps)
        print(f"  {name:12s} {t / reps * 1e6:10.1f} us", flush=True)
        return out

    outs = {}
    for layout in ("unique", "shared"):
        shared = layout == "shared"
        pool_bytes_one = (b * s + (p if shared else b * p)) * token_bytes
        copies = cache_copies(pool_bytes_one, reps)
        tables, pages_per_copy = decode_tables(b, p, s, page_size, shared=shared, copies=copies)
        num_pages = copies * pages_per_copy
        kv = kv_pool(keys[1 if shared else 2], num_pages, page_size, hkv, d, kv_dtype)
        tbl = [jnp.asarray(tables[r % copies]) for r in range(reps)]

        def run_flat(qs, kv, tbl):
            return [
                flat_fn(qs[r], kv, kv_lens, tbl[r], cu, num_seqs, sm_scale=sm_scale,
                        interpret=interpret)
                for r in range(reps)
            ]  # fmt: skip

        outs[f"flat_{layout}"] = timed(f"flat_{layout}", run_flat, (qs, kv, tbl), flat_bytes)
        if shared:

            def run_cascade(qs, kv, tbl):
                return [
                    cascade_fn(qs[r], kv, kv_lens, tbl[r], cu, num_seqs,
                               num_prefix_pages=p // page_size, sm_scale=sm_scale,
                               interpret=interpret)
                    for r in range(reps)
                ]  # fmt: skip

            outs["cascade"] = timed("cascade", run_cascade, (qs, kv, tbl), cascade_bytes)
        else:
            k_pages, v_pages = split_kv(kv)

            def run_jax(qs, k_pages, v_pages, tbl):
                return [
                    jax_paged_fn(qs[r], k_pages, v_pages, tbl[r], kv_lens, sm_scale=sm_scale,
                                 interpret=interpret, k_splits=jax_k_splits)
                    for r in range(reps)
                ]  # fmt: skip

            outs["jax_paged"] = timed("jax_paged", run_jax, (qs, k_pages, v_pages, tbl), flat_bytes)
            del k_pages, v_pages
        del kv

    return row | outputs_agreement(outs, dtype)  # main exits 1 on a disagreement


SWEEP = [
    dict(block_k=bk, num_warps=w, num_stages=st, num_kv_splits=sp)
    for bk in (64, 128)
    for w in (4, 8)
    for st in (2, 3)
    for sp in (1, 2)
]


def sweep(
    b, p, s, *, page_size, reps, repeats, copy_bps, deadline, heads, interpret, tilings,
    kv_dtype=Q_DTYPE,
):  # fmt: skip
    """flat_unique at one configuration over a few tilings (the defaults are untuned):
    bfloat16 queries over a cache of `kv_dtype`."""
    hq, hkv, d = heads
    kv_dtype = jnp.dtype(kv_dtype)
    flat_bytes = decode_bytes(b, p, s, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                              kv_itemsize=kv_dtype.itemsize, q_itemsize=2,
                              cascade=False)  # fmt: skip
    tables, pages_per_copy = decode_tables(b, p, s, page_size, shared=False, copies=1)
    kv = kv_pool(jax.random.key(3), pages_per_copy, page_size, hkv, d, kv_dtype)
    qs = jax.random.normal(jax.random.key(4), (reps, b, hq, d), jnp.float32).astype(jnp.bfloat16)
    table = jnp.asarray(tables[0])
    kv_lens = jnp.full((b,), p + s, jnp.int32)
    cu = jnp.arange(b + 1, dtype=jnp.int32)
    num_seqs = jnp.array([b], jnp.int32)
    rows = []
    for knobs in tilings:
        if time.perf_counter() > deadline:
            break

        def run(qs, kv, knobs=knobs):
            return [
                flat_fn(qs[r], kv, kv_lens, table, cu, num_seqs, sm_scale=d**-0.5,
                        interpret=interpret, **knobs)
                for r in range(reps)
            ]  # fmt: skip

        row = {**knobs, "kv_dtype": kv_dtype.name}
        try:
            t, _ = time_call(jax.jit(run), (qs, kv), repeats, flush_l2=True)
            row |= {"us": t / reps * 1e6, "fraction_of_copy": flat_bytes / (t / reps) / copy_bps}
        except Exception as e:  # e.g. out of shared memory for this tiling
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"sweep B={b} P={p} S={s} {row}", flush=True)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- main


def check_kv_dtypes(ap: argparse.ArgumentParser, kv_dtypes, cells, grid) -> None:
    """ap.error unless --kv-dtype names each dtype once and --kv-dtype-cells, given only
    with a second --kv-dtype, names cells of the grid (elsewhere no row of the first
    dtype would stand beside it)."""
    if len(set(kv_dtypes)) < len(kv_dtypes):
        ap.error(f"--kv-dtype {' '.join(kv_dtypes)}: each dtype once")
    if cells is None:
        return
    if len(kv_dtypes) < 2:
        ap.error("--kv-dtype-cells needs a second --kv-dtype to time at them")
    outside = [cell for cell in cells if cell not in grid]
    if outside:
        ap.error(f"--kv-dtype-cells {outside}: not cells of the grid {grid}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=out_dir, help="folder for gpu_kernel.json")
    ap.add_argument("--smoke", action="store_true", help="tiny interpret-mode run on the CPU")
    ap.add_argument("--reps", type=positive_int, default=5, help="kernel calls per timed program")
    ap.add_argument("--repeats", type=positive_int, default=5, help="timed programs per method")
    ap.add_argument("--page-size", type=positive_int, default=16)
    ap.add_argument("--jax-k-splits", type=positive_int, default=16, help="JAX k_splits")
    ap.add_argument(
        "--max-seconds",
        type=positive_float,
        default=230.0,
        help="start no config (sweep: +40 s) past this",
    )
    ap.add_argument("--only", type=decode_grid, help="B,P,S cells, e.g. '64,8192,128;8,1024,128'")
    ap.add_argument(
        "--kv-dtype", nargs="+", default=[Q_DTYPE], choices=KV_DTYPES,
        help="the cache's dtypes, each cell timed with each (default: the queries', "
        "bfloat16); the sweep and the goals take the first",
    )  # fmt: skip
    ap.add_argument(
        "--kv-dtype-cells", type=decode_grid,
        help="B,P,S cells of the grid the --kv-dtype after the first are timed at "
        "(default: every cell)",
    )  # fmt: skip
    ap.add_argument(
        "--no-sweep", dest="sweep", action="store_false", help="skip the flat tiling sweep"
    )
    args = ap.parse_args(argv)
    grid = args.only or ([SMOKE_CELL] if args.smoke else GRID)
    check_kv_dtypes(ap, args.kv_dtype, args.kv_dtype_cells, grid)
    sweep_cell = SMOKE_CELL if args.smoke else SWEEP_CELL
    prefixes = sorted({p for _, p, _ in grid})
    check_whole_pages(
        ap, prefixes, args.page_size, "--only" if args.only else "the grid's prefixes"
    )
    if args.sweep:
        check_whole_pages(
            ap, [sweep_cell[1]], args.page_size, "the sweep's prefix (--no-sweep skips it)"
        )
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    if args.smoke:
        heads, reps, repeats = (4, 2, 64), 2, 1
    else:
        heads, reps, repeats = (NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM), args.reps, args.repeats
    result = {
        "device": f"{dev.platform} {getattr(dev, 'device_kind', '')}",
        "jax": jax.__version__,
        "smoke": args.smoke,
        "page_size": args.page_size,
        "heads": list(heads),  # the rows' (--smoke times smaller ones)
        "dtype": Q_DTYPE,  # the queries'; each row names its cache's kv_dtype
        "kv_dtypes": args.kv_dtype,
    }
    print(f"device: {result['device']}  jax {jax.__version__}", flush=True)
    if not args.smoke and dev.platform != "gpu":
        print("no GPU found: run with --smoke on the CPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)

    result["checks"] = device_checks(
        interpret=args.smoke, small=args.smoke, kv_dtypes=args.kv_dtype
    )
    copy_bytes = 2**20 if args.smoke else 2 * 2**30
    copies = copy_bandwidth(copy_bytes, repeats=3 if args.smoke else 10)
    copy_bps = max(copies.values())
    result["copy_bytes_per_s"] = copy_bps
    result["copy_bytes_per_s_by_dtype"] = copies
    by_dtype = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in copies.items())
    print(f"copy bandwidth: {copy_bps / 1e9:.0f} GB/s, read + write ({by_dtype})")

    rows = result["rows"] = []  # the JSON holds the list, empty if no cell starts
    first_kv, *other_kvs = args.kv_dtype
    other_cells = grid if args.kv_dtype_cells is None else args.kv_dtype_cells
    for b, p, s in grid:
        # Each cell's cache dtypes back to back, so their times are compared under the
        # same conditions.
        for kv_dtype in [first_kv, *(other_kvs if (b, p, s) in other_cells else [])]:
            if time.perf_counter() - t_start > args.max_seconds:
                print(f"skipping B={b} P={p} S={s} {kv_dtype}: past --max-seconds", flush=True)
                continue
            print(f"B={b} P={p} S={s}, {Q_DTYPE} queries over a {kv_dtype} cache", flush=True)
            row = bench_config(
                b, p, s, page_size=args.page_size, reps=reps, repeats=repeats,
                interpret=args.smoke, heads=heads, dtype=jnp.dtype(Q_DTYPE),
                kv_dtype=jnp.dtype(kv_dtype), jax_k_splits=2 if args.smoke else args.jax_k_splits,
            )  # fmt: skip
            rows.append(row | ratios(row, copy_bps))  # the table's ratios, in the JSON too
            write_json(args.out / "gpu_kernel.json", result)
    print_table(rows, copy_bps)
    result["kv_dtype_costs"] = kv_dtype_costs(rows, first_kv)
    for cost in result["kv_dtype_costs"]:
        print(f"cache {cost['kv_dtype']} over {first_kv}: {json.dumps(cost)}")
    result["goals"] = goals([r for r in rows if r["kv_dtype"] == first_kv], copy_bps)
    if args.sweep:
        b, p, s = sweep_cell
        tilings = [dict(block_k=16, num_kv_splits=2)] if args.smoke else SWEEP
        result["sweep"] = sweep(
            b, p, s, page_size=args.page_size, reps=reps, repeats=repeats, copy_bps=copy_bps,
            deadline=t_start + args.max_seconds + 40, heads=heads, interpret=args.smoke,
            tilings=tilings, kv_dtype=first_kv,
        )  # fmt: skip
    if args.smoke:
        # The flags' page size and k_splits (the interpreted run's tables are too short
        # for more than 2 splits), over each cache dtype.
        result["lowered_full_size"] = {
            kv: lower_full_size(page_size=args.page_size, k_splits=args.jax_k_splits, kv_dtype=kv)
            for kv in args.kv_dtype
        }
    result["seconds"] = time.perf_counter() - t_start
    write_json(args.out / "gpu_kernel.json", result)
    print(json.dumps(result["goals"], indent=1))
    print(f"wrote {args.out / 'gpu_kernel.json'} in {result['seconds']:.0f} s")
    wrong = disagreeing_cells(rows)
    if wrong:
        print(f"FAIL: cascade or JAX's kernel disagrees with flat at (B, P, S) {wrong}")
    if not rows:
        print(f"FAIL: no cell measured: the checks took past --max-seconds {args.max_seconds}")
    return 0 if checks_passed(result["checks"]) and rows and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
